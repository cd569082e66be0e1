"""The ``staged`` strategy: blocks gathered/scattered by the copy kernel through device staging
buffers, whole chunks moved across PCIe by the copy engines; its pipeline as a table of executor
ops, built for all chunks at once.

A staged transfer moves its blocks in chunks through the device staging buffers of its direction
(used in turn, ``B`` of them). Per chunk ``k`` on buffer ``j``, with ``lane`` its DMA stream
(chunks alternate lanes) and ``main`` the transfer's stream:

* STORE: ``main`` waits until buffer ``j`` is free, the kernel gathers the chunk's blocks into it,
  ``lane`` waits for the kernel (a hand-over event), the copy engines move the chunk to the pool,
  and an event on ``lane`` marks buffer ``j`` free again.
* LOAD: ``lane`` waits until buffer ``j`` is free, the copy engines move the chunk from the pool,
  ``main`` waits for the copy (a hand-over event), the kernel scatters the chunk into the engine's
  blocks, and an event on ``main`` marks buffer ``j`` free again.

At the end of a STORE ``main`` waits for every lane. Six ops per chunk, so 512 blocks in about ten
chunks are some sixty ops, with a kernel parameter block and a copy list per chunk: computed in
Python they took most of a staged submit (0.3-1 ms on the H100 leases' CPUs), so
``kvx_plan_staged`` in ``executor.c`` writes them, in one pass over the blocks. Where that
C file cannot be built the strategy is not available (``planner_missing``).

Jobs of fewer than ``staged_min_blocks`` blocks and layer-wise jobs go the ``kernel`` strategy's
way (a staging chunk holds whole blocks: no layer would be complete before the last).
"""

from __future__ import annotations

import ctypes
from array import array
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from kvtier.copy.base import Direction
from kvtier.copy.cuda.direct import KernelStrategy
from kvtier.copy.cuda.executor import (
    ATTR_INDEX_ADDRESS,
    WORDS,
    ExecutorUnavailable,
    Recorder,
    load_library,
    pointer_of,
)
from kvtier.copy.cuda.kernels import THREADS, WARPS
from kvtier.copy.cuda.options import CudaCopyOptions
from kvtier.copy.cuda.plan import (
    KERNEL_CAPACITIES,
    PinnedPieces,
    Plan,
    param_bytes,
    pick_capacity,
)
from kvtier.copy.cuda.queue import Transfer
from kvtier.copy.cuda.resources import EventPool, StagingRing, StreamPool
from kvtier.copy.cuda.runtime import MemcpyAttributes
from kvtier.copy.cuda.strategy import Strategy, hand_over, retire, take_lanes

STAGE_RAMP_GROWTH = 4
"""Each ramp chunk is this many times the one before: the kernel moves a chunk about ten times
faster than PCIe does, so a 4x larger neighbour still hides behind the smaller one's DMA."""


def chunk_sizes(n: int, per: int, ramp: int, to_host: bool) -> list[int]:
    """Blocks per staging chunk for an ``n``-block transfer through ``per``-block buffers.

    A STORE gathers chunk 0 before any DMA can start, and a LOAD scatters its last chunk after
    the last DMA: that kernel step is the part of the pipeline nothing hides. So the chunks at
    that end are small (``ramp`` blocks, then growing ``STAGE_RAMP_GROWTH`` times per chunk up
    to ``per``): first for a STORE, last for a LOAD.
    """
    sizes: list[int] = []
    left, size = n, min(ramp, per)
    while left > 0:
        take = min(size, left)
        sizes.append(take)
        left -= take
        size = min(size * STAGE_RAMP_GROWTH, per)
    return sizes if to_host else sizes[::-1]


@dataclass(frozen=True, slots=True)
class StagedKernel:
    """How a staged transfer launches the copy kernel."""

    function: int
    capacity: int
    threads: int
    warps: int
    max_sms: int
    region_table: int
    piece_bytes: int
    n_regions: int


@dataclass(slots=True)
class StagedOps:
    rows: np.ndarray
    """The chunks' ops, ``(n, WORDS)`` uint64."""
    memory: np.ndarray
    """What they point at (kernel parameters, copy lists): keep it until they ran."""
    retired: list[int]
    """Events the transfer is done with once its ops ran (hand-overs, replaced free events)."""


