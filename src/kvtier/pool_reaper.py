"""The reaper: removes a pool's shm file once the last process using it is gone, however it ended.

Every process that maps a pool holds a shared ``flock`` on its file (the creator, the engine's
tensor-parallel workers, every engine attached to a shared pool). The kernel drops a process's
locks when its descriptors close, which happens on any exit: ``SIGKILL`` and a crash included. The
reaper is a small detached process that opens the file and asks for the exclusive lock; it is
granted only when no shared lock is left, i.e. when the last user is gone, and the reaper then
unlinks the name (if it still names the same file) and exits. The tmpfs frees the pages when the
name and the last mapping are gone, so the memory comes back without waiting for a later start.

Why a process and not an unlinked file: engines and workers find a pool by its name (a worker is
started by the engine and attaches later, a second engine attaches to a shared pool by name), so
the name must exist while the pool is in use. Why a separate process: nothing inside the dying
process runs after ``SIGKILL``. It is started in its own session, so the terminal's Ctrl-C (which
reaches the engine's whole process group) does not stop it; it runs stdlib code only (``-I -S``:
no site packages, no environment), holds no mapping, and is never on the data path: it only
waits in ``flock``. A clean ``close`` that removes the file stops its reaper; one that leaves
other users (another engine, or this engine's worker) leaves it running until the file is gone.
If the reaper is killed, the sweep at the next pool creation (``pool.cleanup_stale_pools``)
remains the fallback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)

REAPER_CODE = """
import fcntl, os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
path, dev, ino = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
except OSError:
    sys.exit(0)
st = os.fstat(fd)
if (st.st_dev, st.st_ino) != (dev, ino):
    sys.exit(0)
fcntl.flock(fd, fcntl.LOCK_EX)
try:
    now = os.lstat(path)
except OSError:
    sys.exit(0)
if (now.st_dev, now.st_ino) == (dev, ino):
    os.unlink(path)
"""


class Reaper:
    """The reaper process of one pool file, started by ``start`` and stopped by ``stop``."""

    def __init__(self, process: subprocess.Popen[bytes] | None) -> None:
        self._process = process

    @classmethod
    def start(cls, path: str, fd: int) -> Reaper:
        """A reaper for the file ``path`` open as ``fd``. Never fails the pool: without a reaper
        (no interpreter to start, no processes left) the file is swept at a later start."""
        st = os.fstat(fd)
        argv = [sys.executable, "-I", "-S", "-c", REAPER_CODE, path, str(st.st_dev)]
        try:
            process = subprocess.Popen(
                [*argv, str(st.st_ino)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        except OSError as exc:
            log.warning("no reaper for %s (%s): it stays if every user is killed", path, exc)
            return cls(None)
        return cls(process)

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def leave(self) -> None:
        """Let the reaper run on without this handle: it exits once the file is gone."""
        self._process = None

    def stop(self) -> None:
        """End the reaper (after a clean close did its work) and collect it."""
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5.0)
