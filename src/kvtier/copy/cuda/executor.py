"""The copy backend's native executor thread (``executor.c``) and the recorder that feeds it.

The backend plans a transfer on the caller's thread and *records* its CUDA calls (stream waits,
event records, copies, launches) into a ``Program`` instead of making them; the executor's thread,
which never takes the GIL, makes them in push order. Why not a Python thread: it needs the GIL
between every two CUDA calls, and a busy engine thread hands the GIL over only every switch
interval; each hand-over stalled the engine's thread by 0.1-0.6 ms on an H100 host (two thread
wake-ups), and the Python thread got one CUDA call through per 5 ms.

The same C file plans staged transfers (``kvx_plan_staged``, see ``staged``). It is compiled
with the system C compiler on first use (like the copy kernel with NVRTC) into
``$KVTIER_CACHE_DIR`` (default ``~/.cache/kvtier``, created 0700), once per source version; a
cached file is loaded only when nobody else could have written it (see ``load_library``).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import stat
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

from kvtier.copy.cuda.runtime import CudaError, CudaRuntime

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("executor.c")
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


ATTR_INDEX = np.zeros(1, dtype=np.uintp)
"""``attrsIdxs`` of every batched copy: one attribute set, starting at copy 0."""
ATTR_INDEX_ADDRESS = int(ATTR_INDEX.ctypes.data)

STREAM_WORD = {OP_WAIT: 1, OP_RECORD: 2, OP_MEMCPY: 4, OP_BATCH: 7, OP_LAUNCH: 5, OP_SYNC: 1}
"""Per op code: the word holding the stream it enqueues on."""


def pointer_of(array: np.ndarray) -> int:
    return int(array.ctypes.data)


@dataclass(slots=True)
class Program:
    """One transfer's recorded CUDA calls, run by the executor or replayed on the caller's
    thread: the same ops, in the same order, with the same failure handling.

    An op is ``WORDS`` uint64 words, the op code then its arguments, as ``executor.c``
    reads them; pointers in them point into arrays ``keep`` holds."""

    parts: list[np.ndarray | array[int]] = field(default_factory=list)
    """The ops so far, in order: flat ``array("Q")`` words (one op at a time) and flat uint64
    arrays (many at once); joined once the program is run."""
    keep: list[Any] = field(default_factory=list)
    """What the ops point at (copy lists, kernel parameters): alive as long as the program."""
    retired_events: list[int] = field(default_factory=list)
    """Events the plan is done with: back to the pool once the program ran (before, a new
    record of a reused event could move a wait that has not been made yet)."""
    status: array[int] = field(default_factory=lambda: array("q", bytes(32)))
    """State, CUDA error code, failing op, nanoseconds taken (written by whoever runs it)."""
    seq: int = 0
    settled: bool = False
    """The backend did its bookkeeping for the program having run."""
    _joined: np.ndarray | array[int] | None = None

    @property
    def state(self) -> ProgramState:
        return ProgramState(int(self.status[0]))

    @property
    def error(self) -> str:
        code, index = int(self.status[1]), int(self.status[2])
        return f"error {code} in CUDA call {index} of {len(self.ops) // WORDS}"

    @property
    def seconds(self) -> float:
        return float(self.status[3]) * 1e-9

    def word_list(self) -> array[int]:
        """The open word array that single ops are appended to."""
        assert self._joined is None, "the program was already run"
        parts = self.parts
        last = parts[-1] if parts else None
        if not isinstance(last, array):
            last = array("Q")
            parts.append(last)
        return last

    def add_rows(self, rows: np.ndarray) -> None:
        """Append ``(n, WORDS)`` uint64 ops."""
        assert self._joined is None, "the program was already run"
        if len(rows):
            self.parts.append(np.ascontiguousarray(rows, dtype=np.uint64).reshape(-1))

    def _join(self) -> np.ndarray | array[int]:
        """Every op's words in one buffer (fixed from the first call on)."""
        if self._joined is None:
            parts = self.parts
            if len(parts) <= 1:
                self._joined = parts[0] if parts else array("Q")
            else:
                self._joined = np.concatenate([np.asarray(p, dtype=np.uint64) for p in parts])
            self.parts = []
        return self._joined

    @property
    def ops(self) -> np.ndarray:
        """Every op, flat: ``WORDS`` uint64 per op."""
        return np.asarray(self._join(), dtype=np.uint64)

    def buffer(self) -> tuple[int, int]:
        """Where the encoded ops are and how many (what the executor reads)."""
        joined = self._join()
        if isinstance(joined, array):
            address, words = joined.buffer_info()
        else:
            address, words = pointer_of(joined), len(joined)
        return address, words // WORDS

    def rows(self) -> list[list[int]]:
        return self.ops.reshape(-1, WORDS).tolist()

    def replay(self, rt: Any) -> None:
        """Make the calls here, on the caller's thread, as the executor would."""
        start = time.perf_counter_ns()
        state = ProgramState.DONE
        rows = self.rows()
        for i, op in enumerate(rows):
            try:
                _call(rt, op)
            except CudaError as exc:
                self.status[1], self.status[2] = exc.code, i
                state = ProgramState.FAILED
                for used in rows[:i]:
                    # (failing: a broken context, where nothing runs any more anyway)
                    with contextlib.suppress(CudaError):
                        rt.stream_synchronize(used[STREAM_WORD[used[0]]])
                break
        self.status[3] = time.perf_counter_ns() - start
        self.status[0] = state