PLAN_FIELDS = (
    *("n_blocks", "blocks", "hosts", "to_host", "block_bytes", "n_chunks", "chunk_blocks"),
    *("main_stream", "n_lanes", "lanes", "events"),
    *("ring_base", "buffer_bytes", "n_buffers", "first_buffer", "buffer_free"),
    *("kernel", "threads", "warps", "max_sms", "capacity", "param_bytes", "region_table"),
    *("piece_bytes", "n_regions", "attrs", "attr_index"),
    *("ops", "params", "kernel_params", "copy_dsts", "copy_srcs", "copy_sizes"),
    *("pin_base", "pin_step"),
)
"""``StagedPlan`` of ``executor.c``: every field is 8 bytes, so it is passed as uint64
words in this order."""


def plan_staged(
    blocks: np.ndarray,
    hosts: np.ndarray,
    to_host: bool,
    block_bytes: int,
    sizes: list[int],
    main: int,
    lanes: list[int],
    events: list[int],
    ring: StagingRing,
    kernel: StagedKernel,
    attrs: int,
    pieces: PinnedPieces,
) -> StagedOps:
    """The ops of a staged transfer of ``blocks`` (int64 ids) to or from ``hosts`` (uint64
    addresses) in chunks of ``sizes`` blocks, with ``2 * len(sizes)`` fresh ``events``
    (hand-overs, then buffer-free events); no host copy runs across the start of one of the
    pool's pinned ``pieces``. Updates ``ring`` as if the ops had been made."""
    chunks, n = len(sizes), len(blocks)
    n_buffers = len(ring.free)
    first = ring.next
    param_words = param_bytes(kernel.capacity) // 8
    small = [*sizes, *lanes, *events, *ring.free]
    # One array for the outputs (ops, parameter rows, kernelParams slots, three copy lists)
    # and the inputs (block ids, host addresses, the small lists above), at these offsets:
    words = [6 * chunks * WORDS, chunks * param_words, chunks, n, n, n, n, n, len(small)]
    ends = list(accumulate(words))
    memory = np.zeros(ends[-1], dtype=np.uint64)
    memory[ends[5] : ends[6]] = blocks  # (int64 ids, non-negative: stored as they are)
    memory[ends[6] : ends[7]] = hosts
    memory[ends[7] :] = small
    base = pointer_of(memory)
    at = [base] + [base + 8 * end for end in ends[:-1]]
    small_at = at[8]
    fields = {
        "n_blocks": n,
        "blocks": at[6],
        "hosts": at[7],
        "to_host": int(to_host),
        "block_bytes": block_bytes,
        "n_chunks": chunks,
        "chunk_blocks": small_at,
        "main_stream": main,
        "n_lanes": len(lanes),
        "lanes": small_at + 8 * chunks,
        "events": small_at + 8 * (chunks + len(lanes)),
        "ring_base": ring.base,
        "buffer_bytes": ring.buffer_bytes,
        "n_buffers": n_buffers,
        "first_buffer": first,
        "buffer_free": small_at + 8 * (3 * chunks + len(lanes)),
        "kernel": kernel.function,
        "threads": kernel.threads,
        "warps": kernel.warps,
        "max_sms": kernel.max_sms,
        "capacity": kernel.capacity,
        "param_bytes": 8 * param_words,
        "region_table": kernel.region_table,
        "piece_bytes": kernel.piece_bytes,
        "n_regions": kernel.n_regions,
        "attrs": attrs,
        "attr_index": ATTR_INDEX_ADDRESS,
        **dict(zip(PLAN_FIELDS[-8:-2], at[:6], strict=True)),
        "pin_base": pieces.base,
        "pin_step": pieces.step,
    }
    plan = array("Q", [fields[name] for name in PLAN_FIELDS])
    count = load_library().kvx_plan_staged(plan.buffer_info()[0])
    # Chunk k waited for the event that freed its buffer last: chunk k - n_buffers's, or, for
    # the first uses, one an earlier transfer left in the ring. All but the newest are done.
    frees = events[chunks:]
    used = [(first + k) % n_buffers for k in range(min(chunks, n_buffers))]
    retired = events[:chunks] + [ring.free[j] for j in used if ring.free[j]]
    retired += frees[: max(0, chunks - n_buffers)]
    for k in range(max(0, chunks - n_buffers), chunks):
        ring.free[(first + k) % n_buffers] = frees[k]
    ring.next = (first + chunks) % n_buffers
    rows = memory[: count * WORDS].reshape(-1, WORDS)
    return StagedOps(rows, memory, retired)


