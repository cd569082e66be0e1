"""The CUDA copy backend: engine KV blocks on an NVIDIA GPU <-> the pinned shared host pool.

How a transfer runs:

* ``submit`` notes the point on the caller's current stream the job must wait for (an event
  recorded there; or the caller's own ``after=`` event, e.g. one per engine step for many jobs)
  and queues the job. While fewer than ``max_in_flight`` transfers are enqueued and unfinished
  the job is planned at once (else by a later ``submit``, ``poll`` or ``wait`` that finds room):
  its CUDA calls are recorded and handed to the executor's native thread (``cuda_executor``),
  which makes them without the GIL. So no number of outstanding transfers ever fills a CUDA
  queue and blocks the host inside ``submit``, and no CUDA call runs on the engine's thread.
* An enqueued transfer runs on a stream of its own from a pool of ``max_streams`` CUDA streams,
  created at registration (creating streams later can take milliseconds; past the pool size busy
  streams are shared round robin), with events from an event pool. Streams and events go back to
  their pools when ``poll`` or ``wait`` sees the transfer finished, on every path: a failure while
  enqueueing keeps the transfer in flight, marked failed, until the work already enqueued has
  drained, so a slot is never freed while a copy may still touch it. Staged transfers (below) are
  the exception: those of one direction share that direction's staging streams, as the staging
  buffers order them on the GPU anyway (``cuda_staged.StagingRing`` says why).
* On the GPU it first waits for the noted point: a STORE reads blocks only after the forward pass
  that wrote them; a LOAD overwrites blocks only after the kernels queued before it, which may
  still read them.
* It copies with one strategy, chosen at registration (``auto``: by layout and the measurements in
  ``docs/cuda.md``):
  ``dma``: ``cudaMemcpyBatchAsync`` (CUDA >= 12.8) over all pieces, on the copy engines, no SM;
  for large pieces (``BLOCK_COMPACT``: one 2 MiB copy per block), spread over ``dma_lanes``
  streams so two copy engines hide each other's per-copy gaps.
  ``staged``: for small pieces (vLLM's per-layer layout: 32 KiB per layer, K/V and block). The
  gather/scatter kernel of ``cuda_kernels`` (on at most ``max_sms`` SMs) packs the blocks into a
  device staging buffer, at device-memory speed, and the copy engines move whole blocks across
  PCIe; chunks are double-buffered so the two overlap, and small at the end whose kernel step
  nothing hides (``chunk_sizes``).
  ``kernel``: the same kernel reading and writing the mapped host pool directly, no staging; it
  leaves the copy engines free but moves fewer bytes per PCIe transaction (about 93% of a DMA).
  A ``staged`` backend runs ``layerwise`` jobs this way, layer by layer.
* A LOAD is complete, visible to the next kernels of any stream, once ``poll`` reported it or
  ``wait`` returned. ``stream_wait`` makes the current stream wait for a load (or, for a
  ``layerwise`` load, one layer of it) without blocking the host.

The pool is registered with ``cudaHostRegister`` (page-locked and mapped, in pieces of about
``register_chunk_bytes``), so DMA runs at full speed and the kernel can address it. If that fails
the backend raises ``PoolError`` with the reason, unless ``allow_pageable`` is set (then only the
DMA strategy is available, at pageable-memory speed).

One backend serves one engine thread (its methods are not meant to be called from several); by
default a native thread of its own makes the CUDA calls that enqueue transfers
(``CudaCopyOptions.issue_thread``; where no C compiler can build it, the caller's thread does).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvtier.copy.base import SKIP, CopyBackend, CopyJob, CopyResults, Direction
from kvtier.copy.cuda_executor import (
    Executor,
    ExecutorUnavailable,
    Program,
    ProgramState,
    Recorder,
    load_library,
)
from kvtier.copy.cuda_kernels import THREADS
from kvtier.copy.cuda_plan import (
    KERNEL_CAPACITIES,
    CopyList,
    KVGeometry,
    KVLayout,
    RegionArrays,
    check_job,
    copy_list,
    describe_kv,
    host_block_addresses,
    merge_regions,
    pack_params,
    param_bytes,
    pick_capacity,
    region_table,
    with_region_begins,
)
from kvtier.copy.cuda_runtime import (
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    CUDA_SUCCESS,
    CudaError,
    CudaRuntime,
    memcpy_attributes,
    runtime,
)
from kvtier.copy.cuda_staged import StagedKernel, StagingRing, chunk_sizes, plan_staged
from kvtier.errors import ConfigError, PoolError
from kvtier.pool import HostPool

log = logging.getLogger(__name__)

STRATEGIES = ("auto", "dma", "staged", "kernel")
WARPS = THREADS // 32
"""Warps per CTA of the copy kernel: one piece each at a time."""
DEFAULT_MAX_SMS = 8
GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class CudaCopyOptions:
    strategy: str = "auto"
    """``auto``: ``dma`` for pieces of at least ``dma_min_piece_bytes``, else ``staged``;
    or one of ``dma``, ``staged``, ``kernel`` (see the module docstring)."""
    max_sms: int = 0
    """SMs the copy kernel may occupy (its grid size); 0: ``DEFAULT_MAX_SMS``."""
    allow_pageable: bool = False
    """Run on pageable memory (DMA only, slow) where pinning the pool fails, instead of raising."""
    dma_min_piece_bytes: int = 256 << 10
    dma_lanes: int = 1
    """Streams one ``dma`` transfer is spread over (1: back-to-back transfers already overlap)."""
    stage_lanes: int = 2
    """Streams the staging chunks' DMAs alternate over, so consecutive chunks overlap."""
    prefer_copy_engine: bool = True
    """Ask ``cudaMemcpyBatchAsync`` for the copy engines (never SMs) for DMA copies."""
    stage_bytes: int = 128 * MIB
    """Size of one staging buffer (``staged``): ``stage_buffers`` per direction are allocated on
    the device (512 MiB by default). Smaller buffers cost more chunks, so more issue time."""
    stage_buffers: int = 2
    stage_ramp_bytes: int = 8 * MIB
    """``staged``: the first chunks of a STORE grow from about this size to ``stage_bytes``, and
    the last chunks of a LOAD shrink to it, so the kernel step that cannot overlap a DMA (the
    first gather, the last scatter) is short. ``stage_bytes`` or more: equal chunks."""
    staged_min_blocks: int = 8
    """``staged``: jobs of fewer engine blocks go straight to the pool through the kernel."""
    stage_shared_streams: bool = True
    """``staged``: transfers of one direction run on that direction's staging streams (see
    ``cuda_staged.StagingRing``); False: each on streams of its own from the pool (slower back
    to back; kept to measure that)."""
    issue_thread: bool = True
    """Make the CUDA calls that enqueue transfers on the backend's native executor thread: the
    caller's thread only plans and records them (0.1-0.5 ms for 512 scattered blocks). False, or
    where the executor cannot be built: the caller's thread makes them too."""
    max_in_flight: int = 32
    """Transfers enqueued on the device and unfinished at most; more wait on the host (in a
    queue fed to the device as room is made). Enqueueing is a few CUDA calls that can take
    100-200 us while the device is busy; the fewer enqueued ahead, the fewer such waits."""
    max_device_ops: int = 2048
    """Copies and kernel launches enqueued and unfinished at most (estimated per transfer). The
    driver blocks the host once about 1,000 operations wait in one of its hardware queues (4 for
    copies, 8 for kernels, measured on an H100); this stays well below."""
    max_streams: int = 64
    """CUDA streams in the pool, all created at registration."""
    prefill_events: int = 256
    """CUDA events created at registration (more are created when needed)."""
    stream_priority: int = 0
    register_chunk_bytes: int = GIB
    """Pin the pool in pieces of about this size (whole slots each)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError("copy.strategy", self.strategy, f"one of {', '.join(STRATEGIES)}")
        if self.max_sms < 0:
            raise ConfigError("copy.max_sms", self.max_sms, "0 (backend's choice) or more")
        for name in (
            "dma_lanes",
            "stage_lanes",
            "max_device_ops",
            "stage_buffers",
            "max_in_flight",
            "max_streams",
            "staged_min_blocks",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"copy.{name}", getattr(self, name), "at least 1")
        if self.prefill_events < 0:
            raise ConfigError("copy.prefill_events", self.prefill_events, "0 or more")
        for name in ("stage_bytes", "stage_ramp_bytes", "register_chunk_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"copy.{name}", getattr(self, name), "a positive byte count")

    @classmethod
    def from_config(cls, config: Any, **overrides: Any) -> CudaCopyOptions:
        """Options from a ``KVTierConfig`` (``copy.strategy``, ``copy.max_sms``,
        ``pool.allow_pageable``), read by name so this module needs no config import."""
        copy = getattr(config, "copy", None)
        pool = getattr(config, "pool", None)
        strategy = getattr(copy, "strategy", "auto")
        values: dict[str, Any] = {
            "strategy": str(getattr(strategy, "value", strategy)),
            "max_sms": int(getattr(copy, "max_sms", 0)),
            "allow_pageable": bool(getattr(pool, "allow_pageable", False)),
        }
        values.update(overrides)
        return cls(**values)


class ResourceStats(NamedTuple):
    streams_created: int
    streams_idle: int
    events_created: int
    events_idle: int
    events_staging: int
    """Events the staging buffers hold (each marks when its buffer is free again)."""
    in_flight: int
    """Transfers enqueued on the device and not yet reported."""
    queued: int
    """Transfers waiting on the host for room (``max_in_flight``)."""

    @property
    def idle(self) -> bool:
        """Nothing outstanding and every stream and event back in its pool."""
        return (
            self.in_flight == 0
            and self.queued == 0
            and self.streams_idle == self.streams_created
            and self.events_idle + self.events_staging == self.events_created
        )


# -- pools of streams and events ---------------------------------------------------------------


class _StreamPool:
    """``size`` streams created up front; a busy pool shares its streams round robin."""

    def __init__(self, rt: CudaRuntime, size: int, priority: int) -> None:
        self._rt = rt
        self._lock = threading.Lock()
        self._all: list[int] = []
        self._idle: list[int] = []
        self._users: dict[int, int] = {}
        self._next_shared = 0
        try:
            for _ in range(size):
                stream = rt.stream_create(priority)
                self._all.append(stream)
                self._idle.append(stream)
        except BaseException:
            self.destroy()
            raise

    def acquire(self) -> int:
        with self._lock:
            if self._idle:
                stream = self._idle.pop()
            else:
                stream = self._all[self._next_shared % len(self._all)]
                self._next_shared += 1
            self._users[stream] = self._users.get(stream, 0) + 1
            return stream

    def release(self, stream: int) -> None:
        with self._lock:
            users = self._users[stream] - 1
            if users:
                self._users[stream] = users
            else:
                del self._users[stream]
                self._idle.append(stream)

    @property
    def created(self) -> int:
        return len(self._all)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def destroy(self) -> None:
        for stream in self._all:
            try:
                self._rt.stream_destroy(stream)
            except CudaError as exc:
                log.warning("destroying a copy stream failed: %s", exc)
        self._all, self._idle, self._users = [], [], {}


class _EventPool:
    """Events for gates, copies and staging buffers. ``prefill`` are created at registration, so
    planning a transfer normally makes no CUDA call (creating one can wait for the driver's lock
    while the executor is inside a long call); more are created on demand. Destroyed at close."""

    def __init__(self, rt: CudaRuntime, prefill: int) -> None:
        self._rt = rt
        self._lock = threading.Lock()
        self._idle: list[int] = []
        self._created = 0
        for _ in range(prefill):
            self._idle.append(rt.event_create())
            self._created += 1

    def acquire(self) -> int:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        event = self._rt.event_create()
        with self._lock:
            self._created += 1
        return event

    def acquire_many(self, count: int) -> list[int]:
        with self._lock:
            split = max(0, len(self._idle) - count)
            taken = self._idle[split:]
            del self._idle[split:]
        try:
            while len(taken) < count:
                taken.append(self.acquire())
        except BaseException:
            for event in taken:
                self.release(event)
            raise
        return taken

    def release(self, event: int) -> None:
        with self._lock:
            self._idle.append(event)

    @property
    def created(self) -> int:
        return self._created

    @property
    def idle(self) -> int:
        return len(self._idle)

    def destroy(self) -> None:
        if len(self._idle) != self._created:
            log.warning("%d copy events still in use at close", self._created - len(self._idle))
        for event in self._idle:
            try:
                self._rt.event_destroy(event)
            except CudaError as exc:
                log.warning("destroying a copy event failed: %s", exc)
        self._idle, self._created = [], 0


# -- the pinned pool ---------------------------------------------------------------------------


class PinnedPool:
    """The host pool's mapping registered with CUDA (page-locked, mapped into the device's
    address space), in pieces of whole slots; unregistered by ``close``."""

    def __init__(
        self, rt: CudaRuntime, pool: HostPool, chunk_bytes: int, allow_pageable: bool
    ) -> None:
        self._rt = rt
        self._array: np.ndarray | None = pool.array()  # keeps the mapping alive while registered
        self.base = int(self._array.ctypes.data)
        self.nbytes = int(self._array.nbytes)
        self.pinned = False
        self.device_addressable = False
        """The device reaches the pool at the same addresses (needed by the kernel strategy)."""
        self.reason = ""
        self._owned: list[int] = []
        step = max(1, chunk_bytes // pool.slot_stride) * pool.slot_stride
        failure = ""
        for offset in range(0, self.nbytes, step):
            address, size = self.base + offset, min(step, self.nbytes - offset)
            code = rt.host_register(address, size)
            if code == CUDA_SUCCESS:
                self._owned.append(address)
            elif code != CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
                name, text = rt.error_text(code)
                failure = (
                    f"cudaHostRegister of host pool {pool.handle.path} ({size} bytes at offset "
                    f"{offset} of {self.nbytes}) failed: {name}: {text}"
                )
                break
        if failure:
            self._unregister()
            self.reason = failure + (
                "; check the memlock limit (ulimit -l) and free memory, or set "
                "pool.allow_pageable to run on pageable memory at a fraction of the speed"
            )
            if not allow_pageable:
                self._array = None
                raise PoolError(self.reason)
            log.warning("%s; running on pageable memory (DMA only)", self.reason)
            return
        self.pinned = True
        try:
            self.device_addressable = all(
                rt.host_device_pointer(self.base + off) == self.base + off
                for off in range(0, self.nbytes, step)
            )
        except CudaError as exc:
            log.warning("host pool not addressable from the device: %s", exc)

    def _unregister(self) -> None:
        for address in self._owned:
            try:
                self._rt.host_unregister(address)
            except CudaError as exc:
                log.warning("cudaHostUnregister failed: %s", exc)
        self._owned = []

    def close(self) -> None:
        self._unregister()
        self.pinned = False
        self._array = None


# -- the backend -------------------------------------------------------------------------------


def _planner_missing() -> str:
    """Why the staged strategy's native planner (``cuda_executor.c``) cannot run ('' if it can)."""
    try:
        load_library()
    except ExecutorUnavailable as exc:
        return f"it needs the native planner: {exc}"
    return ""


