"""The copy backend's native executor thread (``cuda_executor.c``) and the recorder that feeds it.

The backend plans a transfer on the caller's thread and *records* its CUDA calls (stream waits,
event records, copies, launches) into a ``Program`` instead of making them; the executor's thread,
which never takes the GIL, makes them in push order. Why not a Python thread: it needs the GIL
between every two CUDA calls, and a busy engine thread hands the GIL over only every switch
interval; each hand-over stalled the engine's thread by 0.1-0.6 ms on an H100 host (two thread
wake-ups), and the Python thread got one CUDA call through per 5 ms.

The C source is compiled with the system C compiler on first use (like the copy kernel with
NVRTC) into ``$KVTIER_CACHE_DIR`` (default ``~/.cache/kvtier``), once per source version.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time
from array import array
from collections import deque
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvtier.copy.cuda_runtime import CudaError

SOURCE = Path(__file__).with_name("cuda_executor.c")
CFLAGS = ("-O2", "-shared", "-fPIC", "-pthread")
WORDS = 8
"""uint64 words per recorded op: the op code, then up to seven arguments."""

OP_WAIT, OP_RECORD, OP_MEMCPY, OP_BATCH, OP_LAUNCH, OP_SYNC = 1, 2, 3, 4, 5, 6


class ProgramState(IntEnum):
    QUEUED = 0
    DONE = 1
    FAILED = 2


class ExecutorUnavailable(RuntimeError):
    """The native executor cannot be built or started here (the reason says why)."""


class ExecutorFunctions(NamedTuple):
    """Addresses of the entry points the executor calls (``set_device`` may be 0)."""

    set_device: int
    stream_wait_event: int
    event_record: int
    memcpy_async: int
    memcpy_batch_async: int
    launch: int
    stream_synchronize: int


_ATTR_INDEX = np.zeros(1, dtype=np.uintp)
"""``attrsIdxs`` of every batched copy: one attribute set, starting at copy 0."""


_ATTR_INDEX_ADDRESS = int(_ATTR_INDEX.ctypes.data)
_ONE_WORD = np.zeros(1, dtype=np.uint64)


def _as_words(raw: np.ndarray) -> np.ndarray:
    """uint8 bytes as uint64 words, zero-padded to a multiple of 8."""
    if len(raw) % 8 == 0 and raw.flags.c_contiguous:
        return raw.view(np.uint64)
    padded = np.zeros(-(-len(raw) // 8) * 8, dtype=np.uint8)
    padded[: len(raw)] = raw
    return padded.view(np.uint64)


@dataclass(slots=True)
class Program:
    """One transfer's recorded CUDA calls, run by the executor or replayed on the caller's
    thread: the same ops, in the same order, with the same failure handling."""

    calls: list[tuple[int, tuple[Any, ...]]] = field(default_factory=list)
    """(op code, arguments as the ``CudaRuntime`` method takes them)."""
    retired_events: list[int] = field(default_factory=list)
    """Events the plan is done with: back to the pool once the program ran (before, a new
    record of a reused event could move a wait that has not been made yet)."""
    status: array[int] = field(default_factory=lambda: array("q", bytes(32)))
    """State, CUDA error code, failing op, nanoseconds taken (written by whoever runs it)."""
    ops: array[int] | None = None
    """The calls encoded for the executor (``encode``): ``WORDS`` per call."""
    blob: np.ndarray | None = None
    """What the encoded calls point at (``encode``)."""
    seq: int = 0
    settled: bool = False
    """The backend did its bookkeeping for the program having run."""

    @property
    def state(self) -> ProgramState:
        return ProgramState(int(self.status[0]))

    @property
    def error(self) -> str:
        code, index = int(self.status[1]), int(self.status[2])
        return f"error {code} in CUDA call {index} of {len(self.calls)}"

    @property
    def seconds(self) -> float:
        return float(self.status[3]) * 1e-9

    def encode(self) -> None:
        """The ops for the executor: ``WORDS`` uint64 per call. What the calls point at (copy
        lists, kernel parameters, kernelParams arrays) is copied into one array, ``blob``."""
        parts: list[np.ndarray] = []
        for code, args in self.calls:
            if code == OP_BATCH:
                parts += [a.view(np.uint64) for a in args[:3]]
            elif code == OP_LAUNCH:
                parts += [_ONE_WORD, _as_words(args[3])]  # kernelParams slot, parameters
        blob = np.concatenate(parts) if parts else None
        base = int(blob.ctypes.data) if blob is not None else 0
        starts = [0]
        for part in parts:
            starts.append(starts[-1] + len(part))
        flat: list[int] = []
        k = 0
        for code, args in self.calls:
            if code == OP_BATCH:
                dsts, srcs, sizes = (base + 8 * starts[k + i] for i in range(3))
                k += 3
                _, _, count_of, attrs, stream = args
                flat += [code, dsts, srcs, sizes, len(count_of), ctypes.addressof(attrs)]
                flat += [_ATTR_INDEX_ADDRESS, stream]
            elif code == OP_LAUNCH:
                slot, params = starts[k], starts[k + 1]
                k += 2
                assert blob is not None
                blob[slot] = base + 8 * params
                function, grid, block, _, stream = args
                flat += [code, function, grid, block, base + 8 * slot, stream, 0, 0]
            else:
                flat += [code, *args] + [0] * (WORDS - 1 - len(args))
        self.blob, self.ops = blob, array("Q", flat)

    def replay(self, rt: Any) -> None:
        """Make the calls here, on the caller's thread, as the executor would."""
        start = time.perf_counter_ns()
        state = ProgramState.DONE
        for i, (code, args) in enumerate(self.calls):
            try:
                if code == OP_LAUNCH:
                    function, grid, block, params, stream = args
                    pointers = (ctypes.c_void_p * 1)(params.ctypes.data)
                    rt.launch(function, grid, block, pointers, stream)
                else:
                    getattr(rt, _METHODS[code])(*args)
            except CudaError as exc:
                self.status[1], self.status[2] = exc.code, i
                state = ProgramState.FAILED
                for used_code, used_args in self.calls[:i]:
                    # (failing: a broken context, where nothing runs any more anyway)
                    with contextlib.suppress(CudaError):
                        rt.stream_synchronize(_stream_of(used_code, used_args))
                break
        self.status[3] = time.perf_counter_ns() - start
        self.status[0] = state


