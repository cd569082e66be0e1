"""The few CUDA runtime and driver calls the CUDA copy backend needs, through ``ctypes``.

Why not PyTorch's own objects: ``torch.cuda.Stream()`` hands out one of a fixed pool of 32 streams
per priority, so "one stream per transfer" through it is not one stream per transfer; and the
batched memcpy of CUDA >= 12.8 has no PyTorch binding. Going through the runtime library that
PyTorch already loaded keeps one CUDA context and one set of handles (``cudaStream_t`` values are
interchangeable with ``torch.cuda.ExternalStream`` and ``torch.cuda.current_stream().cuda_stream``).

Every handle here is a plain ``int``. Every call checks its return code and raises ``CudaError``
naming the call, the error and its code.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import Any

import numpy as np

# cudaError_t values this module tells apart.
CUDA_SUCCESS = 0
CUDA_ERROR_NOT_READY = 600
CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713

STREAM_NON_BLOCKING = 0x1
EVENT_BLOCKING_SYNC = 0x1
EVENT_DISABLE_TIMING = 0x2
HOST_REGISTER_PORTABLE = 0x1
HOST_REGISTER_MAPPED = 0x2
MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction inferred from the (unified) addresses
DEV_ATTR_MULTIPROCESSOR_COUNT = 16

# cudaMemcpyAttributes (CUDA >= 12.8): {srcAccessOrder; cudaMemLocation srcLocHint, dstLocHint;
# unsigned flags}, cudaMemLocation being {type; int id}: 24 bytes, 4-byte aligned.
SRC_ACCESS_ORDER_STREAM = 1
MEM_LOCATION_DEVICE = 1
MEM_LOCATION_HOST = 2
MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1


class _MemLocation(ctypes.Structure):
    _fields_ = (("type", ctypes.c_int), ("id", ctypes.c_int))


class MemcpyAttributes(ctypes.Structure):
    _fields_ = (
        ("src_access_order", ctypes.c_int),
        ("src_loc_hint", _MemLocation),
        ("dst_loc_hint", _MemLocation),
        ("flags", ctypes.c_uint),
    )


class CudaError(RuntimeError):
    def __init__(self, call: str, code: int, name: str, text: str) -> None:
        self.call = call
        self.code = code
        super().__init__(f"{call} failed: {name} ({code}): {text}")


_vp = ctypes.c_void_p
_sz = ctypes.c_size_t
_int = ctypes.c_int
_uint = ctypes.c_uint


def _loaded_library(prefix: str) -> str | None:
    """Path of an already-mapped shared library whose file name starts with ``prefix``."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                if path.startswith("/") and os.path.basename(path).startswith(prefix):
                    return path
    except OSError:
        return None
    return None


def _open(prefix: str, fallbacks: tuple[str, ...]) -> ctypes.CDLL:
    errors: list[str] = []
    path = _loaded_library(prefix)
    for name in ((path,) if path else ()) + fallbacks:
        try:
            return ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    raise OSError(f"cannot load {prefix}: " + "; ".join(errors or ["not found"]))