def _event_handle(event: Any) -> int:
    """A ``cudaEvent_t`` from an int or a ``torch.cuda.Event``."""
    if isinstance(event, int):
        return event
    handle = getattr(event, "cuda_event", None)
    if handle is None:
        handle = event._as_parameter_.value
    return int(handle)


@dataclass(frozen=True, slots=True)
class _Plan:
    to_host: bool
    blocks: np.ndarray
    """Engine block ids (int64)."""
    hosts: np.ndarray
    """Host address of each engine block's bytes in its slot (uint64)."""


@dataclass(slots=True)
class _Transfer:
    job: CopyJob
    """As submitted; checked and turned into a ``plan`` when it is enqueued on the device."""
    layerwise: bool
    after: int
    """The caller's event the copy waits for before touching engine memory (0: none)."""
    gate_stream: int | None
    """Without ``after``: the caller's stream at submit (0 is the legacy default stream); the
    transfer's first call records an event there and the copy waits for it."""
    stream: int = 0
    done: int = 0
    """Event recorded after the last copy; 0 when none (nothing enqueued, or drained)."""
    program: Program | None = None
    """Its recorded CUDA calls, once planned; it counts as enqueued when the program ran."""
    layer_events: list[int] = field(default_factory=list)
    aux_streams: list[int] = field(default_factory=list)
    """DMA lanes; they join ``stream`` before ``done`` is recorded."""
    shares_streams: bool = False
    """It runs on its staging ring's streams, not on streams of its own from the pool."""
    ops: int = 0
    """Device operations (copies, launches) it counts against ``max_device_ops``."""
    failed: bool = False

    @property
    def job_id(self) -> int:
        return self.job.job_id


