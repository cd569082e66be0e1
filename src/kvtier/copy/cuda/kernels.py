"""The gather/scatter kernel: engine KV blocks <-> pinned, mapped host memory, on a few SMs.

One launch copies ``n_blocks x n_regions`` pieces (a piece: one block's bytes of one region, e.g.
32 KiB of one layer's K). Each warp takes whole pieces; its 32 lanes move 16-byte vectors,
``UNROLL`` loads in flight before the matching stores, so a handful of SMs keep the PCIe link busy
in both directions. Loads and stores are cache-streaming (``__ldcs``/``__stcs``: every byte is
touched once): measured on an H200, a staged STORE (gather into the staging buffer while the copy
engine drains the other one) went from 96.0% to 98.0% of a contiguous copy (presumably the copy
engine competes less with the kernel for L2). (A staged LOAD's 96% was not the kernel's doing:
see ``resources.StagingRing``.)

The host side is addressed through unified virtual addressing: the pool's
mmap is registered with ``cudaHostRegisterMapped``, and on 64-bit Linux the device sees it at the
same address (checked at registration).

The per-launch block list travels by value in the kernel parameters (``Params<CAP>``, see
``plan.pack_params``); the region table is a small device array written once at registration.
So a launch needs no staging buffer and nothing to free afterwards.

Compiled at first use with NVRTC through CuPy (``cupy.RawModule``), launched with ``cuLaunchKernel``
on the transfer's own stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.copy.cuda.plan import KERNEL_CAPACITIES

THREADS = 512
WARPS = THREADS // 32
"""Warps per CTA of the copy kernel: one piece each at a time."""
UNROLL = 8

_SOURCE = r"""
struct Region { unsigned long long base; long long stride; long long host_offset; };

template <int CAP>
struct Params {
    const Region* regions;
    long long piece_bytes;
    int region_begin;
    int n_regions;
    int n_blocks;
    int to_host;
    unsigned long long host_addr[CAP];
    int block_id[CAP];
};

template <int CAP>
__device__ __forceinline__ void copy_pieces(const Params<CAP>& p) {
    const int lane = threadIdx.x & 31;
    const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const int n_warps = (gridDim.x * blockDim.x) >> 5;
    const int units = p.n_blocks * p.n_regions;
    const long long vecs = p.piece_bytes >> 4;
    for (int u = warp; u < units; u += n_warps) {
        const int b = u / p.n_regions;
        const Region reg = p.regions[p.region_begin + (u - b * p.n_regions)];
        uint4* dev = reinterpret_cast<uint4*>(reg.base + reg.stride * (long long)p.block_id[b]);
        uint4* host = reinterpret_cast<uint4*>(p.host_addr[b] + reg.host_offset);
        const uint4* src = p.to_host ? dev : host;
        uint4* dst = p.to_host ? host : dev;
        for (long long i = lane; i < vecs; i += 32 * UNROLL) {
            uint4 v[UNROLL];
#pragma unroll
            for (int k = 0; k < UNROLL; ++k) {
                const long long j = i + 32 * k;
                if (j < vecs) v[k] = __ldcs(src + j);
            }
#pragma unroll
            for (int k = 0; k < UNROLL; ++k) {
                const long long j = i + 32 * k;
                if (j < vecs) __stcs(dst + j, v[k]);
            }
        }
    }
    // Make the stores to host memory visible system-wide before the kernel counts as finished.
    __threadfence_system();
}

// __grid_constant__: the by-value arrays are indexed in place, never copied to local memory.
#define KVTIER_COPY(CAP) \
    extern "C" __global__ void __launch_bounds__(THREADS) \
    kvtier_copy_##CAP(const __grid_constant__ Params<CAP> p) { copy_pieces<CAP>(p); }
"""


def kernel_source() -> str:
    head = f"#define THREADS {THREADS}\n#define UNROLL {UNROLL}\n"
    tail = "".join(f"KVTIER_COPY({cap})\n" for cap in KERNEL_CAPACITIES)
    return head + _SOURCE + tail


@dataclass(slots=True)
class CopyKernels:
    """The compiled kernel variants, one per parameter capacity."""

    functions: dict[int, int]
    """capacity -> CUfunction handle."""
    module: Any
    """Keeps the CuPy module (and so the functions) alive."""

    @classmethod
    def compile(cls) -> CopyKernels:
        import cupy

        module = cupy.RawModule(code=kernel_source(), options=("-std=c++17",))
        functions = {
            cap: _function_handle(module, f"kvtier_copy_{cap}") for cap in KERNEL_CAPACITIES
        }
        return cls(functions, module)


def _function_handle(module: Any, name: str) -> int:
    """The ``CUfunction`` of a kernel in a CuPy module (``RawKernel.kernel`` is the loaded
    ``cupy.cuda.Function``)."""
    kernel = module.get_function(name)
    function = getattr(kernel, "kernel", kernel)
    return int(function.ptr)
