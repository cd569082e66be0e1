"""KV block transfers between GPU and the pinned shared host pool, against the PCIe limit.

Llama-3-8B KV geometry (32 layers, 8 KV heads, head dim 128, bf16, 16-token blocks: 2 MiB a
block), 512 blocks at scattered engine block ids and scattered pool slots, through the CUDA copy
backend, for both engine layouts (vLLM's per-layer ``[2, num_blocks, 16, 8, 128]`` and the
block-compact ``[num_blocks, 32, 2, 16, 8, 128]``) and both strategies (batched DMA, the
gather/scatter kernel); each direction alone and both at once. Every figure is set against a
contiguous pinned copy of the same size measured in the same run (``cudaMemcpyAsync`` of one
1 GiB buffer; the mean of one from PyTorch's pinned allocation and one from the registered pool),
timed right after each repetition. Also: host time to issue one transfer (the ``submit`` call on
the engine's thread, which plans it, and the time the backend's executor thread spent making
its CUDA calls), SMs used, a correctness check of every moved block, and the submit latency
with 10,000 transfers outstanding.
``--timeline`` instead prints when each copy and kernel of a few transfers ran on the GPU.

Needs a CUDA GPU, PyTorch and CuPy. Prints a table naming the GPU and writes JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import os
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bench_common import shm_dir

from kvtier.copy.base import CopyJob, Direction
from kvtier.copy.cuda.backend import CudaCopyBackend, CudaCopyOptions
from kvtier.copy.cuda.plan import KVLayout
from kvtier.copy.cuda.runtime import runtime
from kvtier.pool import DEFAULT_SHM_DIR, HostPool

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_TOKENS = 32, 8, 128, 16
ELEM = 2  # bf16
BLOCK_BYTES = LAYERS * 2 * BLOCK_TOKENS * KV_HEADS * HEAD_DIM * ELEM
GB = 1e9


@dataclass(slots=True)
class Row:
    layout: str
    variant: str
    """The options asked for (``auto`` rows are the defaults the acceptance is judged on)."""
    strategy: str
    sms_used: int
    direction: str
    gbps: float
    """Throughput with ``--pipeline`` transfers issued back to back (the engine's steady state)."""
    reference_gbps: float
    percent_of_contiguous: float
    """Median over repetitions of (this repetition / the contiguous copies timed right after:
    the mean of one from PyTorch-pinned memory and one from the registered pool)."""
    percent_of_faster_contiguous: float
    """The same against the faster of those two copies (stricter: the best of two samples of
    a noisy link against one sample of the transfer, so biased against the transfer)."""
    single_gbps: float
    """One transfer alone, timed from ``submit`` (so including its issue time) to ``wait``."""
    single_percent: float
    issue_us_median: float
    issue_us_max: float
    """``submit`` on the caller's (engine's) thread, one 512-block transfer."""
    enqueue_us_median: float
    enqueue_us_max: float
    """The CUDA calls of one transfer: on the executor's thread (``issue_thread``), or inside
    ``submit`` (without)."""
    issue_thread: bool
    verified: bool


@dataclass(slots=True)
class Outstanding:
    layout: str
    strategy: str
    transfers: int
    issue_thread: bool
    held_back: bool
    """The gate stayed closed until the last submit: all were outstanding at once."""
    median_us: float
    p99_us: float
    p999_us: float
    max_us: float
    streams_created: int
    over_100us: int
    first_over_100us: int
    """Index of the first submit over 100 us (-1: none)."""
    first_over_1ms: int
    slowest: list[tuple[int, float]]
    """(index, us) of the five slowest submits."""
    planned: int
    """Submits that planned their transfer (room on the device); the rest only queued."""
    planning_max_us: float
    """The slowest of those (planning and recording one transfer on the engine's thread)."""
    queued_max_us: float
    """The slowest submit that only queued."""
    control_max_us: float
    control_over_100us: int
    """The same loop timing a trivial Python call instead (building the job and appending it to
    a deque): the host's own noise floor on this lease."""
    device_max_connections: str


@dataclass(slots=True)
class Reference:
    """Contiguous pinned copies, GB/s: ``[mode][direction][host buffer]``; mode ``single`` is one
    1-transfer-sized copy timed alone, ``pipelined`` is ``--pipeline`` of them back to back."""

    gbps: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    def best(self, mode: str, direction: str) -> float:
        return max(self.gbps[mode][direction].values())


def gpu_info() -> dict[str, Any]:
    rt = runtime()
    props = torch.cuda.get_device_properties(0)
    info: dict[str, Any] = {
        "name": torch.cuda.get_device_name(0),
        "sm_count": props.multi_processor_count,
        "memory_gib": round(props.total_memory / 2**30, 1),
        "cuda_runtime": rt.runtime_version,
        "cuda_driver": rt.driver_version,
        "torch": torch.__version__,
    }
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=driver_version,pcie.link.gen.current,pcie.link.gen.max,"
                "pcie.link.width.current",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
        info["nvidia_smi"] = out
    except (OSError, subprocess.SubprocessError) as exc:
        info["nvidia_smi"] = f"unavailable: {exc}"
    return info


def median_time(fn: Callable[[], None], repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure_reference(
    pool: HostPool, nbytes: int, repeats: int, warmup: int, pipeline: int
) -> Reference:
    """Contiguous copies of ``nbytes``, from PyTorch-pinned buffers and from the registered
    pool: alone, and ``pipeline`` back to back (on one stream, and alternating two)."""
    rt = runtime()
    s1, s2 = rt.stream_create(), rt.stream_create()
    dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
    pinned = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
    for t in pinned:
        t.fill_(1)
    base = int(pool.array().ctypes.data)
    hosts = {
        "torch_pinned": (pinned[0].data_ptr(), pinned[1].data_ptr()),
        "pool_registered": (base, base + pool.slot_stride * (pool.num_slots // 2)),
    }
    d0, d1 = dev[0].data_ptr(), dev[1].data_ptr()
    ref = Reference({m: {"load": {}, "store": {}, "both": {}} for m in ("single", "pipelined")})

    def run(copies: list[tuple[int, int, int]]) -> None:
        for dst, src, stream in copies:
            rt.memcpy_async(dst, src, nbytes, stream)
        rt.stream_synchronize(s1)
        rt.stream_synchronize(s2)

    for name, (h0, h1) in hosts.items():
        plans: dict[str, list[tuple[int, int, int]]] = {
            "load": [(d0, h0, s1)],
            "store": [(h0, d0, s1)],
            "both": [(d0, h0, s1), (h1, d1, s2)],
        }
        for direction, copies in plans.items():
            moved = nbytes * len(copies)
            t = median_time(functools.partial(run, copies), repeats, warmup)
            ref.gbps["single"][direction][name] = moved / t / GB
            variants = {"one_stream": copies * pipeline}
            if direction != "both":
                dst, src, _ = copies[0]
                variants["two_streams"] = [(dst, src, (s1, s2)[i % 2]) for i in range(pipeline)]
            for label, plan in variants.items():
                t = median_time(functools.partial(run, plan), repeats, warmup)
                ref.gbps["pipelined"][direction][f"{name}/{label}"] = moved * pipeline / t / GB
    rt.stream_destroy(s1)
    rt.stream_destroy(s2)
    del dev, pinned
    torch.cuda.empty_cache()
    return ref


class Contiguous:
    """Contiguous pinned copies of one transfer's size, to time in between a configuration's own
    repetitions (the host's PCIe is shared, so its speed drifts by a few percent over a run)."""

    def __init__(self, pool: HostPool, nbytes: int) -> None:
        self.rt = runtime()
        self.nbytes = nbytes
        self.streams = (self.rt.stream_create(), self.rt.stream_create())
        self.dev = [torch.empty(nbytes, dtype=torch.uint8, device="cuda") for _ in range(2)]
        self.pinned = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        base = int(pool.array().ctypes.data)
        self.hosts = {
            "torch_pinned": (self.pinned[0].data_ptr(), self.pinned[1].data_ptr()),
            "pool_registered": (base, base + pool.slot_stride * (pool.num_slots // 2)),
        }

    def seconds(self, direction: str, host: str, k: int) -> float:
        """Wall time of ``k`` copies of ``nbytes`` back to back (``both``: k each way)."""
        rt, (s1, s2), n = self.rt, self.streams, self.nbytes
        d0, d1 = self.dev[0].data_ptr(), self.dev[1].data_ptr()
        h0, h1 = self.hosts[host]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(k):
            if direction in ("load", "both"):
                rt.memcpy_async(d0, h0, n, s1)
            if direction in ("store", "both"):
                rt.memcpy_async(h1 if direction == "both" else h0, d1, n, s2)
        rt.stream_synchronize(s1)
        rt.stream_synchronize(s2)
        return time.perf_counter() - t0

    def close(self) -> None:
        for stream in self.streams:
            self.rt.stream_destroy(stream)
        self.dev, self.pinned = [], []


@dataclass(frozen=True, slots=True)
class Engine:
    """An engine's KV tensors, how the backend is to read them and the name rows carry."""

    name: str
    kv: list[torch.Tensor]
    layout: KVLayout


def _random_bf16(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    bits = torch.randint(
        -(1 << 15), 1 << 15, shape, dtype=torch.int16, device="cuda", generator=gen
    )
    return bits.view(torch.bfloat16)


def make_engine(layout: KVLayout, num_blocks: int, gen: torch.Generator) -> list[torch.Tensor]:
    if layout is KVLayout.BLOCK_COMPACT:
        return [_random_bf16((num_blocks, LAYERS, 2, BLOCK_TOKENS, KV_HEADS, HEAD_DIM), gen)]
    return [
        _random_bf16((2, num_blocks, BLOCK_TOKENS, KV_HEADS, HEAD_DIM), gen) for _ in range(LAYERS)
    ]


def make_vllm_engine(block_outermost: bool, num_blocks: int, gen: torch.Generator) -> Engine:
    """vLLM 0.32's per-layer views ``[blocks, kv_heads, tokens, K + V]`` with NHC pages: one
    allocation, layer-outermost (``LBNHC``, vLLM's default) or block-outermost (``BLNHC``, what
    the kvtier connector asks for), placed as vLLM's ``KVCacheTensor`` places them."""
    page = (BLOCK_TOKENS, KV_HEADS, 2 * HEAD_DIM)
    if block_outermost:
        raw = _random_bf16((num_blocks, LAYERS, *page), gen)
        views = [raw[:, layer].permute(0, 2, 1, 3) for layer in range(LAYERS)]
    else:
        raw = _random_bf16((LAYERS, num_blocks, *page), gen)
        views = [raw[layer].permute(0, 2, 1, 3) for layer in range(LAYERS)]
    name = "vllm_BLNHC" if block_outermost else "vllm_LBNHC"
    return Engine(name, views, KVLayout.LAYER_BLOCKS_FIRST)


def blocks_equal(engine: Engine, a: list[int], b: list[int]) -> bool:
    """Engine blocks ``a`` hold, bit for bit, what blocks ``b`` hold."""
    ia = torch.tensor(a, device="cuda")
    ib = torch.tensor(b, device="cuda")
    for t in engine.kv:
        words = t.view(torch.int16)
        if engine.layout is KVLayout.LAYER_KV_FIRST:
            same = torch.equal(words[:, ia], words[:, ib])
        else:
            same = torch.equal(words[ia], words[ib])
        if not same:
            return False
    return True


def variant_name(options: CudaCopyOptions) -> str:
    if options.strategy == "auto":
        return "auto" if options.issue_thread else "auto no-thread"
    parts = [options.strategy]
    if options.strategy in ("kernel", "staged"):
        parts.append(f"sms={options.max_sms or 'default'}")
    if options.strategy == "staged":
        parts.append(f"stage={options.stage_buffers}x{options.stage_bytes >> 20}M")
        parts.append(f"ramp={options.stage_ramp_bytes >> 20}M")
        parts.append(f"lanes={options.stage_lanes}")
        if not options.stage_shared_streams:
            parts.append("own-streams")
    else:
        parts.append(f"lanes={options.dma_lanes}")
        if not options.prefer_copy_engine:
            parts.append("flags=0")
    return " ".join(parts)


def run_config(
    engine: Engine,
    pool: HostPool,
    options: CudaCopyOptions,
    ref: Reference,
    contiguous: Contiguous,
    args: argparse.Namespace,
) -> list[Row]:
    backend = CudaCopyBackend(engine.kv, engine.layout, pool, options)
    if not backend.pinned:
        raise SystemExit("the pool is not pinned")
    n = args.blocks
    rng = np.random.default_rng(args.seed)
    perm = rng.permutation(args.engine_blocks)
    a, b, c, d = (perm[i * n : (i + 1) * n].tolist() for i in range(4))
    slots = rng.permutation(pool.num_slots)
    sa, sb = slots[:n].tolist(), slots[n : 2 * n].tolist()
    job_ids = iter(range(1, 1 << 30))
    issue: dict[str, list[float]] = {"store": [], "load": [], "both": [], "_": []}
    enqueue: dict[str, list[float]] = {}

    def transfer(kind: str, jobs: list[tuple[Direction, list[int], list[int]]]) -> None:
        ids = []
        for direction, blocks, slot_list in jobs:
            job = CopyJob(next(job_ids), direction, blocks, slot_list)
            t0 = time.perf_counter()
            backend.submit(job)
            issue[kind].append(time.perf_counter() - t0)
            ids.append(job.job_id)
        backend.wait(ids)
        res = backend.poll()
        if res.failed or sorted(res.done) != sorted(ids):
            raise RuntimeError(f"transfer failed: {res}")

    reps, warm, k = args.repeats, args.warmup, args.pipeline
    store_one = [(Direction.STORE, a, sa)]
    load_one = [(Direction.LOAD, b, sa)]
    both_one = [(Direction.STORE, c, sb), (Direction.LOAD, b, sa)]

    def timed_single(kind: str, jobs: list[tuple[Direction, list[int], list[int]]]) -> float:
        backend.enqueue_seconds.clear()
        seconds = median_time(lambda: transfer(kind, jobs), reps, warm)
        enqueue[kind] = list(backend.enqueue_seconds)[warm * len(jobs) :]
        return seconds

    single = {
        "store": timed_single("store", store_one),
        "load": timed_single("load", load_one),
    }
    ok_single = blocks_equal(engine, a, b)
    single["both"] = timed_single("both", both_one)
    transfer("load", [(Direction.LOAD, d, sb)])
    ok_both = blocks_equal(engine, a, b) and blocks_equal(engine, c, d)
    # Back to back: stores alternate slot sets, loads alternate target blocks. Each repetition
    # is followed by the contiguous copies it is compared with.
    piped_jobs = {
        "store": [(Direction.STORE, a, (sa, sb)[i % 2]) for i in range(k)],
        "load": [(Direction.LOAD, (b, d)[i % 2], sa) for i in range(k)],
        "both": both_one * k,
    }
    piped: dict[str, float] = {}
    local_ref: dict[str, float] = {}
    paired: dict[str, float] = {}
    strict: dict[str, float] = {}
    for direction, jobs_k in piped_jobs.items():
        ours: list[float] = []
        theirs: list[list[float]] = []
        for i in range(warm + reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            transfer("_", jobs_k)
            elapsed = time.perf_counter() - t0
            refs = [contiguous.seconds(direction, host, k) for host in contiguous.hosts]
            if i >= warm:
                ours.append(elapsed)
                theirs.append(refs)
        ref_times = np.array(theirs)
        piped[direction] = float(np.median(ours))
        local_ref[direction] = float(np.median(ref_times.mean(axis=1)))
        paired[direction] = float(np.median(ref_times.mean(axis=1) / np.array(ours)))
        strict[direction] = float(np.median(ref_times.min(axis=1) / np.array(ours)))
    sms = backend.sms_used
    strategy = backend.strategy
    backend.close()

    rows = []
    nbytes = n * BLOCK_BYTES
    for direction, ok in (("store", ok_single), ("load", ok_single), ("both", ok_both)):
        moved = nbytes * (2 if direction == "both" else 1)
        gbps = moved * k / piped[direction] / GB
        one = moved / single[direction] / GB
        reference = moved * k / local_ref[direction] / GB
        ref_one = ref.best("single", direction)
        times = np.array(issue[direction][warm * (2 if direction == "both" else 1) :]) * 1e6
        enq = np.array(enqueue[direction]) * 1e6
        rows.append(
            Row(
                engine.name,
                variant_name(options),
                strategy,
                sms,
                direction,
                round(gbps, 2),
                round(reference, 2),
                round(100 * paired[direction], 1),
                round(100 * strict[direction], 1),
                round(one, 2),
                round(100 * one / ref_one, 1),
                round(float(np.median(times)), 1),
                round(float(times.max()), 1),
                round(float(np.median(enq)), 1) if len(enq) else -1.0,
                round(float(enq.max()), 1) if len(enq) else -1.0,
                options.issue_thread,
                ok,
            )
        )
    return rows


def run_outstanding(
    kv: list[torch.Tensor], layout: KVLayout, pool: HostPool, options: CudaCopyOptions, n: int
) -> Outstanding:
    backend = CudaCopyBackend(kv, layout, pool, options)
    gate = torch.cuda.Event()
    # Warm the submit path (first kernel launch, numpy, ...), then hold everything behind a sleep.
    for job in range(8):
        backend.submit(CopyJob(job, Direction.LOAD, [job], [job]))
    backend.wait(list(range(8)))
    backend.poll()
    times = np.empty(n)
    slots = pool.num_slots
    gc.collect()  # (walks every object: done before the warm-up, not between it and the loop)
    gc.freeze()
    gc.disable()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(4e9))  # several seconds of GPU time at boost clock
    gate.record()
    for job in range(8):  # warm the gated path; these stay outstanding too
        backend.submit(CopyJob(100 + n + job, Direction.LOAD, [job], [job]), after=gate)
    control = np.empty(n)
    try:
        clock = time.perf_counter
        planned_before = len(backend.plan_seconds)
        for job in range(n):
            blocks, slot = [job % 512], [job % slots]
            t0 = clock()
            backend.submit(CopyJob(100 + job, Direction.LOAD, blocks, slot), after=gate)
            times[job] = clock() - t0
        planned = len(backend.plan_seconds) - planned_before
        sink: deque[CopyJob] = deque()
        for job in range(n):
            blocks, slot = [job % 512], [job % slots]
            t0 = clock()
            sink.append(CopyJob(100 + job, Direction.LOAD, blocks, slot))
            control[job] = clock() - t0
    finally:
        gc.enable()
        gc.unfreeze()
    held = not gate.query()
    stats = backend.stats()
    in_flight = stats.in_flight + stats.queued
    streams = backend.stats().streams_created
    backend.wait([100 + job for job in range(n + 8)])
    res = backend.poll()
    if res.failed or len(res.done) != n + 8:
        raise RuntimeError(f"outstanding transfers: {len(res.done)} done, {len(res.failed)} failed")
    backend.close()
    us = times * 1e6
    slow = np.flatnonzero(us > 100)
    very_slow = np.flatnonzero(us > 1000)
    return Outstanding(
        layout.value,
        backend.strategy,
        n,
        options.issue_thread,
        held and in_flight == n + 8,
        round(float(np.median(us)), 1),
        round(float(np.percentile(us, 99)), 1),
        round(float(np.percentile(us, 99.9)), 1),
        round(float(us.max()), 1),
        streams,
        len(slow),
        int(slow[0]) if len(slow) else -1,
        int(very_slow[0]) if len(very_slow) else -1,
        [(int(i), round(float(us[i]), 1)) for i in np.argsort(us)[-5:][::-1]],
        planned,
        round(float(us[:planned].max()), 1) if planned else 0.0,
        round(float(us[planned:].max()), 1),
        round(float(control.max() * 1e6), 1),
        int((control > 100e-6).sum()),
        os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default (8)"),
    )


class TimedRuntime:
    """Wraps a backend's CUDA runtime: host time and calls per runtime method."""

    def __init__(self, rt: Any) -> None:
        self._rt = rt
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._rt, name)
        if not callable(target):
            return target

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return target(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed


def profile_issue(
    kv: list[torch.Tensor], layout: KVLayout, pool: HostPool, n: int, repeats: int
) -> None:
    """Where one transfer's issue time goes: per runtime method, and the Python around it (on
    the caller's thread, where the calls can be wrapped: the executor calls them from C)."""
    backend = CudaCopyBackend(kv, layout, pool, CudaCopyOptions(issue_thread=False))
    timed = TimedRuntime(backend._rt)
    slots = list(range(n))
    blocks = list(range(n, 2 * n))
    for direction in (Direction.STORE, Direction.LOAD):
        for i in range(repeats + 2):
            if i == 2:  # after two warm-up transfers
                backend._rt = timed  # type: ignore[assignment]
                timed.seconds.clear()
                timed.calls.clear()
                total = 0.0
            t0 = time.perf_counter()
            backend.submit(CopyJob(1000 + i, direction, blocks, slots))
            if i >= 2:
                total += time.perf_counter() - t0
            backend.wait([1000 + i])
            backend.poll()
        backend._rt = timed._rt
        in_rt = sum(timed.seconds.values())
        print(
            f"issue profile {layout.value} {backend.strategy} {direction.value}: "
            f"{total / repeats * 1e6:.0f} us per submit, {in_rt / repeats * 1e6:.0f} us in "
            "the runtime: "
            + ", ".join(
                f"{name} {timed.calls[name] // repeats}x {sec / repeats * 1e6:.0f} us"
                for name, sec in sorted(timed.seconds.items(), key=lambda kv: -kv[1])
            ),
            flush=True,
        )
    backend.close()


class TimelineRuntime:
    """Wraps a backend's CUDA runtime: timing events around every batched copy and kernel launch,
    on the stream it runs on (an op's start event completes when its stream reached it)."""

    def __init__(self, rt: Any) -> None:
        self._rt = rt
        self.ops: list[tuple[str, int, int, Any, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rt, name)

    def _timed(self, kind: str, stream: int, nbytes: int, call: Callable[[], None]) -> None:
        ext = torch.cuda.ExternalStream(stream)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(ext)
        call()
        end.record(ext)
        self.ops.append((kind, stream, nbytes, start, end))

    def memcpy_batch_raw(
        self, dsts: int, srcs: int, sizes: int, count: int, attrs: int, stream: int
    ) -> None:
        """(A replayed program makes its batched copies through this.)"""
        nbytes = int(np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(sizes)).sum())
        self._timed(
            "dma",
            stream,
            nbytes,
            lambda: self._rt.memcpy_batch_raw(dsts, srcs, sizes, count, attrs, stream),
        )

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._timed("dma", stream, nbytes, lambda: self._rt.memcpy_async(dst, src, nbytes, stream))

    def launch(self, function: Any, grid: int, block: int, params: Any, stream: int) -> None:
        self._timed(
            "kernel", stream, 0, lambda: self._rt.launch(function, grid, block, params, stream)
        )


def timeline(
    kv: list[torch.Tensor],
    layout: KVLayout,
    pool: HostPool,
    options: CudaCopyOptions,
    direction: Direction,
    n: int,
    transfers: int,
    reference_gbps: float,
) -> dict[str, Any]:
    """``transfers`` back to back: when each op ran, how busy the copy engines kept PCIe, the
    gaps, and each transfer's copy rate (the median of its copies of 64 MiB or more)."""
    # The calls are made on the caller's thread here (``options.issue_thread`` off), so that they
    # can be wrapped (the executor makes them from C).
    backend = CudaCopyBackend(kv, layout, pool, options)
    rng = np.random.default_rng(1)
    blocks = rng.permutation(backend.geometry.num_blocks)[: 2 * n]
    slots = rng.permutation(pool.num_slots)[:n].tolist()
    for warm in range(2):
        backend.submit(CopyJob(90 + warm, direction, blocks[:n].tolist(), slots))
        backend.wait([90 + warm])
    backend.poll()
    wrapped = TimelineRuntime(backend._rt)
    backend._rt = wrapped  # type: ignore[assignment]
    torch.cuda.synchronize()
    origin = torch.cuda.Event(enable_timing=True)
    origin.record()
    t0 = time.perf_counter()
    ids = list(range(transfers))
    for job in ids:
        part = blocks[(job % 2) * n : (job % 2 + 1) * n].tolist()
        backend.submit(CopyJob(job, direction, part, slots))
    backend.wait(ids)
    wall = time.perf_counter() - t0
    torch.cuda.synchronize()
    backend._rt = wrapped._rt
    strategy = backend.strategy
    backend.close()
    spans = [
        (kind, stream, nbytes, origin.elapsed_time(a), origin.elapsed_time(b))
        for kind, stream, nbytes, a, b in wrapped.ops
    ]
    dma = sorted((s, e) for kind, _, _, s, e in spans if kind == "dma")
    busy, gaps, cur_s, cur_e = 0.0, [], dma[0][0], dma[0][1]
    for s, e in dma[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((round(cur_e, 3), round(s - cur_e, 3)))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    first, last = dma[0][0], max(e for _, e in dma)
    kernels = [e - s for kind, _, _, s, e in spans if kind == "kernel"]
    moved = sum(nb for kind, _, nb, _, _ in spans if kind == "dma")
    # Programs run in submission order, each transfer making the same number of copies.
    copies = [(nb, s, e) for kind, _, nb, s, e in spans if kind == "dma"]
    per = len(copies) // transfers
    per_transfer = []
    for job in ids:
        mine = copies[job * per : (job + 1) * per]
        rates = [nb / (e - s) / 1e6 for nb, s, e in mine if nb >= 64 << 20]
        per_transfer.append(round(float(np.median(rates)), 2) if rates else 0.0)
    result = {
        "layout": layout.value,
        "strategy": strategy,
        "shared_staging_streams": options.stage_shared_streams,
        "direction": direction.value,
        "transfers": transfers,
        "wall_ms_host": round(wall * 1e3, 2),
        "gpu_first_dma_ms": round(first, 3),
        "gpu_last_dma_end_ms": round(last, 3),
        "dma_busy_ms": round(busy, 3),
        "dma_busy_percent_of_span": round(100 * busy / (last - first), 2),
        "gbps_over_dma_span": round(moved / (last - first) / 1e6, 2),
        "percent_of_reference_over_span": round(
            100 * moved / (last - first) / 1e6 / reference_gbps, 2
        ),
        "largest_gaps_ms": sorted(gaps, key=lambda g: -g[1])[:8],
        "dma_gbps_per_transfer": per_transfer,
        "kernels": len(kernels),
        "kernel_ms_total": round(sum(kernels), 3),
        "kernel_ms_max": round(max(kernels), 3) if kernels else 0.0,
        "ops": [
            (kind, stream % 100000, nbytes >> 20, round(s, 3), round(e, 3))
            for kind, stream, nbytes, s, e in spans[:60]
        ],
    }
    print(json.dumps({k: v for k, v in result.items() if k != "ops"}), flush=True)
    for op in result["ops"]:
        print("   ", op)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--engine-blocks", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--pipeline", type=int, default=8, help="transfers back to back")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--sms", default="8", help="comma-separated max_sms values for the kernel")
    parser.add_argument("--outstanding", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shm-dir", default=DEFAULT_SHM_DIR)
    parser.add_argument("--outstanding-only", action="store_true")
    parser.add_argument("--defaults-only", action="store_true", help="only the auto rows")
    parser.add_argument("--staged-sweep", action="store_true", help="staging pipeline variants")
    parser.add_argument(
        "--profile-issue", action="store_true", help="only: where the issue time goes"
    )
    parser.add_argument(
        "--timeline", action="store_true", help="only: when each copy and kernel ran on the GPU"
    )
    parser.add_argument("--json", type=Path, default=Path("docs/results/transfer_bench.json"))
    args = parser.parse_args()
    if args.engine_blocks < 4 * args.blocks:
        raise SystemExit("--engine-blocks must be at least 4 x --blocks")

    info = gpu_info()
    print(f"GPU: {info['name']} ({info['sm_count']} SMs), {info['nvidia_smi']}", flush=True)
    num_slots = 2 * args.blocks
    pool = HostPool.create(
        num_slots, BLOCK_BYTES, shm_dir=shm_dir(num_slots * BLOCK_BYTES, args.shm_dir)
    )
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    per_layer = Engine(
        KVLayout.LAYER_KV_FIRST.value,
        make_engine(KVLayout.LAYER_KV_FIRST, args.engine_blocks, gen),
        KVLayout.LAYER_KV_FIRST,
    )
    compact = Engine(
        KVLayout.BLOCK_COMPACT.value,
        make_engine(KVLayout.BLOCK_COMPACT, args.engine_blocks, gen),
        KVLayout.BLOCK_COMPACT,
    )
    pool.array()[:] = 0x5A  # fault the pages in before pinning
    # One backend holds the registration for the whole run; the others find the pool registered.
    anchor = CudaCopyBackend(compact.kv, compact.layout, pool, CudaCopyOptions(strategy="dma"))
    if args.timeline:
        ref = measure_reference(pool, args.blocks * BLOCK_BYTES, 3, 1, args.pipeline)
        lines = []
        # Both layouts each way, plus per-layer loads on streams of their own (as before staged
        # transfers shared their ring's streams).
        directions = (Direction.LOAD, Direction.STORE)
        runs = [(e, d, True) for e in (per_layer, compact) for d in directions]
        runs.insert(1, (per_layer, Direction.LOAD, False))
        for engine, direction, shared in runs:
            best = ref.best("pipelined", direction.value)
            options = CudaCopyOptions(issue_thread=False, stage_shared_streams=shared)
            lines.append(
                timeline(engine.kv, engine.layout, pool, options, direction, args.blocks, 6, best)
            )
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"gpu": info, "timelines": lines}, indent=1) + "\n")
        anchor.close()
        pool.close()
        return
    if args.profile_issue:
        for engine in (compact, per_layer):
            profile_issue(engine.kv, engine.layout, pool, args.blocks, args.repeats)
        anchor.close()
        pool.close()
        return
    t0 = time.perf_counter()
    ref = (
        Reference()
        if args.outstanding_only
        else measure_reference(
            pool, args.blocks * BLOCK_BYTES, args.repeats, args.warmup, args.pipeline
        )
    )
    print(f"reference (contiguous {args.blocks * BLOCK_BYTES / 2**30:.2f} GiB): {ref}", flush=True)

    sms_values = [int(s) for s in args.sms.split(",")]
    vllm_engines = [make_vllm_engine(outer, args.engine_blocks, gen) for outer in (True, False)]
    configs: list[tuple[Engine, CudaCopyOptions]] = [
        (compact, CudaCopyOptions(strategy="auto")),
        (per_layer, CudaCopyOptions(strategy="auto")),
        *((engine, CudaCopyOptions(strategy="auto")) for engine in vllm_engines),
    ]
    if not args.defaults_only:
        configs += [(per_layer, CudaCopyOptions(strategy="kernel", max_sms=s)) for s in sms_values]
        configs += [
            (compact, CudaCopyOptions(issue_thread=False)),
            (per_layer, CudaCopyOptions(issue_thread=False)),
            (per_layer, CudaCopyOptions(strategy="staged", max_sms=16)),
            (compact, CudaCopyOptions(strategy="dma", dma_lanes=2)),
            (compact, CudaCopyOptions(strategy="kernel")),
        ]
    if args.staged_sweep:
        configs = [(per_layer, CudaCopyOptions(strategy="auto"))]
        configs.append((per_layer, CudaCopyOptions(strategy="staged", stage_shared_streams=False)))
        configs += [
            (
                per_layer,
                CudaCopyOptions(
                    strategy="staged",
                    stage_lanes=lanes,
                    stage_bytes=stage,
                    stage_buffers=buffers,
                    max_sms=sms,
                ),
            )
            for lanes, stage, buffers, sms in (
                (1, 128 << 20, 2, 8),
                (2, 32 << 20, 2, 8),  # staging that fits in an H100's 50 MB L2 (or nearly)
                (1, 32 << 20, 2, 8),
                (1, 16 << 20, 2, 8),
                (2, 16 << 20, 3, 8),
            )
        ]
    if args.outstanding_only:
        configs = []
    contiguous = Contiguous(pool, args.blocks * BLOCK_BYTES)
    if configs:  # a throw-away pass: first touches of the pool, streams, kernels, clocks
        warm_args = argparse.Namespace(**{**vars(args), "repeats": 1, "warmup": 1, "pipeline": 2})
        for engine, options in configs[:2]:
            run_config(engine, pool, options, ref, contiguous, warm_args)
    rows: list[Row] = []
    for engine, options in configs:
        try:
            new = run_config(engine, pool, options, ref, contiguous, args)
        except Exception as exc:  # one broken variant must not hide the others' figures
            print(
                f"{engine.name} {options.strategy} sms={options.max_sms}: FAILED: {exc!r}",
                flush=True,
            )
            continue
        rows += new
        for r in new:
            print(
                f"  {r.layout:<16}{r.variant:<26}{r.strategy:<8}sms={r.sms_used:<4}"
                f"{r.direction:<6}{r.gbps:7.2f} GB/s {r.percent_of_contiguous:6.1f}%  "
                f"single {r.single_percent:5.1f}%  submit {r.issue_us_median:.0f} us "
                f"enqueue {r.enqueue_us_median:.0f} us",
                flush=True,
            )

    outstanding: list[Outstanding] = []
    outstanding_configs = [
        (compact, CudaCopyOptions()),
        (per_layer, CudaCopyOptions()),
        (per_layer, CudaCopyOptions(strategy="kernel")),
    ]
    if not args.defaults_only:
        outstanding_configs.append((per_layer, CudaCopyOptions(issue_thread=False)))
    for engine, options in [] if args.staged_sweep else outstanding_configs:
        try:
            o = run_outstanding(engine.kv, engine.layout, pool, options, args.outstanding)
        except Exception as exc:
            print(f"outstanding {engine.name}: FAILED: {exc!r}", flush=True)
            continue
        outstanding.append(o)
        print(f"  outstanding: {o}", flush=True)
    contiguous.close()
    anchor.close()
    pool.close()
    elapsed = time.perf_counter() - t0

    # The defaults on the issue's two layouts are what is judged (vLLM 0.32's rows are shown).
    judged = (compact.name, per_layer.name)
    auto = [r for r in rows if r.variant == "auto" and r.layout in judged]
    best = {(r.layout, r.direction): r for r in auto}
    acceptance = {
        "each_direction_ge_97pct": all(
            r.percent_of_contiguous >= 97 for (_, d), r in best.items() if d != "both"
        ),
        "both_directions_ge_95pct": all(
            r.percent_of_contiguous >= 95 for (_, d), r in best.items() if d == "both"
        ),
        "issue_512_blocks_lt_1ms": all(r.issue_us_max < 1000 for r in auto),
        "enqueue_on_executor_median_lt_1ms": all(r.enqueue_us_median < 1000 for r in auto),
        "outstanding_submit_lt_100us": bool(outstanding)
        and all(o.max_us < 100 and o.held_back for o in outstanding if o.issue_thread),
    }

    print()
    print(f"kvtier transfer benchmark on {info['name']} ({info['nvidia_smi']})")
    print(
        f"{args.blocks} scattered blocks of {BLOCK_BYTES >> 20} MiB (Llama-3-8B KV, 16-token "
        f"blocks), median of {args.repeats}; "
        "reference: contiguous pinned cudaMemcpyAsync, same run"
    )
    if ref.gbps:
        for mode in ("pipelined", "single"):
            print(
                f"reference GB/s ({mode}): load {ref.best(mode, 'load'):.2f}, "
                f"store {ref.best(mode, 'store'):.2f}, both {ref.best(mode, 'both'):.2f}"
            )
    print(
        "% contig: against the mean of the two contiguous copies timed after each repetition "
        "(faster: against the faster of them); submit: the call on the engine's thread "
        "(planning and recording included); enqueue: the CUDA calls, on the backend's executor "
        "thread (no-thread rows: inside submit); medians and maxima, us"
    )
    print(
        f"{'layout':<16}{'variant':<26}{'strategy':<9}{'SMs':>4} {'dir':<6}{'GB/s':>8}"
        f"{'% contig':>10}{'faster':>8}{'1 xfer':>8}{'%':>7}{'submit':>8}{'max':>7}"
        f"{'enqueue':>9}{'max':>7}  ok"
    )
    for r in rows:
        print(
            f"{r.layout:<16}{r.variant:<26}{r.strategy:<9}{r.sms_used:>4} {r.direction:<6}"
            f"{r.gbps:>8.2f}{r.percent_of_contiguous:>9.1f}%{r.percent_of_faster_contiguous:>7.1f}%"
            f"{r.single_gbps:>8.2f}"
            f"{r.single_percent:>6.1f}%{r.issue_us_median:>8.0f}{r.issue_us_max:>7.0f}"
            f"{r.enqueue_us_median:>9.0f}{r.enqueue_us_max:>7.0f}  {r.verified}"
        )
    for o in outstanding:
        print(
            f"{o.transfers} outstanding ({o.layout}, {o.strategy}"
            f"{'' if o.issue_thread else ', no thread'}): "
            f"submit median {o.median_us} us, p99.9 {o.p999_us} us, max {o.max_us} us "
            f"(planning {o.planned}: max {o.planning_max_us} us; queueing: max "
            f"{o.queued_max_us} us), held back: {o.held_back}; control loop: max "
            f"{o.control_max_us} us, {o.control_over_100us} over 100 us"
        )
    print(f"acceptance: {acceptance}")
    payload = {
        "gpu": info,
        "geometry": {
            "layers": LAYERS,
            "kv_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "block_tokens": BLOCK_TOKENS,
            "dtype": "bfloat16",
            "block_bytes": BLOCK_BYTES,
            "blocks": args.blocks,
            "engine_blocks": args.engine_blocks,
        },
        "method": "gbps: --pipeline transfers submitted back to back, wall clock from the first "
        "submit to wait() returning, median of repeats after warm-up; reference_gbps: the same "
        "bytes as contiguous cudaMemcpyAsync copies (--pipeline of one transfer's size, from "
        "PyTorch-pinned memory and from the registered pool, their mean), timed right after "
        "each repetition; percent_of_contiguous: median over repetitions of the ratio to the "
        "reference timed right after it; percent_of_faster_contiguous: the same against the "
        "faster of the two copies; single_*: one transfer alone, from submit (so including its "
        "issue time) to wait(), against one contiguous copy measured at the start of the run; "
        "issue_us: the submit call on the engine's thread (planning and recording the "
        "transfer's CUDA calls when there is room); enqueue_us: the CUDA calls per transfer, on "
        "the backend's executor thread (inside submit without one)",
        "reference": asdict(ref),
        "rows": [asdict(r) for r in rows],
        "outstanding": [asdict(o) for o in outstanding],
        "acceptance": acceptance,
        "seconds": round(elapsed, 1),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
