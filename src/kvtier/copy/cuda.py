"""The CUDA copy backend: engine KV blocks on an NVIDIA GPU <-> the pinned shared host pool.

How a transfer runs:

* It takes a stream of its own from a stream pool (real CUDA streams, created through the runtime,
  up to ``max_streams``; past that, busy streams are shared round robin) and events from an event
  pool. Thousands of outstanding transfers therefore never fill one stream's queue and block the
  host. Stream and events go back to their pools when ``poll`` or ``wait`` sees the transfer
  finished, on every path: a failure while enqueueing keeps the transfer in flight, marked failed,
  until the work already enqueued has drained, so a slot is never freed while a copy may still
  touch it.
* Before copying it waits (on the GPU, not the host) for an event recorded on the caller's current
  stream at ``submit``: a STORE reads the blocks only after the forward pass that wrote them, and
  a LOAD overwrites blocks only after the kernels queued before it that may still read them. A
  caller may pass its own event (``after=``), e.g. one per engine step for many jobs.
* It copies with one of two strategies, chosen per registration:
  ``dma``: one ``cudaMemcpyBatchAsync`` (CUDA >= 12.8) over all pieces, on the copy engines, no SM
  used; the right choice when pieces are large (``BLOCK_COMPACT``: one 2 MiB copy per block).
  ``kernel``: the gather/scatter kernel of ``cuda_kernels``, on at most ``max_sms`` SMs, reading
  and writing the mapped host pool directly; the right choice for small pieces (vLLM's per-layer
  layout: 32 KiB per layer, K/V and block).
* A LOAD is complete, visible to the next kernels of any stream, once ``poll`` reported it or
  ``wait`` returned. ``stream_wait`` makes the current stream wait for a load (or one layer of a
  layer-wise load) without blocking the host.

The pool is registered with ``cudaHostRegister`` (page-locked and mapped, in pieces of about
``register_chunk_bytes``), so DMA runs at full speed and the kernel can address it. If that fails
the backend raises ``PoolError`` with the reason, unless ``allow_pageable`` is set (then only the
DMA strategy is available, at pageable-memory speed).

One backend serves one worker thread; its methods are not thread-safe.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvtier.copy.base import CopyBackend, CopyJob, CopyResults, Direction
from kvtier.copy.cuda_plan import (
    KERNEL_CAPACITIES,
    SLOT_LAYOUT,
    KVGeometry,
    KVLayout,
    Region,
    check_job,
    copy_list,
    describe_kv,
    host_block_addresses,
    merge_regions,
    pack_params,
    pick_capacity,
    region_table,
)
from kvtier.copy.cuda_runtime import (
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    CUDA_SUCCESS,
    CudaError,
    CudaRuntime,
    memcpy_attributes,
    runtime,
)
from kvtier.errors import ConfigError, PoolError
from kvtier.pool import HostPool

log = logging.getLogger(__name__)

STRATEGIES = ("auto", "dma", "kernel")
DEFAULT_MAX_SMS = 8
GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class CudaCopyOptions:
    strategy: str = "auto"
    """``auto`` (DMA for pieces of at least ``dma_min_piece_bytes``, else the kernel), ``dma`` or
    ``kernel``."""
    max_sms: int = 0
    """SMs the copy kernel may occupy (its grid size); 0: ``DEFAULT_MAX_SMS``."""
    allow_pageable: bool = False
    """Run on pageable memory (DMA only, slow) where pinning the pool fails, instead of raising."""
    dma_min_piece_bytes: int = 256 << 10
    register_chunk_bytes: int = GIB
    """Pin the pool in pieces of about this size (whole slots each)."""
    max_streams: int = 1024
    """Distinct CUDA streams at most; beyond, outstanding transfers share streams round robin."""
    prealloc_streams: int = 16
    """Streams created at registration, so early submits do not pay for stream creation."""
    stream_priority: int = 0
    prefer_copy_engine: bool = True
    """Ask ``cudaMemcpyBatchAsync`` for the copy engines (never SMs) for DMA copies."""
    dma_lanes: int = 1
    """Streams one DMA transfer is spread over, so several copy engines overlap their per-copy
    overheads."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError("copy.strategy", self.strategy, f"one of {', '.join(STRATEGIES)}")
        if self.max_sms < 0:
            raise ConfigError("copy.max_sms", self.max_sms, "0 (backend's choice) or more")
        if self.max_streams < 1:
            raise ConfigError("copy.max_streams", self.max_streams, "at least 1")
        if self.dma_lanes < 1:
            raise ConfigError("copy.dma_lanes", self.dma_lanes, "at least 1")
        if self.register_chunk_bytes < 1:
            raise ConfigError("copy.register_chunk_bytes", self.register_chunk_bytes, "at least 1")

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
    in_flight: int


