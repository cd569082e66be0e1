"""How fast does a host-to-device stream run when a kernel consumes what it lands?

Why: the per-layer (staged) LOAD of the CUDA backend stayed at 95-96% of a contiguous copy while
its pipeline without kernels reached 98%; the cause turned out to lie elsewhere (queued
transfers' blocked streams, see docs/cuda.md). This isolates the pattern: 2 GiB of
pinned host memory moved in chunks (``--chunk-mib``, 128 by default) through ``--buffers`` device
staging buffers, each chunk copied on by a consumer kernel on 8 SMs into a device buffer, so a
buffer is refilled only after the kernel read it. Variants (``--variants`` picks some):

* ``contiguous``: one copy of the whole 2 GiB (the reference, timed around each variant).
* ``dma only``: the chunked copies alone; ``dma+record``: an event recorded after each;
  ``dma+wait``: the consumer stream waits for each event; ``empty kernels``: and launches an
  empty kernel there.
* ``events``: a consumer kernel per chunk that waits for the chunk's copy through an event; the
  copy into a buffer waits for the kernel that last read it (the backend's staged pattern).
* ``flags``: one long-lived consumer kernel that polls a counter the copy stream writes after
  each chunk (``cuStreamWriteValue32``), and the copy stream waits on counters the kernel writes
  (``cuStreamWaitValue32``): no kernel depends on a copy through the scheduler.
* ``independent``: consumers that wait for nothing (unchecked, they race the copies);
  ``dependent, no reuse``: ``events`` with a buffer per chunk; ``host gated, ...``: the host
  waits for each copy to land and only then launches its consumer (a buffer per chunk, or two
  buffers refilled after a device-side or a host-side wait for their consumer).

Every variant's result is compared with the source. Needs a CUDA GPU, PyTorch and CuPy; prints a
table naming the GPU and writes JSON.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

TOTAL = 2 << 30
CTAS, THREADS = 8, 512
WAIT_GEQ, WRITE_DEFAULT = 0x0, 0x0

_SOURCE = r"""
// flags: [0] chunks landed, [1 + b] chunks consumed from buffer b (as k + 1), [8 + k] CTAs done.
extern "C" __global__ void follow(const uint4* stage, uint4* dst, unsigned long long chunk_vecs,
                                  int chunks, int buffers, unsigned* flags) {
  volatile unsigned* landed = flags;
  for (int k = 0; k < chunks; ++k) {
    if (threadIdx.x == 0) { while (landed[0] < (unsigned)(k + 1)) { __nanosleep(200); } }
    __syncthreads();
    __threadfence();
    const uint4* src = stage + (unsigned long long)(k % buffers) * chunk_vecs;
    uint4* out = dst + (unsigned long long)k * chunk_vecs;
    for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < chunk_vecs;
         i += (unsigned long long)gridDim.x * blockDim.x) __stcs(out + i, __ldcg(src + i));
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(&flags[8 + k], 1u) == gridDim.x - 1) {
        __threadfence_system();
        atomicExch(&flags[1 + k % buffers], (unsigned)(k + 1));
      }
    }
  }
}
extern "C" __global__ void nothing() {}
extern "C" __global__ void copy_chunk(const uint4* src, uint4* out, unsigned long long vecs) {
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < vecs;
       i += (unsigned long long)gridDim.x * blockDim.x) __stcs(out + i, __ldcg(src + i));
}
"""


class Pipeline:
    def __init__(self, chunk: int, buffers: int) -> None:
        import cupy

        self.chunk, self.buffers, self.chunks = chunk, buffers, TOTAL // chunk

        self.cupy = cupy
        driver = ctypes.CDLL("libcuda.so.1")
        self.wait_value = driver.cuStreamWaitValue32_v2
        self.write_value = driver.cuStreamWriteValue32_v2
        for fn in (self.wait_value, self.write_value):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
        total = TOTAL
        self.host = torch.randint(0, 256, (total,), dtype=torch.uint8).pin_memory()
        self.stage = torch.empty(chunk * buffers, dtype=torch.uint8, device="cuda")
        # One staging region per chunk, for the variants that never reuse a buffer.
        self.stage_all = torch.empty(total, dtype=torch.uint8, device="cuda")
        self.dst = torch.empty(total, dtype=torch.uint8, device="cuda")
        self.flags = torch.zeros(8 + self.chunks, dtype=torch.int32, device="cuda")
        module = cupy.RawModule(code=_SOURCE)
        self.follow = module.get_function("follow")
        self.copy_chunk = module.get_function("copy_chunk")
        self.nothing = module.get_function("nothing")
        self.lane, self.main = torch.cuda.Stream(), torch.cuda.Stream()
        self.cupy_main = cupy.cuda.ExternalStream(self.main.cuda_stream)

    def _copy_in(self, k: int, own_buffer: bool = False) -> int:
        """Chunk ``k`` into its staging buffer (or a region of its own), on the copy stream;
        the buffer's address."""
        if own_buffer:
            stage = self.stage_all.data_ptr() + k * self.chunk
        else:
            stage = self.stage.data_ptr() + (k % self.buffers) * self.chunk
        rt = self.cupy.cuda.runtime
        source = self.host.data_ptr() + k * self.chunk
        rt.memcpyAsync(stage, source, self.chunk, rt.memcpyDefault, self.lane.cuda_stream)
        return stage

    def contiguous(self) -> None:
        with torch.cuda.stream(self.lane):
            self.dst.copy_(self.host, non_blocking=True)

    def dma_only(self) -> None:
        for k in range(self.chunks):
            self._copy_in(k)

    def events(self) -> None:
        read: list[torch.cuda.Event | None] = [None] * self.buffers
        for k in range(self.chunks):
            previous = read[k % self.buffers]
            if previous is not None:
                self.lane.wait_event(previous)
            stage = self._copy_in(k)
            self.main.wait_stream(self.lane)
            self._consume(k, stage)
            read[k % self.buffers] = self._recorded(self.main)
        self.lane.wait_stream(self.main)

    def _consume(self, k: int, stage: int) -> None:
        out = self.dst.data_ptr() + k * self.chunk
        u64 = np.uint64
        self.copy_chunk(
            (CTAS,),
            (THREADS,),
            (u64(stage), u64(out), u64(self.chunk // 16)),
            stream=self.cupy_main,
        )

    def _recorded(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def dma_recorded(self) -> None:
        """An event recorded after each copy; nothing waits for it."""
        for k in range(self.chunks):
            self._copy_in(k)
            self._recorded(self.lane)

    def dma_waited(self) -> None:
        """The consumer stream waits for each copy's event but launches nothing."""
        for k in range(self.chunks):
            self._copy_in(k)
            self.main.wait_event(self._recorded(self.lane))
        self.lane.wait_stream(self.main)

    def empty_consumer(self) -> None:
        """An empty kernel waits for each copy's event."""
        for k in range(self.chunks):
            self._copy_in(k)
            self.main.wait_event(self._recorded(self.lane))
            self.nothing((1,), (1,), (), stream=self.cupy_main)
        self.lane.wait_stream(self.main)

    def independent(self) -> None:
        """Consumer kernels that wait for nothing (each chunk its own buffer): the kernels run
        beside the copies without depending on them. The result is not checked (it races)."""
        for k in range(self.chunks):
            self._copy_in(k, own_buffer=True)
        for k in range(self.chunks):
            self._consume(k, self.stage_all.data_ptr() + k * self.chunk)
        self.lane.wait_stream(self.main)

    def dependent_no_reuse(self) -> None:
        """A consumer per chunk through events, each chunk its own buffer: no copy waits."""
        for k in range(self.chunks):
            stage = self._copy_in(k, own_buffer=True)
            self.main.wait_event(self._recorded(self.lane))
            self._consume(k, stage)
        self.lane.wait_stream(self.main)

    def host_gated(self) -> None:
        """The host waits for each copy to land, then launches its consumer: nothing on the
        GPU waits for anything (each chunk its own buffer)."""
        landed = []
        for k in range(self.chunks):
            self._copy_in(k, own_buffer=True)
            landed.append(self._recorded(self.lane))
        for k in range(self.chunks):
            landed[k].synchronize()
            self._consume(k, self.stage_all.data_ptr() + k * self.chunk)
        self.lane.wait_stream(self.main)

    def host_gated_reuse(self, device_reuse: bool) -> None:
        """Two staging buffers; the host launches chunk k's consumer once its copy landed. A
        buffer is refilled after its consumer: the copy stream waits for the consumer's event
        (``device_reuse``) or the host waits for it before queueing the copy."""
        landed: list[torch.cuda.Event] = []
        read: list[torch.cuda.Event] = []
        for k in range(min(self.buffers, self.chunks)):
            self._copy_in(k)
            landed.append(self._recorded(self.lane))
        for k in range(self.chunks):
            landed[k].synchronize()
            self._consume(k, self.stage.data_ptr() + (k % self.buffers) * self.chunk)
            read.append(self._recorded(self.main))
            nxt = k + self.buffers
            if nxt < self.chunks:
                if device_reuse:
                    self.lane.wait_event(read[k])
                else:
                    read[k].synchronize()
                self._copy_in(nxt)
                landed.append(self._recorded(self.lane))
        self.lane.wait_stream(self.main)

    def flagged(self) -> None:
        flags = self.flags.data_ptr()
        args = (
            np.uint64(self.stage.data_ptr()),
            np.uint64(self.dst.data_ptr()),
            np.uint64(self.chunk // 16),
            np.int32(self.chunks),
            np.int32(self.buffers),
            np.uint64(flags),
        )
        self.follow((CTAS,), (THREADS,), args, stream=self.cupy_main)
        stream = self.lane.cuda_stream
        for k in range(self.chunks):
            if k >= self.buffers:  # the chunk that last used this buffer has been consumed
                code = self.wait_value(
                    stream, flags + 4 * (1 + k % self.buffers), k - self.buffers + 1, 0
                )
                assert code == 0, f"cuStreamWaitValue32: {code}"
            self._copy_in(k)
            code = self.write_value(stream, flags, k + 1, WRITE_DEFAULT)
            assert code == 0, f"cuStreamWriteValue32: {code}"
        self.lane.wait_stream(self.main)

    def seconds(self, variant: Callable[[], None], repeats: int) -> float:
        times = []
        for _ in range(repeats + 1):  # the first warms up
            self.dst.zero_()
            self.flags.zero_()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            variant()
            self.lane.synchronize()
            self.main.synchronize()
            times.append(time.perf_counter() - t0)
        return float(np.median(times[1:]))

    def landed_right(self) -> bool:
        return bool(torch.equal(self.dst, self.host.to("cuda")))


def variants_of(pipe: Pipeline) -> dict[str, Callable[[], None]]:
    return {
        "dma only": pipe.dma_only,
        "events": pipe.events,
        "flags": pipe.flagged,
        "dma+record": pipe.dma_recorded,
        "dma+wait": pipe.dma_waited,
        "empty kernels": pipe.empty_consumer,
        "independent": pipe.independent,
        "dependent, no reuse": pipe.dependent_no_reuse,
        "host gated, no reuse": pipe.host_gated,
        "host gated, device reuse": lambda: pipe.host_gated_reuse(True),
        "host gated, host reuse": lambda: pipe.host_gated_reuse(False),
    }


UNCHECKED = {"dma only", "dma+record", "dma+wait", "empty kernels", "independent"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--chunk-mib", type=int, nargs="+", default=[128])
    parser.add_argument("--buffers", type=int, nargs="+", default=[2])
    parser.add_argument("--variants", nargs="+", help="names of the variants to run (all)")
    parser.add_argument("--json", type=Path, default=Path("docs/results/h2d_consumer_bench.json"))
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    rows: list[dict[str, Any]] = []
    for chunk_mib in args.chunk_mib:
        for buffers in args.buffers:
            pipe = Pipeline(chunk_mib << 20, buffers)
            variants = variants_of(pipe)
            chosen = args.variants or list(variants)
            for round_ in range(args.rounds):
                for name in chosen:
                    before = pipe.seconds(pipe.contiguous, args.repeats)
                    took = pipe.seconds(variants[name], args.repeats)
                    after = pipe.seconds(pipe.contiguous, args.repeats)
                    right = None if name in UNCHECKED else pipe.landed_right()
                    reference = (before + after) / 2
                    rows.append(
                        {
                            "chunk_mib": chunk_mib,
                            "buffers": buffers,
                            "round": round_,
                            "variant": name,
                            "gbps": round(TOTAL / took / 1e9, 2),
                            "contiguous_gbps": round(TOTAL / reference / 1e9, 2),
                            "percent_of_contiguous": round(100 * reference / took, 1),
                            "verified": right,
                        }
                    )
            del pipe
            torch.cuda.empty_cache()
    print(f"\nhost-to-device stream with a consumer kernel, on {gpu}")
    print(f"{TOTAL >> 30} GiB in chunks through staging buffers, consumer on {CTAS} SMs;")
    print("contig: the whole-buffer copy timed before and after each variant (mean)")
    header = f"{'MiB':>5}{'bufs':>5}{'round':>6}  {'variant':<26}"
    print(f"{header}{'GB/s':>8}{'contig':>8}{'%':>8}  verified")
    for row in rows:
        print(
            f"{row['chunk_mib']:>5}{row['buffers']:>5}{row['round']:>6}  {row['variant']:<26}"
            f"{row['gbps']:>8.2f}{row['contiguous_gbps']:>8.2f}{row['percent_of_contiguous']:>7.1f}%"
            f"  {row['verified']}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