class CudaCopyBackend(CopyBackend):
    """Copies between an engine's KV tensors on one CUDA device and pool slots.

    ``kv_caches``: the engine's KV tensors in the given ``layout`` (see ``cuda_plan``). Each slot
    holds ``blocks_per_slot`` engine blocks; with tensor parallelism rank ``tp_rank`` owns part
    ``tp_rank`` of ``tp_size`` of each slot.
    """

    def __init__(
        self,
        kv_caches: Sequence[Any],
        layout: KVLayout,
        pool: HostPool,
        options: CudaCopyOptions | None = None,
        *,
        blocks_per_slot: int = 1,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.options = options = options or CudaCopyOptions()
        self._closed = True
        devices = {t.device for t in kv_caches}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            raise ValueError(f"KV tensors must all be on one CUDA device, got {devices}")
        self.device = int(next(iter(devices)).index or 0)
        if blocks_per_slot < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"bad blocks_per_slot={blocks_per_slot} / tp {tp_rank} of {tp_size}")
        self.geometry: KVGeometry = describe_kv(kv_caches, layout)
        self.blocks_per_slot = blocks_per_slot
        self._part_bytes = blocks_per_slot * self.geometry.block_bytes
        if pool.slot_bytes < tp_size * self._part_bytes:
            raise ValueError(
                f"pool slots of {pool.slot_bytes} bytes cannot hold {tp_size} parts of "
                f"{self._part_bytes} bytes ({blocks_per_slot} x {self.geometry.block_bytes})"
            )
        self._part_offset = tp_rank * self._part_bytes
        self._pool = pool
        self._num_slots = pool.num_slots
        self._kv_refs = list(kv_caches)  # the addresses below stay valid while these live
        self._rings: dict[bool, StagingRing] = {}

        rt = self._rt = self._make_runtime()
        with self._device_context():
            self._pinned = PinnedPool(
                rt, pool, options.register_chunk_bytes, options.allow_pageable
            )
            try:
                self._events = _EventPool(rt, options.prefill_events)
                self._setup_strategy()
                self._streams = _StreamPool(rt, options.max_streams, options.stream_priority)
            except BaseException:
                self._free_rings()
                if hasattr(self, "_events"):
                    self._events.destroy()
                if getattr(self, "_region_table", None) is not None:
                    self._free_device(self._region_table)
                self._pinned.close()
                raise
        self._lock = threading.Lock()  # bookkeeping only, never held across a CUDA call
        self._inflight: dict[int, _Transfer] = {}
        # A deque, not a dict: a dict of thousands of queued jobs resizes (an O(n) copy, over
        # 100 us at ~5,000 entries) inside some unlucky submit.
        self._queued: deque[_Transfer] = deque()
        self._ops = 0
        self._done_early: list[int] = []
        self._failed_early: list[int] = []
        self.plan_seconds: deque[float] = deque(maxlen=4096)
        """Caller's-thread time each recent transfer took to plan and record (and, without
        the executor, to make its CUDA calls)."""
        self.enqueue_seconds: deque[float] = deque(maxlen=4096)
        """Time each recent transfer's CUDA calls took (on the executor's thread, if any)."""
        self._recorder: Recorder | None = None
        """Records the enqueueing CUDA calls of the transfer being planned."""
        self._executor: Executor | None = None
        if options.issue_thread:
            try:
                self._executor = self._make_executor()
            except ExecutorUnavailable as exc:
                log.warning("kvtier copy: CUDA calls on the caller's thread: %s", exc)
        self._closed = False

    # -- strategy ------------------------------------------------------------------------------

    def _setup_strategy(self) -> None:
        opts, geo, rt = self.options, self.geometry, self._rt
        self._merged = merge_regions(geo.regions)
        self._layer_merged = [
            merge_regions([geo.regions[i] for i in geo.layer_regions(layer)])
            for layer in range(geo.num_layers)
        ]
        self._merged_arrays = RegionArrays.of(self._merged)
        self._layer_arrays = [RegionArrays.of(regions) for regions in self._layer_merged]
        kernel_why = self._kernel_unavailable()
        dma_why = "" if rt.has_batch_memcpy else "cudaMemcpyBatchAsync needs CUDA runtime >= 12.8"
        strategy = opts.strategy
        if strategy in ("kernel", "staged") and kernel_why:
            raise ConfigError(
                "copy.strategy", strategy, f"the kernel cannot run here: {kernel_why}"
            )
        staged_why = (dma_why or _planner_missing()) if strategy in ("auto", "staged") else ""
        if strategy == "staged" and staged_why:
            raise ConfigError("copy.strategy", strategy, staged_why)
        if strategy == "auto":
            small = min(r.nbytes for r in self._merged) < opts.dma_min_piece_bytes
            if not small or kernel_why:
                strategy = "dma"  # large pieces, or no kernel: the copy engines alone
            elif staged_why:
                strategy = "kernel"
            else:
                strategy = "staged"
        if strategy == "dma" and dma_why:
            log.warning("%s: falling back to one cudaMemcpyAsync per piece", dma_why)
        self.strategy = strategy
        self._attrs = {
            True: memcpy_attributes(True, self.device, opts.prefer_copy_engine),
            False: memcpy_attributes(False, self.device, opts.prefer_copy_engine),
        }
        self.sm_count = rt.multiprocessor_count(self.device)
        self.max_sms = min(opts.max_sms or DEFAULT_MAX_SMS, self.sm_count)
        self._kernels: Any = None
        self._region_table: Any = None
        self._region_table_address = 0
        if strategy in ("kernel", "staged"):
            self._kernels = self._compile_kernels()
            self._region_table, self._region_table_address = self._upload(region_table(geo.regions))
        if strategy == "staged":
            block = geo.block_bytes
            buffer_bytes = max(1, opts.stage_bytes // block) * block
            for to_host in (True, False):
                owner, base = self._alloc_device(buffer_bytes * opts.stage_buffers)
                ring = StagingRing(owner, base, buffer_bytes, [0] * opts.stage_buffers)
                self._rings[to_host] = ring
                ring.main = rt.stream_create(opts.stream_priority)
                for _ in range(opts.stage_lanes):
                    ring.lanes.append(rt.stream_create(opts.stream_priority))

    def _free_rings(self) -> None:
        """Free the staging buffers and destroy their streams."""
        for ring in self._rings.values():
            self._free_device(ring.owner)
            for stream in (ring.main, *ring.lanes):
                if stream:
                    self._rt.stream_destroy(stream)
        self._rings = {}

    def _kernel_unavailable(self) -> str:
        """Why the kernel cannot run here ('' when it can)."""
        if not self._pinned.pinned:
            return "the host pool is not pinned"
        if not self._pinned.device_addressable:
            return "the device does not see the pinned pool at its host addresses"
        geo = self.geometry
        addresses = [r.base for r in geo.regions] + [r.stride for r in geo.regions]
        addresses += [geo.piece_bytes, self._pool.slot_stride, self._part_offset, self._pinned.base]
        if any(a % 16 for a in addresses) or any(r.nbytes != geo.piece_bytes for r in geo.regions):
            return "pieces are not 16-byte aligned or not of one size"
        return self._toolchain_missing()

    # -- the device touch points (overridden by the CPU emulation in the tests) ----------------

    def _make_runtime(self) -> CudaRuntime:
        return runtime()

    def _make_executor(self) -> Executor:
        rt = self._rt
        return Executor(rt.executor_functions(), rt.batch_has_fail_idx, self.device)

    def _device_context(self) -> Any:
        import torch

        return torch.cuda.device(self.device)

    def _current_stream(self) -> int:
        import torch

        # PyTorch's raw-stream getter (what its compiler's generated code calls) skips building
        # a Stream object: 60 us of a submit on a slow lease CPU.
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return int(raw(self.device))
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    def _toolchain_missing(self) -> str:
        try:
            import cupy  # noqa: F401
        except ImportError:
            return "CuPy (NVRTC) is not installed"
        return ""

    def _compile_kernels(self) -> Any:
        from kvtier.copy.cuda_kernels import CopyKernels

        return CopyKernels.compile()

    def _alloc_device(self, nbytes: int) -> tuple[Any, int]:
        """Device memory from ``cudaMalloc``, not the framework's caching allocator (whose CUDA
        graph pools can hand memory a graph still writes to to a later allocation):
        (owner, address); the owner is passed to ``_free_device``."""
        address = self._rt.malloc(nbytes)
        return address, address

    def _free_device(self, owner: Any) -> None:
        try:
            self._rt.free(int(owner))
        except CudaError as exc:
            log.warning("freeing copy staging memory failed: %s", exc)

    def _upload(self, table: np.ndarray) -> tuple[Any, int]:
        """A device copy of a uint64 array: (owner, device address)."""
        owner, address = self._alloc_device(table.nbytes)
        self._rt.upload(address, table)
        return owner, address

    # -- properties ----------------------------------------------------------------------------

    @property
    def sms_used(self) -> int:
        """SMs a copy may occupy: 0 for DMA (copy engines), the kernel's grid size otherwise."""
        return 0 if self.strategy == "dma" else self.max_sms

    @property
    def pinned(self) -> bool:
        return self._pinned.pinned

    @property
    def slot_part_bytes(self) -> int:
        return self._part_bytes

    # -- submit --------------------------------------------------------------------------------

    def submit(self, job: CopyJob, after: Any = None, layerwise: bool = False) -> None:
        """Queue ``job``; never raises for a bad job (``poll`` reports it failed) and never waits
        for the device. The job is checked when it is enqueued on the device, so its block and
        slot sequences must not change until it is reported. With the executor (the default)
        no CUDA call runs on the caller's thread: a submit plans and records the transfer if
        there is room (0.05-1 ms for 512 blocks, by strategy and CPU) and queues it.

        What the copy waits for on the GPU: the work queued on the caller's current stream when
        the transfer's calls are made (a few microseconds after ``submit``, later if it waited for
        room; never later than ``stream_wait``/``fence``/``wait`` on it returns). Work queued
        after ``submit`` must not touch the job's blocks before then, which the engine's
        contract already says (a store's blocks stay untouched until fenced or reported, a
        load's are read only after ``stream_wait``), so waiting for it only delays the copy.

        ``after``: an event (``torch.cuda.Event`` or a ``cudaEvent_t`` as int) to wait for instead
        of the current stream; the wait binds to its latest record when the calls are made, so a
        caller re-recording it every step only delays the copy. ``layerwise``: copy layer by
        layer and record an event after each, for ``stream_wait(job_id, layer)``.
        """
        job_id = job.job_id
        if self._closed or job_id in self._inflight:
            log.error("copy job %d rejected: %s", job_id, "closed" if self._closed else "id in use")
            self._report(job_id, False)
            return
        try:
            empty = len(job.engine_blocks) == 0 and len(job.slots) == 0
        except TypeError as exc:
            log.error("copy job %d rejected: %s", job_id, exc)
            self._report(job_id, False)
            return
        if empty:
            self._report(job_id, True)
            return
        try:
            gate = (0, self._current_stream()) if after is None else (_event_handle(after), None)
        except Exception as exc:
            log.error("copy job %d failed: %s", job_id, exc)
            self._report(job_id, False)
            return
        transfer = _Transfer(job, layerwise, *gate)
        transfer.ops = self._estimate_ops(transfer)
        with self._lock:
            self._queued.append(transfer)
        self._pump()

    def _report(self, job_id: int, ok: bool) -> None:
        with self._lock:
            (self._done_early if ok else self._failed_early).append(job_id)

    def _plan(self, job: CopyJob) -> _Plan:
        if job.direction not in (Direction.STORE, Direction.LOAD):
            raise ValueError(f"unknown direction {job.direction!r}")
        load = job.direction is Direction.LOAD
        blocks, slots = check_job(
            job.engine_blocks,
            job.slots,
            self.blocks_per_slot,
            self.geometry.num_blocks,
            self._num_slots,
            skips=load,
        )
        hosts = host_block_addresses(
            self._pinned.base,
            self._pool.slot_stride,
            self._part_offset,
            slots,
            self.blocks_per_slot,
            self.geometry.block_bytes,
        )
        if load:
            # Positions the engine holds already: each kept block keeps its place in its slot.
            keep = blocks != SKIP
            if not keep.all():
                blocks, hosts = blocks[keep], hosts[keep]
        return _Plan(not load, blocks, hosts)

    def _pump(self) -> None:
        """Plan and enqueue queued transfers, oldest first, while the device queues have room (at
        least one when nothing is in flight, however large)."""
        opts = self.options
        while True:
            with self._lock:
                if not self._queued or self._closed:
                    return
                transfer = self._queued[0]
                full = (
                    len(self._inflight) >= opts.max_in_flight
                    or self._ops + transfer.ops > opts.max_device_ops
                )
                if self._inflight and full:
                    return
                self._queued.popleft()
            self._start(transfer)

    def _take_queued(self, job_ids: set[int]) -> list[_Transfer]:
        with self._lock:
            taken = [t for t in self._queued if t.job_id in job_ids]
            for transfer in taken:
                self._queued.remove(transfer)
        return taken

    def _make_room(self, job_ids: set[int]) -> None:
        """Enqueue what fits; while any of these jobs is still queued, wait for the oldest
        transfer in flight to finish."""
        while True:
            self._pump()
            with self._lock:
                if not any(t.job_id in job_ids for t in self._queued):
                    return
                oldest = next(iter(self._inflight.values()), None)
            if oldest is None:
                continue  # (cannot stay so: _pump starts one when nothing is in flight)
            self._synchronize(oldest)
            self._collect()

    def _staging(self, transfer: _Transfer) -> bool:
        """Whether this transfer goes through the staging buffers."""
        return (
            self.strategy == "staged"
            and not transfer.layerwise
            and len(transfer.job.engine_blocks) >= self.options.staged_min_blocks
        )

    def _estimate_ops(self, transfer: _Transfer) -> int:
        """Copies and launches the transfer enqueues (an upper bound)."""
        n, geo = len(transfer.job.engine_blocks), self.geometry
        launches = -(-n // KERNEL_CAPACITIES[-1])
        if self._staging(transfer):
            to_host = transfer.job.direction is Direction.STORE
            per = self._rings[to_host].buffer_bytes // geo.block_bytes
            ramp = max(1, self.options.stage_ramp_bytes // geo.block_bytes)
            return n + len(chunk_sizes(n, per, ramp, to_host))
        layers = geo.num_layers if transfer.layerwise else 1
        if self.strategy != "dma":
            return layers * launches
        if transfer.layerwise:
            return n * sum(len(regions) for regions in self._layer_merged)
        return n * len(self._merged)

    def _start(self, transfer: _Transfer) -> None:
        """Check and plan one transfer, record its CUDA calls and hand them to the executor (or
        make them here); it joins ``_inflight`` at once and counts as enqueued when its program
        ran. On failure it is in flight, marked failed, until what it enqueued has drained
        (the program then synchronizes the streams it used); ``poll`` reports it."""
        t0 = time.perf_counter()
        job_id = transfer.job_id
        plan: _Plan | None = None
        with self._lock:  # two unreported jobs, one id
            reason = "id in use" if job_id in self._inflight else ""
        if not reason:
            try:
                plan = self._plan(transfer.job)
            except (ValueError, TypeError) as exc:
                reason = str(exc)
        if plan is None or len(plan.blocks) == 0:
            if reason:
                log.error("copy job %d rejected: %s", job_id, reason)
            self._report(job_id, not reason)
            return
        recorder = self._recorder = Recorder(self._rt.has_batch_memcpy)
        try:
            if self._staging(transfer) and self.options.stage_shared_streams:
                transfer.stream = self._rings[plan.to_host].main
                transfer.shares_streams = True
            else:
                transfer.stream = self._streams.acquire()
            gate = transfer.after
            if transfer.gate_stream is not None:
                gate = self._events.acquire()
                self._retire(gate)  # a wait binds to the record made before it
                recorder.event_record(gate, transfer.gate_stream)
            recorder.stream_wait_event(transfer.stream, gate)
            self._enqueue(transfer, plan)
            done = self._events.acquire()
            recorder.event_record(done, transfer.stream)
            transfer.done = done
        except Exception as exc:
            log.error("copy job %d failed while enqueueing: %s", job_id, exc)
            transfer.failed = True
            lanes = self._rings[plan.to_host].lanes if transfer.shares_streams else []
            for stream in (*transfer.aux_streams, *lanes, transfer.stream):
                if stream:
                    recorder.stream_synchronize(stream)
        finally:
            self._recorder = None
        transfer.program = recorder.program
        with self._lock:
            self._inflight[job_id] = transfer
            self._ops += transfer.ops
        self._run(recorder.program)
        self.plan_seconds.append(time.perf_counter() - t0)

    def _run(self, program: Program) -> None:
        """Hand ``program`` to the executor, or make its calls here."""
        if self._executor is not None:
            try:
                self._executor.push(program)
                return
            except ExecutorUnavailable as exc:  # out of memory: from now on, here, in order
                log.error("kvtier copy: CUDA calls on the caller's thread from now on: %s", exc)
                self._executor.close()
                self._executor = None
        with self._device_context():
            program.replay(self._rt)
        self._settle(program)

    def _settle(self, program: Program) -> None:
        """Bookkeeping once ``program`` ran (once; later calls do nothing)."""
        if program.settled:
            return
        program.settled = True
        self.enqueue_seconds.append(program.seconds)
        for event in program.retired_events:
            self._events.release(event)
        program.retired_events = []

    def _retire(self, event: int) -> None:
        """``event`` is no longer needed by the transfer being planned: back to the pool once
        its program ran (a wait recorded on it binds only when it is made)."""
        assert self._recorder is not None
        self._recorder.program.retired_events.append(event)

    @property
    def _enq(self) -> Recorder:
        """Where the transfer being planned records its CUDA calls."""
        assert self._recorder is not None
        return self._recorder

    # -- enqueueing copies ---------------------------------------------------------------------

    def _enqueue(self, transfer: _Transfer, plan: _Plan) -> None:
        geo = self.geometry
        if self._staging(transfer):
            self._staged(transfer, plan)
            return
        # A layer-wise job of the staged strategy runs the kernel straight to the pool, layer by
        # layer (staging chunks hold whole blocks: no layer would be complete before the last);
        # so does a small one, for the few microseconds of issue time the staging steps cost.
        direct = self.strategy != "dma"
        if not transfer.layerwise:
            if direct:
                for function, grid, params in self._launches(plan, len(geo.regions)):
                    self._enq.launch(function, grid, THREADS, params, transfer.stream)
            else:
                self._dma(
                    transfer,
                    copy_list(self._merged_arrays, plan.blocks, plan.hosts, plan.to_host),
                    plan.to_host,
                )
            return
        # The kernel's parameters are packed once and repeated per layer (only the first region
        # differs).
        per = len(geo.regions) // geo.num_layers
        begins = [geo.layer_regions(layer).start for layer in range(geo.num_layers)]
        launches = [
            (function, grid, with_region_begins(params, begins))
            for function, grid, params in (self._launches(plan, per) if direct else [])
        ]
        for layer in range(geo.num_layers):
            for function, grid, rows in launches:
                self._enq.launch(function, grid, THREADS, rows[layer], transfer.stream)
            if not direct:
                copies = copy_list(self._layer_arrays[layer], plan.blocks, plan.hosts, plan.to_host)
                self._dma(transfer, copies, plan.to_host)
            event = self._events.acquire()
            transfer.layer_events.append(event)
            self._enq.event_record(event, transfer.stream)

    def _lanes(self, transfer: _Transfer, lanes: int) -> list[int]:
        while len(transfer.aux_streams) < lanes:
            transfer.aux_streams.append(self._streams.acquire())
        return transfer.aux_streams[:lanes]

    def _hand_over(self, src: int, *dsts: int) -> None:
        """Work enqueued on ``dsts`` from now on starts after the work enqueued on ``src`` so
        far."""
        event = self._events.acquire()
        self._retire(event)  # a wait binds to the record made before it
        self._enq.event_record(event, src)
        for dst in dsts:
            self._enq.stream_wait_event(dst, event)

    def _batch(self, stream: int, copies: CopyList, to_host: bool) -> None:
        rt = self._enq
        if rt.has_batch_memcpy and len(copies.sizes) > 1:  # (one copy: no batch needed)
            rt.memcpy_batch_async(
                copies.dsts, copies.srcs, copies.sizes, self._attrs[to_host], stream
            )
            return
        for dst, src, size in zip(
            copies.dsts.tolist(), copies.srcs.tolist(), copies.sizes.tolist(), strict=True
        ):
            rt.memcpy_async(dst, src, size, stream)

    def _dma(self, transfer: _Transfer, copies: CopyList, to_host: bool) -> None:
        """One batched copy, split over ``dma_lanes`` streams that fork from and join back into
        the transfer's stream."""
        lanes = min(self.options.dma_lanes, len(copies.sizes))
        if lanes <= 1:
            self._batch(transfer.stream, copies, to_host)
            return
        extra = self._lanes(transfer, lanes - 1)
        self._hand_over(transfer.stream, *extra)
        bounds = np.linspace(0, len(copies.sizes), lanes + 1).astype(np.int64).tolist()
        for lane, stream in enumerate([transfer.stream, *extra]):
            part = slice(bounds[lane], bounds[lane + 1])
            self._batch(
                stream, CopyList(copies.dsts[part], copies.srcs[part], copies.sizes[part]), to_host
            )
        for stream in extra:
            self._hand_over(stream, transfer.stream)

    def _staged(self, transfer: _Transfer, plan: _Plan) -> None:
        """Chunks of blocks through the staging ring (see ``cuda_staged``); a buffer is reused
        only after the step that last used it."""
        ring, geo = self._rings[plan.to_host], self.geometry
        block = geo.block_bytes
        per = min(ring.buffer_bytes // block, KERNEL_CAPACITIES[-1])  # one launch per chunk
        ramp = max(1, self.options.stage_ramp_bytes // block)
        sizes = chunk_sizes(len(plan.blocks), per, ramp, plan.to_host)
        capacity = pick_capacity(max(sizes))
        kernel = StagedKernel(
            self._kernels.functions[capacity],
            capacity,
            THREADS,
            WARPS,
            self.max_sms,
            self._region_table_address,
            geo.piece_bytes,
            len(geo.regions),
        )
        lanes = (
            ring.lanes
            if transfer.shares_streams
            else self._lanes(transfer, self.options.stage_lanes)
        )
        attrs = self._attrs[plan.to_host]
        staged = plan_staged(
            plan.blocks,
            plan.hosts,
            plan.to_host,
            block,
            sizes,
            transfer.stream,
            lanes,
            self._events.acquire_many(2 * len(sizes)),
            ring,
            kernel,
            ctypes.addressof(attrs),
        )
        self._enq.add_rows(staged.rows, staged.memory, attrs)
        for event in staged.retired:
            self._retire(event)
        if plan.to_host:
            for lane in lanes:
                self._hand_over(lane, transfer.stream)

    def _launches(self, plan: _Plan, n_regions: int) -> list[tuple[int, int, np.ndarray]]:
        """The copy kernel over the plan's blocks x regions ``[0, n_regions)``: per run of at most
        2,048 blocks, the function, the grid and the packed parameters (read when launched)."""
        limit = KERNEL_CAPACITIES[-1]
        launches = []
        for start in range(0, len(plan.blocks), limit):
            part = plan.blocks[start : start + limit]
            capacity = pick_capacity(len(part))
            params = np.zeros(param_bytes(capacity), dtype=np.uint8)
            pack_params(
                params,
                capacity,
                self._region_table_address,
                self.geometry.piece_bytes,
                0,
                n_regions,
                plan.to_host,
                part,
                plan.hosts[start : start + limit],
            )
            grid = self._grid(len(part), n_regions)
            launches.append((self._kernels.functions[capacity], grid, params))
        return launches

    def _grid(self, n_blocks: int, n_regions: int) -> int:
        """CTAs for a launch: one warp per piece, at most ``max_sms``."""
        return max(1, min(self.max_sms, -(-n_blocks * n_regions // WARPS)))

    # -- completion ----------------------------------------------------------------------------

    def poll(self) -> CopyResults:
        self._collect()
        self._pump()
        with self._lock:
            done, failed = self._done_early, self._failed_early
            self._done_early, self._failed_early = [], []
        return CopyResults(done, failed)

    def _collect(self) -> None:
        """Move finished transfers to the report lists and return their resources (the
        callers then refill the device from the queue)."""
        with self._lock:
            candidates = list(self._inflight.values())
        finished = [transfer for transfer in candidates if self._finished(transfer)]
        if not finished:
            return
        with self._lock:
            for transfer in finished:
                del self._inflight[transfer.job_id]
                self._ops -= transfer.ops
                self._release(transfer)
                report = self._failed_early if transfer.failed else self._done_early
                report.append(transfer.job_id)

    def _finished(self, transfer: _Transfer) -> bool:
        """Whether nothing of the transfer runs any more (marking it failed where it failed)."""
        program = transfer.program
        assert program is not None
        if program.state is ProgramState.QUEUED:
            return False
        self._settle(program)
        if program.state is ProgramState.FAILED and not transfer.failed:
            log.error("copy job %d failed while enqueueing: %s", transfer.job_id, program.error)
            transfer.failed = True
        if transfer.failed or not transfer.done:
            return True  # its program drained what it had enqueued
        try:
            return self._rt.event_query(transfer.done)
        except CudaError as exc:
            log.error("copy job %d failed on the device: %s", transfer.job_id, exc)
            transfer.failed = True
            return True

    def _wait_ran(self, transfer: _Transfer) -> None:
        """Return once the transfer's program ran (the host waits for the executor only)."""
        program = transfer.program
        executor = self._executor
        if program is None or executor is None:
            return
        while program.state is ProgramState.QUEUED:
            executor.wait(program.seq, 1.0)

    def wait(self, job_ids: Sequence[int]) -> None:
        self._make_room(set(job_ids))
        with self._lock:
            transfers = [self._inflight.get(job_id) for job_id in job_ids]
        for transfer in transfers:
            if transfer is not None:
                self._synchronize(transfer)

    def _synchronize(self, transfer: _Transfer) -> None:
        self._wait_ran(transfer)
        if not self._finished(transfer):
            try:
                self._rt.event_synchronize(transfer.done)
            except CudaError as exc:
                log.error("copy job %d failed on the device: %s", transfer.job_id, exc)
                transfer.failed = True

    def stream_wait(self, job_id: int, layer: int | None = None) -> None:
        """Make the current stream wait (on the GPU) for job ``job_id``, or for one layer of a
        layer-wise job; a no-op for a job already reported or failed. A queued job is enqueued
        first, here and room or not; the host waits only for the executor to make its calls."""
        for transfer in self._take_queued({job_id}):
            self._start(transfer)
        with self._lock:
            found = self._inflight.get(job_id)
        if found is None:
            return
        self._wait_ran(found)
        program = found.program
        if (
            found.failed
            or not found.done
            or program is None
            or program.state is ProgramState.FAILED
        ):
            return
        event = found.done if layer is None or not found.layer_events else found.layer_events[layer]
        # (Its events go back to the pool only when poll or wait reports it, on this thread.)
        self._rt.stream_wait_event(self._current_stream(), event)

    def fence(self, job_ids: Sequence[int]) -> None:
        """The current stream waits, on the GPU, for each job (the host does not)."""
        for job_id in job_ids:
            self.stream_wait(job_id)

    def _release(self, transfer: _Transfer) -> None:
        if transfer.done:
            self._events.release(transfer.done)
            transfer.done = 0
        for event in transfer.layer_events:
            self._events.release(event)
        transfer.layer_events = []
        for stream in transfer.aux_streams:
            self._streams.release(stream)
        transfer.aux_streams = []
        if transfer.stream and not transfer.shares_streams:
            self._streams.release(transfer.stream)
        transfer.stream = 0

    def stats(self) -> ResourceStats:
        with self._lock:
            staging = sum(1 for ring in self._rings.values() for e in ring.free if e)
            in_flight = len(self._inflight)
            queued = len(self._queued)
        return ResourceStats(
            self._streams.created,
            self._streams.idle,
            self._events.created,
            self._events.idle,
            staging,
            in_flight,
            queued,
        )

    def close(self) -> None:
        """Wait for enqueued copies, then free streams, events and staging buffers and unregister
        the pool. Jobs not yet reported by ``poll`` are not reported any more (queued ones never
        run). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._executor is not None:
            self._executor.close()  # makes the calls of every program pushed
            self._executor = None
        with self._device_context():
            self._queued.clear()
            for transfer in list(self._inflight.values()):
                self._synchronize(transfer)
                self._release(transfer)
            self._inflight.clear()
            for ring in self._rings.values():
                for event in ring.free:
                    if event:
                        self._events.release(event)
            self._free_rings()
            self._streams.destroy()
            self._events.destroy()
            self._pinned.close()
            if self._region_table is not None:
                self._free_device(self._region_table)
            self._region_table = None
            self._kernels = None
            self._kv_refs = []
