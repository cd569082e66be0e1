"""``BlockFiles`` whose block writes and reads run in helper processes (``io_process: true``).

``HelperFiles`` is the fs tier's ``BlockFiles`` with ``write`` and ``read`` of pool slots sent to
one of ``count`` helper processes (``io_helper.py``), one per I/O thread, each borrowed for one
block; everything else (removing files, scans) stays in this process. A buffer that is not a
whole pool slot is written here, as without helpers.

Failures are the block's, never the engine's:

* A helper that died (killed, out of memory) fails the block in flight with ``EIO``; the next
  block starts a new one. A start that fails fails its block, and no new start is tried for
  ``RESTART_AFTER_S``.
* A helper that does not answer within ``timeout_s`` (the tier's ``io_timeout_s``: a hung NFS
  server) is killed and its block fails with ``ETIMEDOUT``, but only once the process is gone:
  until then it may still write the block's pool slot, which must not be handed out again. A
  helper that cannot die (a call stuck in the kernel) keeps its thread waiting, which the tier
  counts as a stuck thread, as it would count the thread itself stuck in that call.
* ``close`` closes the idle helpers' sockets (a helper exits when it sees that; killed if still
  there after ``CLOSE_WAIT_S``) and kills those a thread still uses; a block asked for later
  fails at once.
"""

from __future__ import annotations

import contextlib
import errno
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

import kvtier
from kvtier.keys import BlockKey
from kvtier.pool import HostPool
from kvtier.tiers.fs import io_helper
from kvtier.tiers.fs.files import BlockFiles, Read

START_S = 30.0
"""How long a helper may take to start (an interpreter, numpy, the pool attached)."""
RESTART_AFTER_S = 1.0
CLOSE_WAIT_S = 1.0
_READS = {read.value: read for read in Read}
_ENTRY = f"import sys; from {io_helper.__name__} import main; sys.exit(main(sys.argv[1:]))"
"""The helper's start (not ``-m``: this package imports the module before running it)."""


@dataclass(frozen=True, slots=True)
class Spawn:
    """What a helper process is started with."""

    root_fd: int
    pool: HostPool
    file_mode: int
    dir_mode: int
    fsync: bool

    def command(self, socket_fd: int) -> list[str]:
        handle = self.pool.handle
        return [
            sys.executable, "-c", _ENTRY,
            "--root-fd", str(self.root_fd), "--socket-fd", str(socket_fd),
            "--pool", handle.path, "--slots", str(handle.num_slots),
            "--slot-bytes", str(handle.slot_bytes), "--slot-stride", str(handle.slot_stride),
            "--file-mode", str(self.file_mode), "--dir-mode", str(self.dir_mode),
            *(["--fsync"] if self.fsync else []),
        ]  # fmt: skip