def _call(rt: Any, op: list[int]) -> None:
    """One encoded op as a ``CudaRuntime`` call."""
    code = op[0]
    if code == OP_WAIT:
        rt.stream_wait_event(op[1], op[2])
    elif code == OP_RECORD:
        rt.event_record(op[1], op[2])
    elif code == OP_MEMCPY:
        rt.memcpy_async(op[1], op[2], op[3], op[4])
    elif code == OP_BATCH:
        rt.memcpy_batch_raw(op[1], op[2], op[3], op[4], op[5], op[7])
    elif code == OP_LAUNCH:
        rt.launch(op[1], op[2], op[3], (ctypes.c_void_p * 1).from_address(op[4]), op[5])
    elif code == OP_SYNC:
        rt.stream_synchronize(op[1])
    else:
        raise ValueError(f"unknown op code {code}")


class Recorder:
    """Stands in for the ``CudaRuntime`` calls that enqueue work: records them in a program.
    Every array a call points at is kept with the program, so nothing is freed or reused
    before the program ran."""

    def __init__(self, has_batch_memcpy: bool) -> None:
        self.has_batch_memcpy = has_batch_memcpy
        self.program = Program()

    def stream_wait_event(self, stream: int, event: int) -> None:
        self.program.word_list().extend((OP_WAIT, stream, event, 0, 0, 0, 0, 0))

    def event_record(self, event: int, stream: int) -> None:
        self.program.word_list().extend((OP_RECORD, event, stream, 0, 0, 0, 0, 0))

    def memcpy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self.program.word_list().extend((OP_MEMCPY, dst, src, nbytes, stream, 0, 0, 0))

    def memcpy_batch_async(
        self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, attrs: Any, stream: int
    ) -> None:
        arrays = [np.ascontiguousarray(a, dtype=np.uintp) for a in (dsts, srcs, sizes)]
        self.program.keep += (*arrays, attrs)
        pointers = [pointer_of(a) for a in arrays]
        words = (OP_BATCH, *pointers, len(arrays[2]), ctypes.addressof(attrs))
        self.program.word_list().extend((*words, ATTR_INDEX_ADDRESS, stream))

    def launch(self, function: int, grid: int, block: int, params: np.ndarray, stream: int) -> None:
        """``params``: the kernel's parameter bytes (a contiguous uint8 array)."""
        slot = array("Q", [pointer_of(params)])  # kernelParams: one pointer
        self.program.keep += (params, slot)
        words = (OP_LAUNCH, function, grid, block, slot.buffer_info()[0], stream, 0, 0)
        self.program.word_list().extend(words)

    def add_rows(self, rows: np.ndarray, *keep: Any) -> None:
        """Ops encoded elsewhere (``(n, WORDS)`` uint64), and what they point at."""
        self.program.keep += keep
        self.program.add_rows(rows)

    def stream_synchronize(self, stream: int) -> None:
        self.program.word_list().extend((OP_SYNC, stream, 0, 0, 0, 0, 0, 0))


_LIBRARY: ctypes.CDLL | None = None
_LIBRARY_LOCK = threading.Lock()


def cache_dir() -> Path:
    configured = os.environ.get("KVTIER_CACHE_DIR")
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvtier"


