"""The worker-side copy interface: engine KV blocks <-> host pool slots.

One backend per device kind (``cpu``, ``cuda``). The engine adapter translates its KV tensors and
block ids; a backend only moves bytes.

Slot layout: a slot holds one kvtier block, i.e. ``blocks_per_slot`` consecutive engine blocks of
every layer. With tensor parallelism the slot is split into ``tp_size`` equal parts and rank ``r``
owns part ``r``; within its part a backend chooses the arrangement (recorded in the namespace's
``layout``), so two backends with different arrangements never share blocks.

Skipped positions: in a LOAD, an engine block id ``SKIP`` means the engine already holds that
position's tokens (vLLM's own prefix cache covers the start of the first kvtier block): that
position of its slot is not copied, the slot's other positions are, each into its own engine
block, exactly as without the skip. A LOAD whose every position is ``SKIP`` is done without a
copy. ``SKIP`` in a STORE is an invalid job (reported failed). Every backend honours this.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from kvtier.copy.options import CopyConfig
from kvtier.pool import HostPool

SKIP = -1
"""A LOAD's engine block id for a position the engine already holds (see the module docstring)."""


class Direction(Enum):
    """Which way a copy between the engine and the pool goes: the engine loads and stores (the
    planner's ledger and the copier use it too); a tier is read and written instead
    (``tiers.base.TierJobKind``). See docs/architecture.md's vocabulary."""

    STORE = "store"
    """Engine blocks -> pool slots."""
    LOAD = "load"
    """Pool slots -> engine blocks."""


@dataclass(slots=True)
class CopyJob:
    job_id: int
    direction: Direction
    engine_blocks: Sequence[int]
    """``len(slots) * blocks_per_slot`` engine block ids, slot by slot (``SKIP``: not copied,
    LOAD only)."""
    slots: Sequence[int]
    groups: Sequence[int] | None = None
    """Per slot, the KV cache group whose layers it holds (``copy.grouped``); None: one group."""


@dataclass(slots=True)
class CopyResults:
    done: list[int]
    failed: list[int]


@dataclass(frozen=True, slots=True)
class BackendSetup:
    """Everything a copy backend is built with besides the KV tensors (``CopyBackend.create``)."""

    pool: HostPool
    blocks_per_slot: int = 1
    """Engine blocks per kvtier block (per slot)."""
    tp_rank: int = 0
    tp_size: int = 1
    copy: CopyConfig = field(default_factory=CopyConfig)
    """The config's ``copy`` section, parsed once by the engine adapter."""
    allow_pageable: bool = False
    """``pool.allow_pageable``: keep running where pinning the pool fails."""


class CopyBackend(ABC):
    """Moves blocks between engine KV memory and pool slots, asynchronously where the device can.

    ``submit`` never raises for a bad job: the job is reported failed by ``poll`` instead. Each job
    is reported exactly once. A STORE reads the engine blocks only after the work queued before
    ``submit`` on the engine's compute stream (the forward pass that wrote them) finished. A LOAD is
    complete, visible to the engine's next kernels, when ``poll`` reports it done or when
    ``wait(job_id)`` returns.

    A backend is built by ``create(kv_caches, setup)``: the one call that
    ``engine.backends.make_backend`` makes for every backend, built-in or registered.
    """

    @classmethod
    @abstractmethod
    def create(cls, kv_caches: Sequence[Any], setup: BackendSetup) -> CopyBackend:
        """A backend for the engine's per-layer KV tensors (all on this backend's device type)
        and ``setup``; raises when it cannot copy them (the copier then fails every order)."""

    @abstractmethod
    def submit(self, job: CopyJob) -> None: ...

    @abstractmethod
    def poll(self) -> CopyResults: ...

    @abstractmethod
    def wait(self, job_ids: Sequence[int]) -> None:
        """Block until the given jobs finished (success or failure); then ``poll`` reports them."""

    def fence(self, job_ids: Sequence[int]) -> None:
        """Make the engine's next work (on its compute stream) start only after these jobs
        finished: a STORE's engine blocks may then be overwritten. Waits on the host unless the
        device can order it itself."""
        self.wait(job_ids)

    @abstractmethod
    def close(self) -> None: ...

    @property
    @abstractmethod
    def slot_part_bytes(self) -> int:
        """Bytes of one rank's part of a slot for the registered KV geometry."""