def planner_missing() -> str:
    """Why the native planner (``executor.c``) cannot run ('' if it can)."""
    try:
        load_library()
    except ExecutorUnavailable as exc:
        return f"it needs the native planner: {exc}"
    return ""


class StagedStrategy(Strategy):
    name = "staged"

    def __init__(
        self,
        direct: KernelStrategy,
        rings: dict[bool, StagingRing],
        attrs: dict[bool, MemcpyAttributes],
        options: CudaCopyOptions,
        streams: StreamPool,
        events: EventPool,
        pieces: PinnedPieces,
    ) -> None:
        """``direct``: the kernel strategy small and layer-wise jobs take; ``rings``: the staging
        ring per direction (``to_host``); ``attrs``: the chunks' batched-copy attributes;
        ``pieces``: where the pool's pinned pieces begin."""
        self._direct = direct
        self._pieces = pieces
        self._rings = rings
        self._attrs = attrs
        self._block = direct.geometry.block_bytes
        self._ramp = max(1, options.stage_ramp_bytes // self._block)
        self._min_blocks = options.staged_min_blocks
        self._lanes = options.stage_lanes
        self._shared = options.stage_shared_streams
        self._streams = streams
        self._events = events

    def stages(self, transfer: Transfer) -> bool:
        """Whether this transfer goes through the staging buffers."""
        return not transfer.layerwise and len(transfer.job.engine_blocks) >= self._min_blocks

    def shared_ring(self, transfer: Transfer, to_host: bool) -> StagingRing | None:
        return self._rings[to_host] if self._shared and self.stages(transfer) else None

    def estimate_ops(self, transfer: Transfer) -> int:
        if not self.stages(transfer):
            return self._direct.estimate_ops(transfer)
        n = len(transfer.job.engine_blocks)
        to_host = transfer.job.direction is Direction.STORE
        per = self._rings[to_host].buffer_bytes // self._block
        return n + len(chunk_sizes(n, per, self._ramp, to_host))

    def enqueue(self, rec: Recorder, transfer: Transfer, plan: Plan) -> None:
        """Chunks of blocks through the staging ring; a buffer is reused only after the step
        that last used it."""
        if not self.stages(transfer):
            self._direct.enqueue(rec, transfer, plan)
            return
        ring, direct = self._rings[plan.to_host], self._direct
        per = min(ring.buffer_bytes // self._block, KERNEL_CAPACITIES[-1])  # one launch per chunk
        sizes = chunk_sizes(len(plan.blocks), per, self._ramp, plan.to_host)
        capacity = pick_capacity(max(sizes))
        kernel = StagedKernel(
            direct.functions[capacity],
            capacity,
            THREADS,
            WARPS,
            direct.max_sms,
            direct.region_table,
            direct.geometry.piece_bytes,
            len(direct.geometry.regions),
        )
        shared = transfer.shares_streams
        lanes = ring.lanes if shared else take_lanes(self._streams, transfer, self._lanes)
        attrs = self._attrs[plan.to_host]
        staged = plan_staged(
            plan.blocks,
            plan.hosts,
            plan.to_host,
            self._block,
            sizes,
            transfer.stream,
            lanes,
            self._events.acquire_many(2 * len(sizes)),
            ring,
            kernel,
            ctypes.addressof(attrs),
            self._pieces,
        )
        rec.add_rows(staged.rows, staged.memory, attrs)
        for event in staged.retired:
            retire(rec, event)
        if plan.to_host:
            for lane in lanes:
                hand_over(rec, self._events, lane, transfer.stream)