def library_name() -> str:
    """The file name of the executor built from this source with these flags."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(CFLAGS).encode()).hexdigest()[:16]
    return f"cuda_executor-{digest}.so"


def load_library() -> ctypes.CDLL:
    """The compiled executor, built on first use; raises ``ExecutorUnavailable``.

    Loading a shared library runs its code, so only a file nobody else can have written is
    loaded: a regular file (not followed through a symlink) owned by this user and not group- or
    world-writable, in a directory that is the same. A cached file failing that is rebuilt in
    place; a cache directory failing it is not used (the executor is built into a private
    temporary directory instead, with a warning naming the directory)."""
    global _LIBRARY
    with _LIBRARY_LOCK:
        if _LIBRARY is None:
            _LIBRARY = _bind(_load_trusted())
        return _LIBRARY


def _private_problem(st: os.stat_result, kind: str) -> str:
    """Why a file or directory with this ``lstat`` could have been written by someone else
    ('' if it could not)."""
    is_kind = stat.S_ISDIR(st.st_mode) if kind == "directory" else stat.S_ISREG(st.st_mode)
    if not is_kind:
        return f"not a {kind}" + (" (a symlink)" if stat.S_ISLNK(st.st_mode) else "")
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not {os.geteuid()}"
    if st.st_mode & 0o022:
        return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
    return ""


def _private_cache_dir() -> Path | None:
    """The cache directory (created 0700 where missing) if it is private, else None."""
    directory = cache_dir()
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = _private_problem(os.lstat(directory), "directory")
    except OSError as exc:
        problem = str(exc)
    if problem:
        log.warning(
            "copy executor cache %s not used: %s; building into a private temporary directory",
            directory,
            problem,
        )
        return None
    return directory


def _open_private(path: Path) -> int | None:
    """An open descriptor of ``path`` if it is a private regular file, else None (logged)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symlink
        log.warning("copy executor %s not loaded: %s; building it anew", path, exc)
        return None
    problem = _private_problem(os.fstat(fd), "file")
    if problem:
        os.close(fd)
        log.warning("copy executor %s not loaded: %s; building it anew", path, problem)
        return None
    return fd


def _load_trusted() -> ctypes.CDLL:
    """The private, built executor, loaded (see ``load_library``)."""
    name = library_name()
    directory = _private_cache_dir()
    if directory is not None:
        return _load_private(directory / name, rebuild=True)
    with tempfile.TemporaryDirectory(prefix="kvtier-cache-") as private:  # mode 0700
        return _load_private(Path(private) / name, rebuild=True)  # (loaded before it goes)


def _load_private(path: Path, rebuild: bool) -> ctypes.CDLL:
    """Load ``path`` if it is a private file, (re)building it first where it is not. Its
    directory is private, so nobody else can swap the checked file before it is loaded."""
    fd = _open_private(path)
    if fd is None:
        if not rebuild:
            raise ExecutorUnavailable(f"the copy executor built at {path} is not private")
        _build(path)
        return _load_private(path, rebuild=False)
    try:
        return ctypes.CDLL(str(path))
    except OSError as exc:
        raise ExecutorUnavailable(f"cannot load the copy executor {path}: {exc}") from exc
    finally:
        os.close(fd)


def _build(target: Path) -> None:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise ExecutorUnavailable("no C compiler (cc or gcc) to build the copy executor")
    try:
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
            built.chmod(0o755)  # whatever the umask: never group- or world-writable
            # Atomic, and replaces a symlink or a foreign file itself rather than its target;
            # another process may build the same file at the same time.
            os.replace(built, target)
    except (OSError, subprocess.SubprocessError) as exc:
        where = target.parent
        raise ExecutorUnavailable(f"cannot build the copy executor in {where}: {exc}") from exc


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
    lib.kvx_plan_staged.argtypes = [vp]
    lib.kvx_plan_staged.restype = i64
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
        ops, count = program.buffer()
        seq = self._lib.kvx_push(self._handle, ops, count, program.status.buffer_info()[0])
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


def executor_functions(rt: CudaRuntime) -> ExecutorFunctions:
    """The runtime's entry points the native executor calls, as addresses."""

    def address(fn: Any) -> int:
        return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)

    batch = rt.batch_entry_point
    return ExecutorFunctions(
        address(rt.cudaSetDevice),
        address(rt.cudaStreamWaitEvent),
        address(rt.cudaEventRecord),
        address(rt.cudaMemcpyAsync),
        address(batch) if batch is not None else 0,
        address(rt.cuLaunchKernel),
        address(rt.cudaStreamSynchronize),
    )