# -- pools of streams and events ---------------------------------------------------------------


class _StreamPool:
    def __init__(self, rt: CudaRuntime, limit: int, priority: int) -> None:
        self._rt = rt
        self._limit = limit
        self._priority = priority
        self._all: list[int] = []
        self._idle: list[int] = []
        self._users: dict[int, int] = {}
        self._next_shared = 0

    def create(self, n: int) -> None:
        for _ in range(min(n, self._limit - len(self._all))):
            stream = self._rt.stream_create(self._priority)
            self._all.append(stream)
            self._idle.append(stream)

    def acquire(self) -> int:
        if self._idle:
            stream = self._idle.pop()
        elif len(self._all) < self._limit:
            stream = self._rt.stream_create(self._priority)
            self._all.append(stream)
        else:
            stream = self._all[self._next_shared % len(self._all)]
            self._next_shared += 1
        self._users[stream] = self._users.get(stream, 0) + 1
        return stream

    def release(self, stream: int) -> None:
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
    def __init__(self, rt: CudaRuntime) -> None:
        self._rt = rt
        self._idle: list[int] = []
        self._created = 0

    def acquire(self) -> int:
        if self._idle:
            return self._idle.pop()
        event = self._rt.event_create()
        self._created += 1
        return event

    def release(self, event: int) -> None:
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


def _event_handle(event: Any) -> int:
    """A ``cudaEvent_t`` from an int or a ``torch.cuda.Event``."""
    if isinstance(event, int):
        return event
    handle = getattr(event, "cuda_event", None)
    if handle is None:
        handle = event._as_parameter_.value
    return int(handle)


@dataclass(slots=True)
class _Transfer:
    job_id: int
    stream: int
    done: int
    """Event recorded after the last copy; 0 when nothing could be recorded."""
    layer_events: list[int] = field(default_factory=list)
    aux_streams: list[int] = field(default_factory=list)
    """Extra DMA lanes; they join ``stream`` before ``done`` is recorded."""
    failed: bool = False