_METHODS = {
    OP_WAIT: "stream_wait_event",
    OP_RECORD: "event_record",
    OP_MEMCPY: "memcpy_async",
    OP_BATCH: "memcpy_batch_async",
    OP_LAUNCH: "launch",
    OP_SYNC: "stream_synchronize",
}


def _stream_of(code: int, args: tuple[Any, ...]) -> int:
    return int(args[0] if code in (OP_WAIT, OP_SYNC) else args[-1])


class Recorder:
    """Stands in for the ``CudaRuntime`` calls that enqueue work: records them in a program.
    Every argument is kept with the program, so nothing it points at is freed or reused before
    the program ran."""

    def __init__(self, has_batch_memcpy: bool) -> None:
        self.has_batch_memcpy = has_batch_memcpy
        self.program = Program()

    def stream_wait_event(self, stream: int, event: int) -> None:
        self.program.calls.append((OP_WAIT, (stream, event)))

    def event_record(self, event: int, stream: int) -> None:
        self.program.calls.append((OP_RECORD, (event, stream)))

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.program.calls.append((OP_MEMCPY, (dst, src, nbytes, stream)))

    def memcpy_batch_async(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, attrs: Any, stream: int
    ) -> None:
        arrays = [np.ascontiguousarray(a, dtype=np.uintp) for a in (dsts, srcs, sizes)]
        self.program.calls.append((OP_BATCH, (*arrays, attrs, stream)))

    def launch(self, function: int, grid: int, block: int, params: np.ndarray, stream: int) -> None:
        """``params``: the kernel's parameter bytes (uint8)."""
        self.program.calls.append((OP_LAUNCH, (function, grid, block, params, stream)))

    def stream_synchronize(self, stream: int) -> None:
        self.program.calls.append((OP_SYNC, (stream,)))