class CudaRuntime:
    """Bound CUDA runtime and driver entry points of this process (load once, share)."""

    def __init__(self) -> None:
        # Prefer the runtime PyTorch mapped (same library instance, same per-thread state).
        self._rt = _open("libcudart.so", ("libcudart.so.13", "libcudart.so.12", "libcudart.so"))
        self._drv = _open("libcuda.so", ("libcuda.so.1", "libcuda.so"))
        rt, drv = self._rt, self._drv
        self._bind(rt, "cudaGetErrorString", [_int], ctypes.c_char_p)
        self._bind(rt, "cudaGetErrorName", [_int], ctypes.c_char_p)
        entry_points: dict[str, list[Any]] = {
            "cudaRuntimeGetVersion": [ctypes.POINTER(_int)],
            "cudaDriverGetVersion": [ctypes.POINTER(_int)],
            "cudaSetDevice": [_int],
            "cudaDeviceGetAttribute": [ctypes.POINTER(_int), _int, _int],
            "cudaStreamCreateWithPriority": [ctypes.POINTER(_vp), _uint, _int],
            "cudaStreamDestroy": [_vp],
            "cudaStreamSynchronize": [_vp],
            "cudaStreamWaitEvent": [_vp, _vp, _uint],
            "cudaEventCreateWithFlags": [ctypes.POINTER(_vp), _uint],
            "cudaEventDestroy": [_vp],
            "cudaEventRecord": [_vp, _vp],
            "cudaEventQuery": [_vp],
            "cudaEventSynchronize": [_vp],
            "cudaHostRegister": [_vp, _sz, _uint],
            "cudaHostUnregister": [_vp],
            "cudaHostGetDevicePointer": [ctypes.POINTER(_vp), _vp, _uint],
            "cudaMemcpyAsync": [_vp, _vp, _sz, _int, _vp],
            "cudaMemcpy": [_vp, _vp, _sz, _int],
            "cudaMalloc": [ctypes.POINTER(_vp), _sz],
            "cudaFree": [_vp],
            "cudaGetLastError": [],
        }
        for name, arg_types in entry_points.items():
            self._bind(rt, name, arg_types, _int)
        self._bind(drv, "cuGetErrorString", [_int, ctypes.POINTER(ctypes.c_char_p)], _int)
        self._bind(drv, "cuLaunchKernel", [_vp] + [_uint] * 7 + [_vp, _vp, _vp], _int)

        version = _int()
        self._check("cudaRuntimeGetVersion", self.cudaRuntimeGetVersion(ctypes.byref(version)))
        self.runtime_version = version.value
        self._check("cudaDriverGetVersion", self.cudaDriverGetVersion(ctypes.byref(version)))
        self.driver_version = version.value
        self._batch: Callable[..., int] | None = None
        self._batch_has_fail_idx = False
        batch = getattr(rt, "cudaMemcpyBatchAsync", None)
        if batch is not None and self.runtime_version >= 12080:
            # CUDA 12.8/12.9 take a failIdx out-parameter before the stream; 13.0 dropped it.
            self._batch_has_fail_idx = self.runtime_version < 13000
            args: list[Any] = [_vp, _vp, _vp, _sz, _vp, _vp, _sz]
            if self._batch_has_fail_idx:
                args.append(_vp)
            batch.argtypes = [*args, _vp]
            batch.restype = _int
            self._batch = batch
        self._fail_idx = _sz()
        self._attr_idx = np.zeros(1, dtype=np.uintp)

    def _bind(self, lib: ctypes.CDLL, name: str, args: list[Any], res: Any) -> None:
        fn = getattr(lib, name)
        fn.argtypes = args
        fn.restype = res
        setattr(self, name, fn)

    # Entry points bound in __init__ (typed loosely: ctypes functions).
    cudaGetErrorString: Any
    cudaGetErrorName: Any
    cudaRuntimeGetVersion: Any
    cudaDriverGetVersion: Any
    cudaSetDevice: Any
    cudaDeviceGetAttribute: Any
    cudaStreamCreateWithPriority: Any
    cudaStreamDestroy: Any
    cudaStreamSynchronize: Any
    cudaStreamWaitEvent: Any
    cudaEventCreateWithFlags: Any
    cudaEventDestroy: Any
    cudaEventRecord: Any
    cudaEventQuery: Any
    cudaEventSynchronize: Any
    cudaHostRegister: Any
    cudaHostUnregister: Any
    cudaHostGetDevicePointer: Any
    cudaMemcpyAsync: Any
    cudaMemcpy: Any
    cudaMalloc: Any
    cudaFree: Any
    cudaGetLastError: Any
    cuGetErrorString: Any
    cuLaunchKernel: Any

    @property
    def batch_has_fail_idx(self) -> bool:
        return self._batch_has_fail_idx

    @property
    def batch_entry_point(self) -> Any:
        """The bound ``cudaMemcpyBatchAsync`` (None before CUDA 12.8): the native executor calls
        it by address (``executor.executor_functions``)."""
        return self._batch

    # -- errors ---------------------------------------------------------------------------------

    def error_text(self, code: int) -> tuple[str, str]:
        name = self.cudaGetErrorName(code)
        text = self.cudaGetErrorString(code)
        return (name or b"?").decode(), (text or b"?").decode()

    def _check(self, call: str, code: int) -> None:
        if code != CUDA_SUCCESS:
            name, text = self.error_text(code)
            raise CudaError(call, code, name, text)

    def _check_driver(self, call: str, code: int) -> None:
        if code != 0:
            text = ctypes.c_char_p()
            self.cuGetErrorString(code, ctypes.byref(text))
            raise CudaError(call, code, f"CUresult {code}", (text.value or b"?").decode())

    # -- device ---------------------------------------------------------------------------------

    def multiprocessor_count(self, device: int) -> int:
        value = _int()
        code = self.cudaDeviceGetAttribute(
            ctypes.byref(value), DEV_ATTR_MULTIPROCESSOR_COUNT, device
        )
        self._check("cudaDeviceGetAttribute", code)
        return value.value

    # -- streams and events ---------------------------------------------------------------------

    def stream_create(self, priority: int = 0) -> int:
        handle = _vp()
        code = self.cudaStreamCreateWithPriority(
            ctypes.byref(handle), STREAM_NON_BLOCKING, priority
        )
        self._check("cudaStreamCreateWithPriority", code)
        return handle.value or 0

    def stream_destroy(self, stream: int) -> None:
        self._check("cudaStreamDestroy", self.cudaStreamDestroy(stream))

    def stream_synchronize(self, stream: int) -> None:
        self._check("cudaStreamSynchronize", self.cudaStreamSynchronize(stream))

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._check("cudaStreamWaitEvent", self.cudaStreamWaitEvent(stream, event, 0))

    def event_create(self) -> int:
        """An event without timing whose ``event_synchronize`` sleeps instead of spinning (a
        ``wait`` on a long transfer should not burn a core)."""
        handle = _vp()
        flags = EVENT_DISABLE_TIMING | EVENT_BLOCKING_SYNC
        code = self.cudaEventCreateWithFlags(ctypes.byref(handle), flags)
        self._check("cudaEventCreateWithFlags", code)
        return handle.value or 0

    def event_destroy(self, event: int) -> None:
        self._check("cudaEventDestroy", self.cudaEventDestroy(event))

    def event_record(self, event: int, stream: int) -> None:
        self._check("cudaEventRecord", self.cudaEventRecord(event, stream))

    def event_query(self, event: int) -> bool:
        """True when done, False when pending; raises on an error (the context is then broken)."""
        code = self.cudaEventQuery(event)
        if code == CUDA_SUCCESS:
            return True
        if code == CUDA_ERROR_NOT_READY:
            return False
        self._check("cudaEventQuery", code)
        return False  # not reached

    def event_synchronize(self, event: int) -> None:
        self._check("cudaEventSynchronize", self.cudaEventSynchronize(event))

    # -- host memory ----------------------------------------------------------------------------

    def host_register(self, address: int, nbytes: int) -> int:
        """Page-lock and map ``nbytes`` at ``address``; returns the raw cudaError_t (0: pinned)."""
        code: int = self.cudaHostRegister(
            address, nbytes, HOST_REGISTER_PORTABLE | HOST_REGISTER_MAPPED
        )
        if code != CUDA_SUCCESS:
            self.cudaGetLastError()  # not sticky: clear it so later calls do not report it
        return code

    def host_unregister(self, address: int) -> None:
        self._check("cudaHostUnregister", self.cudaHostUnregister(address))

    def host_device_pointer(self, address: int) -> int:
        out = _vp()
        self._check(
            "cudaHostGetDevicePointer", self.cudaHostGetDevicePointer(ctypes.byref(out), address, 0)
        )
        return out.value or 0

    # -- device memory ------------------------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        """Device memory of our own, outside any framework's caching allocator (so nothing the
        framework does, CUDA graph memory pools included, can hand it to someone else)."""
        out = _vp()
        self._check("cudaMalloc", self.cudaMalloc(ctypes.byref(out), nbytes))
        return out.value or 0

    def free(self, address: int) -> None:
        self._check("cudaFree", self.cudaFree(address))

    def upload(self, address: int, data: np.ndarray) -> None:
        """Synchronous host-to-device copy of a contiguous array."""
        array = np.ascontiguousarray(data)
        code = self.cudaMemcpy(address, array.ctypes.data, array.nbytes, MEMCPY_DEFAULT)
        self._check("cudaMemcpy", code)

    # -- copies and launches --------------------------------------------------------------------

    @property
    def has_batch_memcpy(self) -> bool:
        return self._batch is not None

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(
            "cudaMemcpyAsync", self.cudaMemcpyAsync(dst, src, nbytes, MEMCPY_DEFAULT, stream)
        )

    def memcpy_batch_raw(
        self, dsts: int, srcs: int, sizes: int, count: int, attrs: int, stream: int
    ) -> None:
        """One ``cudaMemcpyBatchAsync`` of ``count`` copies (one attribute set), from the addresses
        of the three uintp arrays and of the attributes, as a recorded program holds them."""
        batch = self._batch
        if batch is None:
            raise CudaError("cudaMemcpyBatchAsync", -1, "unavailable", "needs CUDA runtime >= 12.8")
        args: list[Any] = [dsts, srcs, sizes, count, attrs, self._attr_idx.ctypes.data, 1]
        if self._batch_has_fail_idx:
            args.append(ctypes.addressof(self._fail_idx))
        self._check("cudaMemcpyBatchAsync", batch(*args, stream))

    def launch(
        self,
        function: int,
        grid: int,
        block: int,
        params: ctypes.Array[ctypes.c_void_p],
        stream: int,
    ) -> None:
        """``cuLaunchKernel``; ``params`` is the kernelParams array (pointers to each argument)."""
        code = self.cuLaunchKernel(function, grid, 1, 1, block, 1, 1, 0, stream, params, None)
        self._check_driver("cuLaunchKernel", code)


_RUNTIME: CudaRuntime | None = None


def runtime() -> CudaRuntime:
    """The process's ``CudaRuntime``; initialises PyTorch's CUDA state first (same context)."""
    global _RUNTIME
    if _RUNTIME is None:
        import torch

        torch.cuda.init()  # type: ignore[no-untyped-call]
        _RUNTIME = CudaRuntime()
    return _RUNTIME


def memcpy_attributes(to_host: bool, device: int, prefer_copy_engine: bool) -> MemcpyAttributes:
    """Attributes for a batch whose sources are device memory (``to_host``) or host memory."""
    dev = _MemLocation(MEM_LOCATION_DEVICE, device)
    host = _MemLocation(MEM_LOCATION_HOST, 0)
    flags = MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE if prefer_copy_engine else 0
    src, dst = (dev, host) if to_host else (host, dev)
    return MemcpyAttributes(SRC_ACCESS_ORDER_STREAM, src, dst, flags)


def event_handle(event: Any) -> int:
    """A ``cudaEvent_t`` from an int or a ``torch.cuda.Event``."""
    if isinstance(event, int):
        return event
    handle = getattr(event, "cuda_event", None)
    if handle is None:
        handle = event._as_parameter_.value
    return int(handle)
