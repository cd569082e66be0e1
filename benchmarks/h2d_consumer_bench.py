"""How fast does a host-to-device stream run when a kernel consumes what it lands?

Why: the per-layer (staged) LOAD of the CUDA backend stays at 95-96% of a contiguous copy while
its pipeline without kernels reaches 98% (docs/cuda.md). This isolates the pattern: 2 GiB of
pinned host memory moved in 16 chunks of 128 MiB through two device staging buffers, each chunk
copied on by a consumer kernel on 8 SMs into a device buffer, so a buffer is refilled only after
the kernel read it. Variants:

* ``contiguous``: one copy of the whole 2 GiB (the reference, timed between the variants).
* ``dma only``: the chunked copies alone.
* ``events``: a consumer kernel per chunk that waits for the chunk's copy through an event; the
  copy into a buffer waits for the kernel that last read it (the backend's staged pattern).
* ``flags``: one long-lived consumer kernel that polls a counter the copy stream writes after
  each chunk (``cuStreamWriteValue32``), and the copy stream waits on counters the kernel writes
  (``cuStreamWaitValue32``): no kernel depends on a copy through the scheduler.

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

CHUNK = 128 << 20
CHUNKS = 16
BUFFERS = 2
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
extern "C" __global__ void copy_chunk(const uint4* src, uint4* out, unsigned long long vecs) {
  for (unsigned long long i = blockIdx.x * blockDim.x + threadIdx.x; i < vecs;
       i += (unsigned long long)gridDim.x * blockDim.x) __stcs(out + i, __ldcg(src + i));
}
"""


class Pipeline:
    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        driver = ctypes.CDLL("libcuda.so.1")
        self.wait_value = driver.cuStreamWaitValue32_v2
        self.write_value = driver.cuStreamWriteValue32_v2
        for fn in (self.wait_value, self.write_value):
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
        total = CHUNK * CHUNKS
        self.host = torch.randint(0, 256, (total,), dtype=torch.uint8).pin_memory()
        self.stage = torch.empty(CHUNK * BUFFERS, dtype=torch.uint8, device="cuda")
        self.dst = torch.empty(total, dtype=torch.uint8, device="cuda")
        self.flags = torch.zeros(8 + CHUNKS, dtype=torch.int32, device="cuda")
        module = cupy.RawModule(code=_SOURCE)
        self.follow = module.get_function("follow")
        self.copy_chunk = module.get_function("copy_chunk")
        self.lane, self.main = torch.cuda.Stream(), torch.cuda.Stream()
        self.cupy_main = cupy.cuda.ExternalStream(self.main.cuda_stream)

    def _copy_in(self, k: int) -> int:
        """Chunk ``k`` into its staging buffer, on the copy stream; the buffer's address."""
        stage = self.stage.data_ptr() + (k % BUFFERS) * CHUNK
        rt = self.cupy.cuda.runtime
        source = self.host.data_ptr() + k * CHUNK
        rt.memcpyAsync(stage, source, CHUNK, rt.memcpyDefault, self.lane.cuda_stream)
        return stage

    def contiguous(self) -> None:
        with torch.cuda.stream(self.lane):
            self.dst.copy_(self.host, non_blocking=True)

    def dma_only(self) -> None:
        for k in range(CHUNKS):
            self._copy_in(k)

    def events(self) -> None:
        read: list[torch.cuda.Event | None] = [None] * BUFFERS
        u64 = np.uint64
        for k in range(CHUNKS):
            previous = read[k % BUFFERS]
            if previous is not None:
                self.lane.wait_event(previous)
            stage = self._copy_in(k)
            self.main.wait_stream(self.lane)
            out = self.dst.data_ptr() + k * CHUNK
            self.copy_chunk(
                (CTAS,), (THREADS,), (u64(stage), u64(out), u64(CHUNK // 16)), stream=self.cupy_main
            )
            event = torch.cuda.Event()
            event.record(self.main)
            read[k % BUFFERS] = event
        self.lane.wait_stream(self.main)

    def flagged(self) -> None:
        flags = self.flags.data_ptr()
        args = (
            np.uint64(self.stage.data_ptr()),
            np.uint64(self.dst.data_ptr()),
            np.uint64(CHUNK // 16),
            np.int32(CHUNKS),
            np.int32(BUFFERS),
            np.uint64(flags),
        )
        self.follow((CTAS,), (THREADS,), args, stream=self.cupy_main)
        stream = self.lane.cuda_stream
        for k in range(CHUNKS):
            if k >= BUFFERS:  # the chunk that last used this buffer has been consumed
                code = self.wait_value(stream, flags + 4 * (1 + k % BUFFERS), k - BUFFERS + 1, 0)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=Path("docs/results/h2d_consumer_bench.json"))
    args = parser.parse_args()
    pipe = Pipeline()
    gpu = torch.cuda.get_device_name()
    variants: dict[str, Callable[[], None]] = {
        "dma only": pipe.dma_only,
        "events": pipe.events,
        "flags": pipe.flagged,
    }
    rows: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for name, variant in variants.items():
            before = pipe.seconds(pipe.contiguous, args.repeats)
            took = pipe.seconds(variant, args.repeats)
            after = pipe.seconds(pipe.contiguous, args.repeats)
            right = name == "dma only" or pipe.landed_right()
            reference = (before + after) / 2
            rows.append(
                {
                    "round": round_,
                    "variant": name,
                    "gbps": round(CHUNK * CHUNKS / took / 1e9, 2),
                    "contiguous_gbps": round(CHUNK * CHUNKS / reference / 1e9, 2),
                    "percent_of_contiguous": round(100 * reference / took, 1),
                    "verified": right,
                }
            )
    print(f"\nhost-to-device stream with a consumer kernel, on {gpu}")
    print(
        f"{CHUNKS} chunks of {CHUNK >> 20} MiB, {BUFFERS} staging buffers, consumer on {CTAS} SMs;"
    )
    print("contig: the whole-buffer copy timed before and after each variant (mean)")
    print(f"{'round':>5}  {'variant':<10}{'GB/s':>8}{'contig':>8}{'%':>8}  verified")
    for row in rows:
        print(
            f"{row['round']:>5}  {row['variant']:<10}{row['gbps']:>8.2f}"
            f"{row['contiguous_gbps']:>8.2f}{row['percent_of_contiguous']:>7.1f}%"
            f"  {row['verified']}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
