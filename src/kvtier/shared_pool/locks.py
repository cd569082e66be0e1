"""Locks between engines sharing a pool: open-file-description byte-range locks on the pool file.

Why these and not a mutex in the shared memory: the kernel owns them. A process that dies, by
SIGKILL or otherwise, loses its locks when its descriptors close, so a dead holder never leaves a
lock held and no robust-mutex recovery code is needed (the index's dirty flag repairs what a
holder killed inside its critical section left half done). They belong to the open file
description, not the process (unlike POSIX ``F_SETLK`` locks), so two caches in one process
exclude each other too, and closing another descriptor of the same file drops nothing.

Nothing waits without bound: ``try_lock`` never blocks, and ``Mutex.acquire`` retries it until a
deadline. An engine that is stopped (SIGSTOP) while holding the index lock makes the others give
up after ``timeout_s`` (their pins and stores are misses then), never hang.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time

_FLOCK = "hhqqi4x"  # struct flock on Linux x86-64 / aarch64: type, whence, start, len, pid
INDEX_LOCK_BYTE = 0
"""The byte locked while the index is changed."""
ENGINE_LOCK_BASE = 1
"""Byte ``ENGINE_LOCK_BASE + e`` is held by engine ``e`` for as long as it lives."""


def _flock(kind: int, start: int) -> bytes:
    return struct.pack(_FLOCK, kind, os.SEEK_SET, start, 1, 0)


def try_lock(fd: int, byte: int) -> bool:
    """Take the exclusive lock on ``byte`` of ``fd``'s file now, or return False."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, byte))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock(fd: int, byte: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, byte))


def held_by_another(fd: int, byte: int) -> bool:
    """Whether another open file description (a live process) holds a lock on ``byte``."""
    answer = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, byte))
    kind = struct.unpack(_FLOCK, answer)[0]
    return bool(kind != fcntl.F_UNLCK)


class Mutex:
    """The index lock: ``acquire`` retries ``try_lock`` with a short growing sleep until
    ``timeout_s``; False when it is still held then (the caller treats that as a miss)."""

    def __init__(self, fd: int, byte: int = INDEX_LOCK_BYTE) -> None:
        self._fd = fd
        self._byte = byte

    def acquire(self, timeout_s: float) -> bool:
        if try_lock(self._fd, self._byte):
            return True
        deadline = time.monotonic() + timeout_s
        delay = 0.00002
        while True:
            time.sleep(delay)
            if try_lock(self._fd, self._byte):
                return True
            if time.monotonic() >= deadline:
                return False
            delay = min(delay * 2, 0.001)

    def release(self) -> None:
        unlock(self._fd, self._byte)
