"""A CPU stand-in for the CUDA runtime, to test the CUDA backend's bookkeeping anywhere.

"Device" tensors are numpy arrays in this process, so every address the backend computes is a real
address: copies are ``ctypes.memmove`` and the kernel is emulated from its packed parameters.
Enqueued work runs in one global FIFO, either at once or when ``run()`` is called (``deferred``),
which is enough to check that every copy happens, lands where it should and is reported once.
The backend's native executor thread is off unless asked for (``threaded=True``; it then calls
back into the fake): without it every test sees the same order of calls.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvtier.copy.cuda.backend import CudaCopyBackend
from kvtier.copy.cuda.executor import Executor, ExecutorFunctions
from kvtier.copy.cuda.plan import KERNEL_CAPACITIES, emulate_kernel, param_bytes
from kvtier.copy.cuda.runtime import CudaError

COMPUTE_STREAM = 7


class FakeDevice:
    type = "cuda"
    index = 0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FakeDevice)

    def __hash__(self) -> int:
        return 0


class FakeTensor:
    """A numpy array dressed as a CUDA tensor (shape, stride in elements, data_ptr, ...)."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array
        self.device = FakeDevice()

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def data_ptr(self) -> int:
        return int(self.array.ctypes.data)

    def element_size(self) -> int:
        return int(self.array.itemsize)


@dataclass
class FakeRuntime:
    deferred: bool = False
    sync_runs: bool = True
    """``event_synchronize`` runs the queue; False: it waits until another thread ran it."""
    has_batch_memcpy: bool = True
    fail: dict[str, int] = field(default_factory=dict)
    """Method name -> how many more calls succeed before one raises (then the entry is removed)."""
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    queue: list[Callable[[], None]] = field(default_factory=list)
    streams: set[int] = field(default_factory=set)
    events: set[int] = field(default_factory=set)
    done_events: set[int] = field(default_factory=set)
    registered: list[tuple[int, int]] = field(default_factory=list)
    register_code: int = 0
    freed: list[Any] = field(default_factory=list)
    callback_errors: list[BaseException] = field(default_factory=list)
    _callbacks: list[Any] = field(default_factory=list)
    _next: int = 100
    _lock: threading.RLock = field(default_factory=threading.RLock)
    """The executor calls back in while the test thread runs the queue."""

    def _maybe_fail(self, name: str) -> None:
        left = self.fail.get(name)
        if left is None:
            return
        if left == 0:
            del self.fail[name]
            raise CudaError(name, 999, "injected", "injected failure")
        self.fail[name] = left - 1

    def _handle(self) -> int:
        with self._lock:
            self._next += 1
            return self._next

    def _enqueue(self, op: Callable[[], None]) -> None:
        with self._lock:
            if self.deferred:
                self.queue.append(op)
            else:
                op()

    def run(self) -> None:
        with self._lock:
            queue, self.queue = self.queue, []
            for op in queue:
                op()

    # -- the CudaRuntime surface the backend uses ------------------------------------------------

    def error_text(self, code: int) -> tuple[str, str]:
        return "cudaErrorFake", f"fake error {code}"

    def multiprocessor_count(self, device: int) -> int:
        return 132

    def stream_create(self, priority: int = 0) -> int:
        self._maybe_fail("stream_create")
        handle = self._handle()
        self.streams.add(handle)
        return handle

    def stream_destroy(self, stream: int) -> None:
        self.streams.remove(stream)

    def stream_synchronize(self, stream: int) -> None:
        self.run()

    def stream_wait_event(self, stream: int, event: int) -> None:
        self._maybe_fail("stream_wait_event")
        self.calls.append(("wait", stream, event))

    def event_create(self) -> int:
        self._maybe_fail("event_create")
        handle = self._handle()
        self.events.add(handle)
        return handle

    def event_destroy(self, event: int) -> None:
        self.events.remove(event)

    def event_record(self, event: int, stream: int) -> None:
        self._maybe_fail("event_record")
        assert event in self.events
        with self._lock:
            self.calls.append(("record", event, stream))
            self.done_events.discard(event)
            self._enqueue(lambda: self.done_events.add(event))

    def event_query(self, event: int) -> bool:
        return event in self.done_events

    def event_synchronize(self, event: int) -> None:
        if self.sync_runs:
            self.run()
            return
        deadline = time.monotonic() + 30
        while event not in self.done_events:
            assert time.monotonic() < deadline, "the emulated device never ran"
            time.sleep(0.0005)

    def host_register(self, address: int, nbytes: int) -> int:
        if self.register_code:
            return self.register_code
        self.registered.append((address, nbytes))
        return 0

    def host_unregister(self, address: int) -> None:
        self.registered = [r for r in self.registered if r[0] != address]

    def host_device_pointer(self, address: int) -> int:
        return address

    def _check_within_registration(self, entries: list[tuple[int, int, int]]) -> None:
        """As the driver does: a copy whose host side starts in one registered range and runs
        past its end is refused (seen on an H100 with CUDA 13: a batched copy spanning two
        ``cudaHostRegister`` pieces of the pool fails with cudaErrorInvalidValue)."""
        for dst, src, size in entries:
            for address in (dst, src):
                for start, nbytes in self.registered:
                    if start <= address < start + nbytes < address + size:
                        raise CudaError("memcpy", 1, "cudaErrorInvalidValue", "invalid argument")

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._maybe_fail("memcpy")
        self._check_within_registration([(dst, src, nbytes)])
        self.calls.append(("memcpy", stream, 1))
        self._enqueue(lambda: ctypes.memmove(dst, src, nbytes))

    def memcpy_batch_async(self, dsts: Any, srcs: Any, sizes: Any, attrs: Any, stream: int) -> None:
        self._maybe_fail("memcpy")
        entries = list(zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True))
        self._check_within_registration(entries)
        self.calls.append(("memcpy", stream, len(sizes)))

        def op() -> None:
            for dst, src, size in entries:
                ctypes.memmove(dst, src, size)

        self._enqueue(op)

    def memcpy_batch_raw(
        self, dsts: int, srcs: int, sizes: int, count: int, attrs: int, stream: int
    ) -> None:
        def array(address: int) -> np.ndarray:
            return np.ctypeslib.as_array((ctypes.c_uint64 * count).from_address(address))

        self.memcpy_batch_async(array(dsts), array(srcs), array(sizes), None, stream)

    def executor_functions(self) -> ExecutorFunctions:
        """C callbacks into this fake for the native executor (they take the GIL per call).
        An injected failure returns its code, as the CUDA call would; any other exception is
        kept in ``callback_errors`` (the test then fails) and returns -2."""
        vp, size, uint, c_int = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int

        def guarded(fn: Callable[..., None]) -> Callable[..., int]:
            def call(*args: Any) -> int:
                try:
                    fn(*[a or 0 for a in args])  # (a NULL pointer comes as None)
                except CudaError as exc:
                    return exc.code
                except Exception as exc:  # reported to the test
                    self.callback_errors.append(exc)
                    return -2
                return 0

            return call

        def batch(dsts: int, srcs: int, sizes: int, count: int, *rest: int) -> None:
            self.memcpy_batch_raw(dsts, srcs, sizes, count, 0, rest[-1])

        def launch(function: int, gx: int, *rest: int) -> None:
            block, stream, params = rest[2], rest[6], rest[7]
            self.launch(function, gx, block, (ctypes.c_void_p * 1).from_address(params), stream)

        callbacks = [
            ctypes.CFUNCTYPE(c_int, vp, vp, uint)(
                guarded(lambda stream, event, flags: self.stream_wait_event(stream, event))
            ),
            ctypes.CFUNCTYPE(c_int, vp, vp)(guarded(self.event_record)),
            ctypes.CFUNCTYPE(c_int, vp, vp, size, c_int, vp)(
                guarded(lambda dst, src, n, kind, stream: self.memcpy_async(dst, src, n, stream))
            ),
            ctypes.CFUNCTYPE(c_int, vp, vp, vp, size, vp, vp, size, vp)(guarded(batch)),
            ctypes.CFUNCTYPE(c_int, vp, *[uint] * 7, vp, vp, vp)(guarded(launch)),
            ctypes.CFUNCTYPE(c_int, vp)(guarded(self.stream_synchronize)),
        ]
        self._callbacks = callbacks  # alive as long as the fake
        addresses = [ctypes.cast(c, ctypes.c_void_p).value or 0 for c in callbacks]
        return ExecutorFunctions(0, *addresses)

    def launch(self, function: int, grid: int, block: int, params: Any, stream: int) -> None:
        self._maybe_fail("launch")
        capacity = function
        raw = np.frombuffer(
            ctypes.string_at(params[0], param_bytes(capacity)), dtype=np.uint8
        ).copy()
        self.calls.append(("launch", stream, grid, capacity))

        def read_region(i: int) -> tuple[int, int, int]:
            table = int(raw[:8].view(np.uint64)[0])
            row = (ctypes.c_uint64 * 3).from_address(table + 24 * i)
            return int(row[0]), int(row[1]), int(row[2])

        self._enqueue(lambda: emulate_kernel(raw, capacity, read_region, ctypes.memmove))


