"""The CUDA copy backend: engine KV blocks on an NVIDIA GPU <-> the pinned shared host pool.

``submit`` notes what the copy must wait for on the GPU (the caller's current stream, or its
``after=`` event) and queues the transfer (``queue``); while the device has room the transfer
is planned at once: checked, and its CUDA calls recorded by its strategy (``dma``,
``staged``, ``direct``: one chosen at registration, ``strategy``) into a program
that the executor's native thread (``executor``) makes without the GIL. No CUDA call runs on
the engine's thread and no number of outstanding transfers fills a CUDA queue. Streams, events,
the pinned pool and the staging buffers (``resources``) are created at registration and go
back to their pools when ``poll`` or ``wait`` sees a transfer finished, on every path: a transfer
that failed while enqueueing stays in flight, marked failed, until what it enqueued drained, so a
slot is never freed while a copy may still touch it.

On the GPU a STORE reads blocks only after the work that wrote them; a LOAD overwrites blocks only
after the kernels queued before it, and is visible to the next kernels of any stream once ``poll``
reported it or ``wait`` returned; ``stream_wait`` orders a load (or one layer of a ``layerwise``
load) before the current stream's next work without blocking the host.

The pool is registered with ``cudaHostRegister`` (page-locked and mapped); where that fails the
backend raises ``PoolError`` with the reason, unless ``allow_pageable`` is set (DMA only, at
pageable-memory speed). One backend serves one engine thread. ``docs/cuda.md`` has the details and
the measurements behind them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvtier.copy.base import BackendSetup, CopyBackend, CopyJob, CopyResults
from kvtier.copy.cuda.direct import KernelStrategy, kernel_unavailable
from kvtier.copy.cuda.dma import DmaStrategy
from kvtier.copy.cuda.executor import (
    Executor,
    ExecutorUnavailable,
    Program,
    ProgramState,
    Recorder,
    executor_functions,
)
from kvtier.copy.cuda.options import DEFAULT_MAX_SMS, CudaCopyOptions
from kvtier.copy.cuda.plan import (
    KVGeometry,
    KVLayout,
    Plan,
    cuda_layout,
    describe_kv,
    merge_regions,
    plan_job,
    region_table,
)
from kvtier.copy.cuda.queue import Transfer, TransferQueue
from kvtier.copy.cuda.resources import (
    EventPool,
    PinnedPool,
    ResourceStats,
    StagingRing,
    StreamPool,
    close_rings,
    open_rings,
    ring_events,
)
from kvtier.copy.cuda.runtime import (
    CudaError,
    CudaRuntime,
    event_handle,
    memcpy_attributes,
    runtime,
)
from kvtier.copy.cuda.staged import StagedStrategy, planner_missing
from kvtier.copy.cuda.strategy import Strategy, choose_strategy, retire
from kvtier.pool import HostPool

__all__ = ["CudaCopyBackend", "CudaCopyOptions", "PinnedPool", "ResourceStats"]

log = logging.getLogger(__name__)


class CudaCopyBackend(CopyBackend):
    """Copies between an engine's KV tensors on one CUDA device and pool slots.

    ``kv_caches``: the engine's KV tensors in the given ``layout`` (see ``plan``). Each slot
    holds ``blocks_per_slot`` engine blocks; with tensor parallelism rank ``tp_rank`` owns part
    ``tp_rank`` of ``tp_size`` of each slot.
    """

    kind = "cuda"

    @classmethod
    def create(cls, kv_caches: Sequence[Any], setup: BackendSetup) -> CudaCopyBackend:
        """The layout recognised from the tensors' shapes (``cuda_layout``), the options from the
        config's ``copy`` section and ``pool.allow_pageable``."""
        return cls(
            kv_caches,
            cuda_layout(kv_caches),
            setup.pool,
            CudaCopyOptions.from_copy(setup.copy, setup.allow_pageable),
            blocks_per_slot=setup.blocks_per_slot,
            tp_rank=setup.tp_rank,
            tp_size=setup.tp_size,
        )

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
        self._region_table: Any = None
        self._strategy = self._register()
        self._queue = TransferQueue(options.max_in_flight, options.max_device_ops)
        self.plan_seconds: deque[float] = deque(maxlen=4096)
        """Caller's-thread time each recent transfer took to plan and record (and, without
        the executor, to make its CUDA calls)."""
        self.enqueue_seconds: deque[float] = deque(maxlen=4096)
        """Time each recent transfer's CUDA calls took (on the executor's thread, if any)."""
        self._executor: Executor | None = None
        if options.issue_thread:
            try:
                self._executor = self._make_executor()
            except ExecutorUnavailable as exc:
                log.warning("kvtier copy: CUDA calls on the caller's thread: %s", exc)
        self._closed = False

    # -- registration ----------------------------------------------------------------------------

    def _register(self) -> Strategy:
        """Pin the pool, create the device resources and the strategy; on failure destroy what
        was created."""
        options = self.options
        rt = self._rt = self._make_runtime()
        with self._device_context():
            self._pinned = PinnedPool(
                rt, self._pool, options.register_chunk_bytes, options.allow_pageable
            )
            try:
                self._events = EventPool(rt, options.prefill_events)
                self._setup_device()
                self._streams = StreamPool(rt, options.max_streams, options.stream_priority)
                return self._make_strategy()
            except BaseException:
                if hasattr(self, "_streams"):
                    self._streams.destroy()
                close_rings(self._rings, rt, self._free_device)
                if hasattr(self, "_events"):
                    self._events.destroy()
                if self._region_table is not None:
                    self._free_device(self._region_table)
                self._pinned.close()
                raise

    def _setup_device(self) -> None:
        """Choose the strategy and create what it needs on the device: the compiled kernel and
        the region table (``kernel``, ``staged``), the staging rings (``staged``)."""
        opts, geo, rt = self.options, self.geometry, self._rt
        self._merged = merge_regions(geo.regions)
        kernel_why = (
            kernel_unavailable(self._pinned, geo, self._pool.slot_stride, self._part_offset)
            or self._toolchain_missing()
        )
        self.strategy = choose_strategy(
            opts.strategy,
            kernel_why,
            rt.has_batch_memcpy,
            min(r.nbytes for r in self._merged) < opts.dma_min_piece_bytes,
            planner_missing,
        )
        self._attrs = {
            True: memcpy_attributes(True, self.device, opts.prefer_copy_engine),
            False: memcpy_attributes(False, self.device, opts.prefer_copy_engine),
        }
        self.sm_count = rt.multiprocessor_count(self.device)
        self.max_sms = min(opts.max_sms or DEFAULT_MAX_SMS, self.sm_count)
        self._kernels: Any = None
        self._region_table_address = 0
        if self.strategy in ("kernel", "staged"):
            self._kernels = self._compile_kernels()
            self._region_table, self._region_table_address = self._upload(region_table(geo.regions))
        if self.strategy == "staged":
            block = geo.block_bytes
            open_rings(
                self._rings,
                rt,
                self._alloc_device,
                max(1, opts.stage_bytes // block) * block,
                opts.stage_buffers,
                opts.stage_lanes,
                opts.stream_priority,
            )

    def _make_strategy(self) -> Strategy:
        opts, geo, streams, events = self.options, self.geometry, self._streams, self._events
        if self.strategy == "dma":
            return DmaStrategy(
                geo, self._merged, self._attrs, opts.dma_lanes, streams, events, self._pinned.pieces
            )
        functions = self._kernels.functions
        direct = KernelStrategy(geo, functions, self._region_table_address, self.max_sms, events)
        if self.strategy == "kernel":
            return direct
        return StagedStrategy(
            direct, self._rings, self._attrs, opts, streams, events, self._pinned.pieces
        )

    # -- the device touch points (overridden by the CPU emulation in the tests) ----------------

    def _make_runtime(self) -> CudaRuntime:
        return runtime()

    def _make_executor(self) -> Executor:
        rt = self._rt
        return Executor(executor_functions(rt), rt.batch_has_fail_idx, self.device)

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
        from kvtier.copy.cuda.kernels import CopyKernels

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
        if self._closed or self._queue.is_in_flight(job_id):
            log.error("copy job %d rejected: %s", job_id, "closed" if self._closed else "id in use")
            self._queue.report(job_id, False)
            return
        try:
            empty = len(job.engine_blocks) == 0 and len(job.slots) == 0
        except TypeError as exc:
            log.error("copy job %d rejected: %s", job_id, exc)
            self._queue.report(job_id, False)
            return
        if empty:
            self._queue.report(job_id, True)
            return
        try:
            gate = (0, self._current_stream()) if after is None else (event_handle(after), None)
        except Exception as exc:
            log.error("copy job %d failed: %s", job_id, exc)
            self._queue.report(job_id, False)
            return
        transfer = Transfer(job, layerwise, *gate)
        transfer.ops = self._strategy.estimate_ops(transfer)
        self._queue.push(transfer)
        self._pump()

    def _pump(self) -> None:
        """Plan and enqueue queued transfers, oldest first, while the device queues have room (at
        least one when nothing is in flight, however large)."""
        if self._closed:
            return
        while (transfer := self._queue.pop_ready()) is not None:
            self._start(transfer)

    def _make_room(self, job_ids: set[int]) -> None:
        """Enqueue what fits; while any of these jobs is still queued, wait for the oldest
        transfer in flight to finish."""
        while True:
            self._pump()
            if not self._queue.any_queued(job_ids):
                return
            oldest = self._queue.oldest()
            if oldest is None:
                continue  # (cannot stay so: _pump starts one when nothing is in flight)
            self._synchronize(oldest)
            self._collect()

    def _start(self, transfer: Transfer) -> None:
        """Check and plan one transfer, record its CUDA calls and hand them to the executor (or
        make them here); it goes in flight at once and counts as enqueued when its program
        ran. On failure it is in flight, marked failed, until what it enqueued has drained
        (the program then synchronizes the streams it used); ``poll`` reports it."""
        t0 = time.perf_counter()
        job_id = transfer.job_id
        plan: Plan | None = None
        reason = "id in use" if self._queue.get(job_id) is not None else ""  # two unreported jobs
        if not reason:
            try:
                plan = plan_job(
                    transfer.job,
                    self.geometry,
                    self.blocks_per_slot,
                    self._num_slots,
                    self._pinned.base,
                    self._pool.slot_stride,
                    self._part_offset,
                )
            except (ValueError, TypeError) as exc:
                reason = str(exc)
        if plan is None or len(plan.blocks) == 0:
            if reason:
                log.error("copy job %d rejected: %s", job_id, reason)
            self._queue.report(job_id, not reason)
            return
        program = transfer.program = self._record(transfer, plan)
        self._queue.enqueued(transfer)
        self._run(program)
        self.plan_seconds.append(time.perf_counter() - t0)

    def _record(self, transfer: Transfer, plan: Plan) -> Program:
        """The transfer's CUDA calls: its gate, its strategy's copies, its final event (or, where
        recording failed part way, the synchronization of every stream it used)."""
        rec = Recorder(self._rt.has_batch_memcpy)
        ring: StagingRing | None = None
        try:
            ring = self._strategy.shared_ring(transfer, plan.to_host)
            if ring is not None:
                transfer.stream = ring.main
                transfer.shares_streams = True
            else:
                transfer.stream = self._streams.acquire()
            gate = transfer.after
            if transfer.gate_stream is not None:
                gate = self._events.acquire()
                retire(rec, gate)  # a wait binds to the record made before it
                rec.event_record(gate, transfer.gate_stream)
            rec.stream_wait_event(transfer.stream, gate)
            self._strategy.enqueue(rec, transfer, plan)
            done = self._events.acquire()
            rec.event_record(done, transfer.stream)
            transfer.done = done
        except Exception as exc:
            log.error("copy job %d failed while enqueueing: %s", transfer.job_id, exc)
            transfer.failed = True
            lanes = ring.lanes if ring is not None else []
            for stream in (*transfer.aux_streams, *lanes, transfer.stream):
                if stream:
                    rec.stream_synchronize(stream)
        return rec.program

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

    # -- completion ----------------------------------------------------------------------------

    def poll(self) -> CopyResults:
        self._collect()
        self._pump()
        return self._queue.results()

    def _collect(self) -> None:
        """Report finished transfers and return their resources (the callers then refill the
        device from the queue)."""
        finished = [transfer for transfer in self._queue.in_flight() if self._finished(transfer)]
        if finished:
            self._queue.finish(finished, self._release)

    def _finished(self, transfer: Transfer) -> bool:
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

    def _wait_ran(self, transfer: Transfer) -> None:
        """Return once the transfer's program ran (the host waits for the executor only)."""
        program = transfer.program
        executor = self._executor
        if program is None or executor is None:
            return
        while program.state is ProgramState.QUEUED:
            executor.wait(program.seq, 1.0)

    def wait(self, job_ids: Sequence[int]) -> None:
        self._make_room(set(job_ids))
        for transfer in self._queue.find(job_ids):
            if transfer is not None:
                self._synchronize(transfer)

    def _synchronize(self, transfer: Transfer) -> None:
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
        for transfer in self._queue.take({job_id}):
            self._start(transfer)
        found = self._queue.get(job_id)
        if found is None:
            return
        self._wait_ran(found)
        program = found.program
        failed = program is None or program.state is ProgramState.FAILED
        if found.failed or not found.done or failed:
            return
        event = found.done if layer is None or not found.layer_events else found.layer_events[layer]
        # (Its events go back to the pool only when poll or wait reports it, on this thread.)
        self._rt.stream_wait_event(self._current_stream(), event)

    def fence(self, job_ids: Sequence[int]) -> None:
        """The current stream waits, on the GPU, for each job (the host does not)."""
        for job_id in job_ids:
            self.stream_wait(job_id)

    def _release(self, transfer: Transfer) -> None:
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
        in_flight, queued = self._queue.counts()
        return ResourceStats(
            self._streams.created,
            self._streams.idle,
            self._events.created,
            self._events.idle,
            ring_events(self._rings),
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
            for transfer in self._queue.drain():
                self._synchronize(transfer)
                self._release(transfer)
            for ring in self._rings.values():
                for event in ring.free:
                    if event:
                        self._events.release(event)
            close_rings(self._rings, self._rt, self._free_device)
            self._streams.destroy()
            self._events.destroy()
            self._pinned.close()
            if self._region_table is not None:
                self._free_device(self._region_table)
            self._region_table = None
            self._kernels = None
            self._kv_refs = []
