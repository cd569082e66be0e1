"""What the CUDA backend's copy strategies (``dma``, ``direct``, ``staged``) share:
the interface the backend drives and the recorded steps several of them take.

A strategy never makes a CUDA call: it records the calls of one transfer into the ``Recorder`` it
is handed for that transfer (the backend makes a new one per transfer and runs its program), and
takes streams and events from the pools it was built with. It holds no per-transfer state.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

from kvtier.copy.cuda.executor import Recorder
from kvtier.copy.cuda.plan import Plan
from kvtier.copy.cuda.queue import Transfer
from kvtier.copy.cuda.resources import EventPool, StagingRing, StreamPool
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)


class Strategy(ABC):
    name: ClassVar[str]
    """Its ``CopyStrategy`` value."""

    @abstractmethod
    def estimate_ops(self, transfer: Transfer) -> int:
        """Copies and launches the transfer enqueues (an upper bound, for ``max_device_ops``)."""

    @abstractmethod
    def enqueue(self, rec: Recorder, transfer: Transfer, plan: Plan) -> None:
        """Record the transfer's copies on ``transfer.stream`` (after its gate, before its final
        event, both recorded by the backend); a ``layerwise`` transfer also records an event
        after each layer into ``transfer.layer_events``."""

    def shared_ring(self, transfer: Transfer, to_host: bool) -> StagingRing | None:
        """The staging ring whose streams the transfer runs on; None: streams of its own."""
        return None


def choose_strategy(
    requested: str,
    kernel_why: str,
    has_batch_memcpy: bool,
    small_pieces: bool,
    planner_missing: Callable[[], str],
) -> str:
    """The strategy to run: ``requested`` (``copy.strategy``), or for ``auto`` the best one that
    can run here; a configuration error where the one asked for cannot. ``kernel_why``: why the
    kernel cannot run ('' if it can); ``small_pieces``: the engine's merged regions are below
    ``dma_min_piece_bytes``; ``planner_missing``: why the staged planner cannot run (asked only
    where it matters: it builds the C file)."""
    dma_why = "" if has_batch_memcpy else "cudaMemcpyBatchAsync needs CUDA runtime >= 12.8"
    strategy = requested
    if strategy in ("kernel", "staged") and kernel_why:
        raise ConfigError("copy.strategy", strategy, f"the kernel cannot run here: {kernel_why}")
    staged_why = (dma_why or planner_missing()) if strategy in ("auto", "staged") else ""
    if strategy == "staged" and staged_why:
        raise ConfigError("copy.strategy", strategy, staged_why)
    if strategy == "auto":
        if not small_pieces or kernel_why:
            strategy = "dma"  # large pieces, or no kernel: the copy engines alone
        elif staged_why:
            strategy = "kernel"
        else:
            strategy = "staged"
    if strategy == "dma" and dma_why:
        log.warning("%s: falling back to one cudaMemcpyAsync per piece", dma_why)
    return strategy


def retire(rec: Recorder, event: int) -> None:
    """``event`` is no longer needed by the transfer being recorded: back to the pool once its
    program ran (a wait recorded on it binds only when it is made)."""
    rec.program.retired_events.append(event)


def hand_over(rec: Recorder, events: EventPool, src: int, *dsts: int) -> None:
    """Work enqueued on ``dsts`` from now on starts after the work enqueued on ``src`` so far."""
    event = events.acquire()
    retire(rec, event)  # a wait binds to the record made before it
    rec.event_record(event, src)
    for dst in dsts:
        rec.stream_wait_event(dst, event)


def take_lanes(streams: StreamPool, transfer: Transfer, lanes: int) -> list[int]:
    """``lanes`` extra streams of the transfer's own (kept in ``aux_streams``, released with it)."""
    while len(transfer.aux_streams) < lanes:
        transfer.aux_streams.append(streams.acquire())
    return transfer.aux_streams[:lanes]


def layer_done(rec: Recorder, events: EventPool, transfer: Transfer) -> None:
    """Record the event ``stream_wait(job, layer)`` waits for, after the layer's copies."""
    event = events.acquire()
    transfer.layer_events.append(event)
    rec.event_record(event, transfer.stream)