_LIBRARY: ctypes.CDLL | None = None
_LIBRARY_LOCK = threading.Lock()


def cache_dir() -> Path:
    configured = os.environ.get("KVTIER_CACHE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier"


def load_library() -> ctypes.CDLL:
    """The compiled executor, built on first use; raises ``ExecutorUnavailable``."""
    global _LIBRARY
    with _LIBRARY_LOCK:
        if _LIBRARY is None:
            _LIBRARY = _bind(ctypes.CDLL(str(_build())))
        return _LIBRARY


def _build() -> Path:
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + " ".join(CFLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / f"cuda_executor-{digest}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise ExecutorUnavailable("no C compiler (cc or gcc) to build the copy executor")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run(
                [compiler, *CFLAGS, "-o", str(built), str(SOURCE)],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if result.returncode != 0:
                raise ExecutorUnavailable(
                    f"{compiler} failed on {SOURCE.name}: {result.stderr.strip()[-2000:]}"
                )
            os.replace(built, target)  # atomic: another process may build the same file
    except (OSError, subprocess.SubprocessError) as exc:
        where = target.parent
        raise ExecutorUnavailable(f"cannot build the copy executor in {where}: {exc}") from exc
    return target


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.kvx_create.argtypes = [vp, ctypes.c_int, ctypes.c_int]
    lib.kvx_create.restype = vp
    lib.kvx_push.argtypes = [vp, vp, i64, vp]
    lib.kvx_push.restype = i64
    lib.kvx_executed.argtypes = [vp]
    lib.kvx_executed.restype = i64
    lib.kvx_wait.argtypes = [vp, i64, i64]
    lib.kvx_wait.restype = ctypes.c_int
    lib.kvx_close.argtypes = [vp]
    lib.kvx_close.restype = None
    return lib


class Executor:
    """One native thread running pushed programs in order (see the module docstring)."""

    def __init__(self, functions: ExecutorFunctions, batch_has_fail_idx: bool, device: int) -> None:
        self._lib = load_library()
        table = np.array(functions, dtype=np.uint64)
        handle = self._lib.kvx_create(table.ctypes.data, int(batch_has_fail_idx), device)
        if not handle:
            raise ExecutorUnavailable("the copy executor's thread could not start")
        self._handle: int | None = handle
        self._pending: deque[Program] = deque()
        """Pushed and maybe not run yet: held here, so that the thread never reads memory freed
        by a caller that dropped its programs (or the backend) early."""
        self.pushed = 0

    def push(self, program: Program) -> None:
        """Queue ``program``; sets ``program.seq``."""
        assert self._handle is not None
        program.encode()
        assert program.ops is not None
        ops, status = program.ops, program.status
        seq = self._lib.kvx_push(
            self._handle, ops.buffer_info()[0], len(ops) // WORDS, status.buffer_info()[0]
        )
        if seq < 0:
            raise ExecutorUnavailable("the copy executor is closed or out of memory")
        program.seq = int(seq)
        self.pushed = program.seq
        pending = self._pending
        pending.append(program)
        while pending and pending[0].state is not ProgramState.QUEUED:
            pending.popleft()

    def executed(self) -> int:
        """Programs run so far (their status words are final)."""
        assert self._handle is not None
        return int(self._lib.kvx_executed(self._handle))

    def wait(self, seq: int, timeout_s: float) -> bool:
        """Wait (the GIL released) until program ``seq`` ran; False on timeout."""
        assert self._handle is not None
        return bool(self._lib.kvx_wait(self._handle, seq, max(0, int(timeout_s * 1000))))

    def close(self) -> None:
        """Run what was pushed, then stop the thread. Safe to call twice."""
        if self._handle is not None:
            self._lib.kvx_close(self._handle)
            self._handle = None
            self._pending.clear()

    def __del__(self) -> None:
        if getattr(self, "_handle", None) is not None:  # (not when __init__ failed)
            self.close()  # its thread may still be reading programs only this object holds