class EmulatedBackend(CudaCopyBackend):
    """The real backend with its device touch points pointed at ``FakeRuntime``."""

    def __init__(
        self,
        kv: Any,
        layout: Any,
        pool: Any,
        options: Any,
        *,
        fake: FakeRuntime,
        threaded: bool = False,
        **kwargs: Any,
    ) -> None:
        self.fake = fake
        options = dataclasses.replace(options, issue_thread=threaded)
        super().__init__(kv, layout, pool, options, **kwargs)

    def _make_runtime(self) -> Any:
        return self.fake

    def _make_executor(self) -> Executor:
        return Executor(self.fake.executor_functions(), False, 0)

    def _device_context(self) -> Any:
        return contextlib.nullcontext()

    def _current_stream(self) -> int:
        return COMPUTE_STREAM

    def _toolchain_missing(self) -> str:
        return ""

    def _compile_kernels(self) -> Any:
        return SimpleNamespace(functions={cap: cap for cap in KERNEL_CAPACITIES})

    def _alloc_device(self, nbytes: int) -> tuple[Any, int]:
        memory = np.full(nbytes, 0xEE, dtype=np.uint8)
        return memory, int(memory.ctypes.data)

    def _free_device(self, owner: Any) -> None:
        self.fake.freed.append(owner)

    def _upload(self, table: np.ndarray) -> tuple[Any, int]:
        copy = np.ascontiguousarray(table.copy())
        return copy, int(copy.ctypes.data)