def _environment() -> dict[str, str]:
    """This environment, with kvtier's own directory first on the helper's import path (an
    engine may have found kvtier through a path the helper's interpreter would not search)."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.abspath(kvtier.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    return env


class Helper:
    """One helper process and its socket; used by one thread at a time."""

    def __init__(self, spawn: Spawn) -> None:
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                spawn.command(theirs.fileno()),
                pass_fds=(spawn.root_fd, theirs.fileno()),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                env=_environment(),
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.conn = Connection(ours.detach())
        try:
            ready = self.conn.poll(START_S) and self.conn.recv_bytes() == io_helper.READY
        except (EOFError, OSError):
            ready = False
        if not ready:
            self.stop()
            raise OSError(errno.EIO, f"the fs tier's I/O helper did not start (exit {self.code})")

    @property
    def code(self) -> int | None:
        return self.process.poll()

    def call(self, message: bytes, timeout_s: float) -> bytes:
        """The helper's answer to ``message``; OSError when it died or did not answer in time
        (then it is gone: killed and reaped)."""
        try:
            self.conn.send_bytes(message)
            if self.conn.poll(timeout_s):
                return self.conn.recv_bytes()
        except (EOFError, OSError):
            self.stop()
            raise OSError(errno.EIO, f"the fs tier's I/O helper exited ({self.code})") from None
        self.stop()
        raise OSError(errno.ETIMEDOUT, f"the fs tier's I/O helper took over {timeout_s:g} s")

    def stop(self, wait: bool = True) -> None:
        """Kill the process and, with ``wait``, reap it (see the module docstring)."""
        with contextlib.suppress(OSError):
            self.conn.close()
        with contextlib.suppress(OSError):
            self.process.kill()
        if wait:
            self.process.wait()

    def close(self) -> None:
        """Close the socket; the helper exits. Killed when it is still there after a while
        (not waited for: ``close`` must return)."""
        with contextlib.suppress(OSError):
            self.conn.close()
        try:
            self.process.wait(CLOSE_WAIT_S)
        except subprocess.TimeoutExpired:
            self.stop(wait=False)


class HelperFiles(BlockFiles):
    """See the module docstring."""

    def __init__(
        self,
        root_fd: int,
        file_mode: int,
        dir_mode: int,
        fsync: bool,
        pool: HostPool,
        count: int,
        timeout_s: float,
    ) -> None:
        super().__init__(root_fd, file_mode, dir_mode, fsync)
        self.pool = pool
        self.timeout_s = timeout_s
        self._spawn = Spawn(root_fd, pool, file_mode, dir_mode, fsync)
        self._idle: queue.SimpleQueue[Helper | None] = queue.SimpleQueue()
        self._all: list[Helper] = []
        self._lock = threading.Lock()
        self._closed = False
        self._next_start = 0.0
        self.started = 0
        """Helper processes started so far (the first ``count`` and every restart)."""
        try:
            for _ in range(count):
                self._idle.put(self._start())
        except BaseException:
            self.close()
            raise

    def write(self, key: BlockKey, buffers: list[memoryview]) -> None:
        header, payload = buffers
        slot = self.pool.slot_of(payload)
        if slot is None:
            super().write(key, buffers)
            return
        reply = self._call(io_helper.write_request(slot, key, bytes(header)))
        status, error = io_helper.ANSWER.unpack_from(reply)
        if status != io_helper.WRITTEN:
            message = reply[io_helper.ANSWER.size :].decode(errors="replace")
            raise OSError(error or errno.EIO, message)

    def read(self, key: BlockKey, buffers: list[memoryview], size: int) -> Read:
        header, payload = buffers
        slot = self.pool.slot_of(payload)
        if slot is None:
            return super().read(key, buffers, size)
        try:
            reply = self._call(io_helper.read_request(slot, key))
        except OSError:
            return Read.FAILED
        status, _ = io_helper.ANSWER.unpack_from(reply)
        read = _READS.get(status, Read.FAILED)
        if read is Read.FOUND:
            found = reply[io_helper.ANSWER.size :]
            if len(found) != len(header):
                return Read.FAILED
            header[:] = found
        return read

    def _call(self, message: bytes) -> bytes:
        with self._borrowed() as helper:
            return helper.call(message, self.timeout_s)

    @contextlib.contextmanager
    def _borrowed(self) -> Iterator[Helper]:
        """An idle helper (a new one in place of one that died), given back after use."""
        helper = self._idle.get()
        try:
            if helper is None or helper.code is not None:
                helper = self._restart()
            yield helper
        finally:
            self._idle.put(helper if helper is None or helper.code is None else None)

    def _restart(self) -> Helper:
        with self._lock:
            if self._closed:
                raise OSError(errno.EIO, "the fs tier is closed")
            if time.monotonic() < self._next_start:
                raise OSError(errno.EIO, "the fs tier's I/O helper failed to start; retried soon")
        try:
            return self._start()
        except OSError:
            with self._lock:
                self._next_start = time.monotonic() + RESTART_AFTER_S
            raise

    def _start(self) -> Helper:
        helper = Helper(self._spawn)
        with self._lock:
            self._all = [h for h in self._all if h.code is None]  # the dead are reaped
            self._all.append(helper)
            self.started += 1
            if not self._closed:
                return helper
        helper.close()
        raise OSError(errno.EIO, "the fs tier is closed")

    def close(self) -> None:
        """End the idle helpers (their sockets closed: they exit) and kill the ones a thread
        still uses (a stuck one): that thread sees the helper gone and closes its socket itself,
        which no other thread may do while it waits on it."""
        with self._lock:
            self._closed = True
            helpers, self._all = self._all, []
        idle: list[Helper] = []
        with contextlib.suppress(queue.Empty):
            while True:
                helper = self._idle.get_nowait()
                if helper is not None:
                    idle.append(helper)
        for _ in range(max(1, len(helpers))):
            self._idle.put(None)  # a late borrower gets the closed tier's error, never a wait
        for helper in idle:
            helper.close()
        for helper in helpers:
            if not any(helper is other for other in idle):
                with contextlib.suppress(OSError):
                    helper.process.kill()
