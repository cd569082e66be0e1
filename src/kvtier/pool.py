"""The host pool: one shared-memory region cut into equal slots.

The scheduler-side process creates the pool and owns slot allocation; engine workers and tier I/O
threads attach by name and read or write slots in place (memoryview / numpy views, no copies).

The region is a file in ``/dev/shm`` mapped with ``mmap`` (not ``multiprocessing.shared_memory``,
whose resource tracker in Python 3.11 unlinks a region when any attaching process exits). The owner
holds an exclusive ``flock`` on the file for its lifetime, so a later process can tell a region left
by a crashed owner (lock free) from a live one (lock held) and remove only the former.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.errors import PoolError

DEFAULT_SHM_DIR = "/dev/shm"
NAME_PREFIX = "kvtier-pool-"
SLOT_ALIGN = 256


@dataclass(frozen=True, slots=True)
class PoolHandle:
    """What another process needs to attach to a pool (picklable, JSON-able)."""

    path: str
    num_slots: int
    slot_bytes: int
    slot_stride: int


def _reserve(fd: int, size: int, shm_dir: str) -> None:
    """Allocate the pool's memory now. A tmpfs file is sparse: a page first touched when the
    tmpfs has filled up meanwhile kills the process with SIGBUS, so the pool claims all of it at
    creation (a clear error instead), and pinning it later for DMA finds every page present."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return  # a filesystem without fallocate: the pages come on first touch
        raise PoolError(
            f"cannot reserve {size} bytes for the host pool in {shm_dir}: {exc.strerror}; "
            "lower pool.size or enlarge the tmpfs"
        ) from exc


class HostPool:
    """Fixed-size shared memory cut into ``num_slots`` slots of ``slot_bytes`` each.

    ``alloc`` and ``free`` are O(1) per slot and only valid in the owning process. ``view`` and
    ``array`` work in every process that created or attached the pool.
    """

    def __init__(self, handle: PoolHandle, fd: int, owner: bool) -> None:
        self.handle = handle
        self.num_slots = handle.num_slots
        self.slot_bytes = handle.slot_bytes
        self.slot_stride = handle.slot_stride
        self._fd = fd
        self._owner = owner
        self._closed = False
        size = handle.slot_stride * handle.num_slots
        self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        self._buffer = memoryview(self._mmap)
        # Pop from the end; reversed so a fresh pool hands out slot 0 first (easier to debug).
        self._free: list[int] = list(range(handle.num_slots - 1, -1, -1)) if owner else []

    # -- creation -------------------------------------------------------------------------------

    @classmethod
    def create(cls, num_slots: int, slot_bytes: int, shm_dir: str = DEFAULT_SHM_DIR) -> HostPool:
        if num_slots <= 0 or slot_bytes <= 0:
            raise PoolError(f"pool needs slots and slot bytes > 0, got {num_slots} x {slot_bytes}")
        cleanup_stale_pools(shm_dir)
        stride = -(-slot_bytes // SLOT_ALIGN) * SLOT_ALIGN
        size = stride * num_slots
        directory = Path(shm_dir)
        try:
            free_bytes = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
        except OSError as exc:
            raise PoolError(f"shared-memory directory {shm_dir!r} is not usable: {exc}") from exc
        if size > free_bytes:
            raise PoolError(
                f"host pool of {size} bytes does not fit in {shm_dir} ({free_bytes} bytes free); "
                "lower pool.size or enlarge the tmpfs"
            )
        path = directory / f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, size)
            _reserve(fd, size, shm_dir)
            return cls(PoolHandle(str(path), num_slots, slot_bytes, stride), fd, owner=True)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise

    @classmethod
    def attach(cls, handle: PoolHandle) -> HostPool:
        try:
            fd = os.open(handle.path, os.O_RDWR)
        except OSError as exc:
            raise PoolError(f"cannot attach host pool {handle.path!r}: {exc}") from exc
        if os.fstat(fd).st_size < handle.slot_stride * handle.num_slots:
            os.close(fd)
            raise PoolError(f"host pool {handle.path!r} is smaller than its handle says")
        return cls(handle, fd, owner=False)

    # -- slots ----------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Up to ``n`` free slots (fewer when the pool has fewer free)."""
        free = self._free
        take = min(n, len(free))
        if take == 0:
            return []
        slots = free[-take:]
        del free[-take:]
        return slots

    def free(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def free_slots(self) -> list[int]:
        """A copy of the free list (for invariant checks; a slot freed twice appears twice)."""
        return list(self._free)

    def view(self, slot: int) -> memoryview:
        """Writable view of one slot's ``slot_bytes`` bytes."""
        start = slot * self.slot_stride
        return self._buffer[start : start + self.slot_bytes]

    def array(self) -> np.ndarray:
        """The whole pool as a ``(num_slots, slot_stride)`` uint8 array (a view, not a copy)."""
        return np.frombuffer(self._buffer, dtype=np.uint8).reshape(self.num_slots, self.slot_stride)

    # -- lifetime -------------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap; the owner also removes the region. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(BufferError):
            # Views handed out (numpy arrays, tensors) keep the mapping alive until collected.
            self._buffer.release()
            self._mmap.close()
        if self._owner:
            Path(self.handle.path).unlink(missing_ok=True)
        os.close(self._fd)

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cleanup_stale_pools(shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Remove pool files whose owner died without cleaning up; returns the removed paths."""
    removed: list[str] = []
    try:
        entries = list(Path(shm_dir).glob(f"{NAME_PREFIX}*"))
    except OSError:
        return removed
    for path in entries:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live owner holds the lock
            continue
        try:
            path.unlink(missing_ok=True)
            removed.append(str(path))
        finally:
            os.close(fd)
    return removed