@dataclass(frozen=True, slots=True)
class _Plan:
    to_host: bool
    blocks: np.ndarray
    hosts: np.ndarray


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

        rt = self._rt = self._make_runtime()
        with self._device_context():
            self._pinned = PinnedPool(
                rt, pool, options.register_chunk_bytes, options.allow_pageable
            )
            try:
                self._setup_strategy()
                self._streams = _StreamPool(rt, options.max_streams, options.stream_priority)
                self._events = _EventPool(rt)
                self._streams.create(options.prealloc_streams)
            except BaseException:
                self._pinned.close()
                raise
        self._inflight: dict[int, _Transfer] = {}
        self._finished_early: list[int] = []
        self._failed_early: list[int] = []
        self._closed = False

    # -- strategy ------------------------------------------------------------------------------

    def _setup_strategy(self) -> None:
        opts, geo, rt = self.options, self.geometry, self._rt
        self._merged = merge_regions(geo.regions)
        self._layer_merged = [
            merge_regions([geo.regions[i] for i in geo.layer_regions(layer)])
            for layer in range(geo.num_layers)
        ]
        kernel_why = self._kernel_unavailable()
        dma_why = "" if rt.has_batch_memcpy else "cudaMemcpyBatchAsync needs CUDA runtime >= 12.8"
        if opts.strategy == "kernel" and kernel_why:
            raise ConfigError(
                "copy.strategy", "kernel", f"the kernel cannot run here: {kernel_why}"
            )
        if opts.strategy == "dma":
            strategy = "dma"
        elif opts.strategy == "kernel":
            strategy = "kernel"
        else:
            small = min(r.nbytes for r in self._merged) < opts.dma_min_piece_bytes
            strategy = (
                "kernel" if (small and not kernel_why) or (dma_why and not kernel_why) else "dma"
            )
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
        if strategy == "kernel":
            from kvtier.copy.cuda_kernels import ParamBuffer

            self._kernels = self._compile_kernels()
            self._params = ParamBuffer()
            self._region_table, self._region_table_address = self._upload(region_table(geo.regions))

    def _kernel_unavailable(self) -> str:
        """Why the kernel strategy cannot run here ('' when it can)."""
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

    def _device_context(self) -> Any:
        import torch

        return torch.cuda.device(self.device)

    def _current_stream(self) -> int:
        import torch

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

    def _upload(self, table: np.ndarray) -> tuple[Any, int]:
        """A device copy of a uint64 array: (owner object, device address)."""
        import torch

        tensor = torch.from_numpy(table.view(np.int64).copy()).to(f"cuda:{self.device}")
        torch.cuda.synchronize(self.device)
        return tensor, int(tensor.data_ptr())

    @property
    def sms_used(self) -> int:
        """SMs a copy may occupy: 0 for DMA (copy engines), the kernel's grid size otherwise."""
        return self.max_sms if self.strategy == "kernel" else 0

    @property
    def pinned(self) -> bool:
        return self._pinned.pinned

    @property
    def slot_part_bytes(self) -> int:
        return self._part_bytes

    @property
    def slot_layout(self) -> str:
        return SLOT_LAYOUT

    # -- submit --------------------------------------------------------------------------------

    def submit(self, job: CopyJob, after: Any = None, layerwise: bool = False) -> None:
        """Enqueue ``job``; never raises for a bad job (``poll`` reports it failed).

        ``after``: an event (``torch.cuda.Event`` or a ``cudaEvent_t`` as int) to wait for instead
        of the work queued on the current stream. ``layerwise``: copy layer by layer and record an
        event after each, for ``stream_wait(job_id, layer)``.
        """
        job_id = job.job_id
        if self._closed or job_id in self._inflight:
            log.error("copy job %d rejected: %s", job_id, "closed" if self._closed else "id in use")
            self._failed_early.append(job_id)
            return
        try:
            plan = self._plan(job)
        except (ValueError, TypeError) as exc:
            log.error("copy job %d rejected: %s", job_id, exc)
            self._failed_early.append(job_id)
            return
        if len(plan.blocks) == 0:
            self._finished_early.append(job_id)
            return
        rt = self._rt
        transfer: _Transfer | None = None
        enqueued = False
        try:
            if rt.get_device() != self.device:
                rt.set_device(self.device)
            stream = self._streams.acquire()
            transfer = _Transfer(job_id, stream, 0)
            self._gate(stream, after)
            enqueued = True
            self._enqueue(transfer, plan, layerwise)
            done = self._events.acquire()
            transfer.done = done
            rt.event_record(done, stream)
        except Exception as exc:
            log.error("copy job %d failed while enqueueing: %s", job_id, exc)
            if transfer is None:
                self._failed_early.append(job_id)
                return
            transfer.failed = True
            if transfer.done:
                # The event exists but its record failed: it must not gate the release.
                self._events.release(transfer.done)
                transfer.done = 0
            if enqueued:
                self._drain_failed(transfer)
            else:
                self._release(transfer)
                self._failed_early.append(job_id)
            return
        self._inflight[job_id] = transfer

    def _drain_failed(self, transfer: _Transfer) -> None:
        """A transfer failed after part of it was enqueued: keep it in flight until that part has
        run (so its slots and blocks are not reused under a running copy), then report it."""
        for stream in transfer.aux_streams:
            try:  # rare path: a lane may not have joined the main stream, so wait for it here
                self._rt.stream_synchronize(stream)
            except CudaError as exc:
                log.error("copy stream unusable: %s", exc)
        try:
            done = self._events.acquire()
            transfer.done = done
            self._rt.event_record(done, transfer.stream)
            self._inflight[transfer.job_id] = transfer
        except Exception:
            if transfer.done:
                self._events.release(transfer.done)
                transfer.done = 0
            try:
                self._rt.stream_synchronize(transfer.stream)
            except CudaError as exc:
                log.error("copy stream unusable: %s", exc)
            self._release(transfer)
            self._failed_early.append(transfer.job_id)

    def _plan(self, job: CopyJob) -> _Plan:
        if job.direction not in (Direction.STORE, Direction.LOAD):
            raise ValueError(f"unknown direction {job.direction!r}")
        blocks, slots = check_job(
            job.engine_blocks,
            job.slots,
            self.blocks_per_slot,
            self.geometry.num_blocks,
            self._num_slots,
        )
        hosts = host_block_addresses(
            self._pinned.base,
            self._pool.slot_stride,
            self._part_offset,
            slots,
            self.blocks_per_slot,
            self.geometry.block_bytes,
        )
        return _Plan(job.direction is Direction.STORE, blocks, hosts)

    def _gate(self, stream: int, after: Any) -> None:
        rt = self._rt
        if after is not None:
            rt.stream_wait_event(stream, _event_handle(after))
            return
        gate = self._events.acquire()
        try:
            rt.event_record(gate, self._current_stream())
            rt.stream_wait_event(stream, gate)
        finally:
            # Safe to reuse at once: a stream wait binds to the record made before it.
            self._events.release(gate)

    def _enqueue(self, transfer: _Transfer, plan: _Plan, layerwise: bool) -> None:
        geo = self.geometry
        if not layerwise:
            if self.strategy == "kernel":
                self._launch(transfer.stream, plan, 0, len(geo.regions))
            else:
                self._dma(transfer, plan, self._merged)
            return
        for layer in range(geo.num_layers):
            if self.strategy == "kernel":
                rng = geo.layer_regions(layer)
                self._launch(transfer.stream, plan, rng.start, len(rng))
            else:
                self._dma(transfer, plan, self._layer_merged[layer])
            event = self._events.acquire()
            transfer.layer_events.append(event)
            self._rt.event_record(event, transfer.stream)

    def _dma(self, transfer: _Transfer, plan: _Plan, regions: Sequence[Region]) -> None:
        copies = copy_list(regions, plan.blocks, plan.hosts, plan.to_host)
        rt = self._rt
        attrs = self._attrs[plan.to_host]
        lanes = min(self.options.dma_lanes, len(copies.sizes))
        if rt.has_batch_memcpy and lanes > 1:
            # Fork: the lanes start after everything already on the transfer's stream.
            fork = self._events.acquire()
            try:
                rt.event_record(fork, transfer.stream)
                while len(transfer.aux_streams) < lanes - 1:
                    transfer.aux_streams.append(self._streams.acquire())
                for stream in transfer.aux_streams[: lanes - 1]:
                    rt.stream_wait_event(stream, fork)
            finally:
                self._events.release(fork)  # a wait binds to the record before it
            bounds = np.linspace(0, len(copies.sizes), lanes + 1).astype(np.int64).tolist()
            streams = [transfer.stream, *transfer.aux_streams[: lanes - 1]]
            for lane, stream in enumerate(streams):
                part = slice(bounds[lane], bounds[lane + 1])
                rt.memcpy_batch_async(
                    copies.dsts[part], copies.srcs[part], copies.sizes[part], attrs, stream
                )
            for stream in streams[1:]:  # join
                join = self._events.acquire()
                try:
                    rt.event_record(join, stream)
                    rt.stream_wait_event(transfer.stream, join)
                finally:
                    self._events.release(join)
        elif rt.has_batch_memcpy:
            rt.memcpy_batch_async(copies.dsts, copies.srcs, copies.sizes, attrs, transfer.stream)
        else:
            for dst, src, size in zip(
                copies.dsts.tolist(), copies.srcs.tolist(), copies.sizes.tolist(), strict=True
            ):
                rt.memcpy_async(dst, src, size, transfer.stream)

    def _launch(self, stream: int, plan: _Plan, region_begin: int, n_regions: int) -> None:
        from kvtier.copy.cuda_kernels import THREADS

        warps_per_cta = THREADS // 32
        limit = KERNEL_CAPACITIES[-1]
        table = self._region_table_address
        buf = self._params
        for start in range(0, len(plan.blocks), limit):
            blocks = plan.blocks[start : start + limit]
            capacity = pick_capacity(len(blocks))
            pack_params(
                buf.array,
                capacity,
                table,
                self.geometry.piece_bytes,
                region_begin,
                n_regions,
                plan.to_host,
                blocks,
                plan.hosts[start : start + limit],
            )
            units = len(blocks) * n_regions
            grid = max(1, min(self.max_sms, -(-units // warps_per_cta)))
            self._rt.launch(
                self._kernels.functions[capacity], grid, THREADS, buf.kernel_params, stream
            )

    # -- completion ----------------------------------------------------------------------------

    def poll(self) -> CopyResults:
        done, failed = self._finished_early, self._failed_early
        self._finished_early, self._failed_early = [], []
        query = self._rt.event_query
        finished: list[_Transfer] = []
        for transfer in self._inflight.values():
            try:
                if query(transfer.done):
                    finished.append(transfer)
            except CudaError as exc:
                log.error("copy job %d failed on the device: %s", transfer.job_id, exc)
                transfer.failed = True
                finished.append(transfer)
        for transfer in finished:
            del self._inflight[transfer.job_id]
            self._release(transfer)
            (failed if transfer.failed else done).append(transfer.job_id)
        return CopyResults(done, failed)

    def wait(self, job_ids: Sequence[int]) -> None:
        for job_id in job_ids:
            transfer = self._inflight.get(job_id)
            if transfer is None:
                continue
            try:
                self._rt.event_synchronize(transfer.done)
            except CudaError as exc:
                log.error("copy job %d failed on the device: %s", job_id, exc)
                transfer.failed = True

    def stream_wait(self, job_id: int, layer: int | None = None) -> None:
        """Make the current stream wait (on the GPU) for job ``job_id``, or for one layer of a
        layer-wise job; a no-op for a job already reported."""
        transfer = self._inflight.get(job_id)
        if transfer is None:
            return
        if layer is None or not transfer.layer_events:
            event = transfer.done
        else:
            event = transfer.layer_events[layer]
        self._rt.stream_wait_event(self._current_stream(), event)

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
        if transfer.stream:
            self._streams.release(transfer.stream)
            transfer.stream = 0

    def stats(self) -> ResourceStats:
        return ResourceStats(
            self._streams.created,
            self._streams.idle,
            self._events.created,
            self._events.idle,
            len(self._inflight),
        )

    def close(self) -> None:
        """Wait for outstanding copies, then free streams and events and unregister the pool.
        Jobs not yet reported by ``poll`` are not reported any more. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with self._device_context():
            for transfer in list(self._inflight.values()):
                try:
                    self._rt.event_synchronize(transfer.done)
                except CudaError as exc:
                    log.error("copy job %d failed on the device: %s", transfer.job_id, exc)
                self._release(transfer)
            self._inflight.clear()
            self._streams.destroy()
            self._events.destroy()
            self._pinned.close()
            self._region_table = None
            self._kernels = None
            self._kv_refs = []
