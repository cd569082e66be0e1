"""The host pool: one shared-memory region cut into equal slots.

The scheduler-side process creates the pool and owns slot allocation; engine workers and tier I/O
threads attach by name and read or write slots in place (memoryview / numpy views, no copies).

The region is a file in ``/dev/shm`` mapped with ``mmap`` (not ``multiprocessing.shared_memory``,
whose resource tracker in Python 3.11 unlinks a region when any attaching process exits). Every
process using it (the owner and each attached one) holds a shared ``flock`` on the file for as long
as it has it open, so a region nobody uses any more (lock free) can be told from a live one (lock
held) and removed: at once by its reaper (``kvtier.pool_reaper``: waits for the exclusive lock,
then unlinks; SIGKILL of every user included), or by the sweep at a later start when the reaper was
killed too.

The shm directory is writable by every local user, so nothing found there is trusted:

* a new region is created unnamed (``O_TMPFILE``), locked, and only then linked under its name, so
  no other process ever sees a pool file whose lock is not held yet (a sweep running at that moment
  would take the lock and delete a live pool);
* the sweep of stale regions looks only at regular files owned by this user, opens them with
  ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO or symlink planted under a pool name is never opened), and
  never fails pool creation: whatever it cannot inspect or remove it leaves alone.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvtier.errors import PoolError
from kvtier.pool_reaper import Reaper

log = logging.getLogger(__name__)

DEFAULT_SHM_DIR = "/dev/shm"
NAME_PREFIX = "kvtier-pool-"
SLOT_ALIGN = 256


def slot_stride(slot_bytes: int) -> int:
    """Bytes one slot of ``slot_bytes`` takes in the region (rounded up to ``SLOT_ALIGN``): what
    a pool size is divided by, so that the region never exceeds it."""
    return -(-slot_bytes // SLOT_ALIGN) * SLOT_ALIGN


class ShmDirError(PoolError):
    """The shared-memory directory itself is unusable (missing, not a directory, not writable):
    a configuration problem, reported by the factory as a ``ConfigError`` on ``pool.shm_dir``."""


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

    def __init__(
        self, handle: PoolHandle, fd: int, owner: bool, reaper: Reaper | None = None
    ) -> None:
        self.handle = handle
        self.num_slots = handle.num_slots
        self.slot_bytes = handle.slot_bytes
        self.slot_stride = handle.slot_stride
        self._fd = fd
        self._owner = owner
        self._reaper = reaper
        self.last_out_unlinks = False
        """Set by a pool several engines attach by name (``kvtier.shared_pool``): whoever closes
        it last removes the file (the owner of a private pool removes it at its close)."""
        self._closed = False
        size = handle.slot_stride * handle.num_slots
        self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        self._buffer = memoryview(self._mmap)
        # Pop from the end; reversed so a fresh pool hands out slot 0 first (easier to debug).
        self._free: list[int] = list(range(handle.num_slots - 1, -1, -1)) if owner else []

    # -- creation -------------------------------------------------------------------------------

    @classmethod
    def create(
        cls, num_slots: int, slot_bytes: int, shm_dir: str = DEFAULT_SHM_DIR, reap: bool = True
    ) -> HostPool:
        """A new pool in ``shm_dir``; ``ShmDirError`` when that directory is unusable. ``reap``
        starts its reaper (the file goes when its last user dies; ``kvtier.pool_reaper``)."""
        if num_slots <= 0 or slot_bytes <= 0:
            raise PoolError(f"pool needs slots and slot bytes > 0, got {num_slots} x {slot_bytes}")
        stride = slot_stride(slot_bytes)
        dir_fd = _open_dir(shm_dir)
        try:
            cleanup_stale_pools(shm_dir)
            _check_room(dir_fd, stride * num_slots, shm_dir)
            name = f"{NAME_PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
            fd = _new_locked_region(dir_fd, name, stride * num_slots, shm_dir)
        finally:
            os.close(dir_fd)
        path = str(Path(shm_dir) / name)
        try:
            reaper = Reaper.start(path, fd) if reap else None
            return cls(PoolHandle(path, num_slots, slot_bytes, stride), fd, True, reaper)
        except BaseException:
            os.close(fd)
            Path(path).unlink(missing_ok=True)
            raise

    @classmethod
    def attach(cls, handle: PoolHandle) -> HostPool:
        try:
            # Never blocks or follows a link: whatever sits under that name now is checked first.
            fd = os.open(handle.path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            raise PoolError(f"cannot attach host pool {handle.path!r}: {exc}") from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise PoolError(f"host pool {handle.path!r} is not a regular file")
        if st.st_size < handle.slot_stride * handle.num_slots:
            os.close(fd)
            raise PoolError(f"host pool {handle.path!r} is smaller than its handle says")
        try:
            hold_shared(fd, handle.path)
        except BaseException:
            os.close(fd)
            raise
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
        removed = self._owner
        if self._owner:
            Path(self.handle.path).unlink(missing_ok=True)
        elif self.last_out_unlinks:
            removed = unlink_if_last(self._fd, self.handle.path)
        os.close(self._fd)
        if self._reaper is not None:
            # Others still hold the file: the reaper stays and removes it after the last of
            # them, which may be a user in this very process (vLLM's worker attaches the pool its
            # scheduler opened; a mapping CUDA still has registered keeps its lock past close)
            # or one that never closes (killed, or its close failed).
            if removed:
                self._reaper.stop()
            else:
                self._reaper.leave()

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def hold_shared(fd: int, path: str) -> None:
    """Take the shared lock every user of a pool holds; ``PoolError`` when the file is being
    removed (its reaper or a sweep holds the exclusive lock) or ``path`` names another file now."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        raise PoolError(f"host pool {path!r} is being removed (its last user is gone)") from exc
    st = os.fstat(fd)
    try:
        now = os.lstat(path)
    except OSError as exc:
        raise PoolError(f"host pool {path!r} was removed: {exc.strerror}") from exc
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        raise PoolError(f"host pool {path!r} was removed (the name is another file's now)")


def unlink_if_last(fd: int, path: str) -> bool:
    """Remove ``path`` if this process is the last user of the file open as ``fd`` (its shared
    lock converts to the exclusive one at once) and the name still names that file."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # others still use it: the last of them (or a reaper) removes it
    st = os.fstat(fd)
    try:
        now = os.lstat(path)
    except OSError:
        return False
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
        return False
    os.unlink(path)
    return True


def _open_dir(shm_dir: str) -> int:
    try:
        return os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        reason = "not a directory" if exc.errno == errno.ENOTDIR else exc.strerror
        raise ShmDirError(f"shared-memory directory {shm_dir!r} is not usable: {reason}") from exc


def _new_region(
    dir_fd: int, name: str, shm_dir: str
) -> tuple[int, Callable[[int], None], Callable[[], None]]:
    """An open, still invisible file for a region, the function that gives it ``name`` and the
    one that removes what is left when the region is not made after all.

    ``O_TMPFILE`` (tmpfs and most local filesystems): the file has no name until linked. Without
    it, a hidden scratch name the sweep never touches, hard-linked to ``name`` once locked (the
    lock belongs to the inode, so it holds under the new name)."""
    flags = os.O_RDWR | os.O_CLOEXEC
    try:
        fd = os.open(".", flags | os.O_TMPFILE, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
            raise _unusable(shm_dir, exc) from exc
    else:

        def link_unnamed(fd: int) -> None:
            # linkat(AT_SYMLINK_FOLLOW) of /proc/self/fd/N names an O_TMPFILE file; EEXIST if
            # the name is taken (it never replaces anything).
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd, follow_symlinks=True)

        return fd, link_unnamed, lambda: None
    scratch = f".{name}.new"
    try:
        fd = os.open(scratch, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        raise _unusable(shm_dir, exc) from exc

    def link_scratch(fd: int) -> None:
        try:
            os.link(scratch, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        finally:
            os.unlink(scratch, dir_fd=dir_fd)

    def discard() -> None:
        with contextlib.suppress(OSError):
            os.unlink(scratch, dir_fd=dir_fd)

    return fd, link_scratch, discard


def _check_room(dir_fd: int, size: int, shm_dir: str) -> None:
    try:
        st = os.fstatvfs(dir_fd)
    except OSError as exc:
        raise ShmDirError(f"shared-memory directory {shm_dir!r} is not usable: {exc}") from exc
    free_bytes = st.f_bavail * st.f_frsize
    if size > free_bytes:
        raise PoolError(
            f"host pool of {size} bytes does not fit in {shm_dir} ({free_bytes} bytes free); "
            "lower pool.size or enlarge the tmpfs"
        )


def _new_locked_region(dir_fd: int, name: str, size: int, shm_dir: str) -> int:
    """The open file of a new region, locked and sized before it gets ``name``: the shared lock
    every user holds (on a file nobody else can see yet it is as good as exclusive)."""
    fd, publish, discard = _new_region(dir_fd, name, shm_dir)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        os.ftruncate(fd, size)
        _reserve(fd, size, shm_dir)
        publish(fd)
    except BaseException:
        os.close(fd)
        discard()
        raise
    return fd


def _unusable(shm_dir: str, exc: OSError) -> PoolError:
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return ShmDirError(f"cannot create the host pool in {shm_dir!r}: {exc.strerror}")
    return PoolError(f"cannot create the host pool in {shm_dir!r}: {exc}")


def cleanup_stale_pools(shm_dir: str = DEFAULT_SHM_DIR) -> list[str]:
    """Remove pool files whose owner died without cleaning up; returns the removed paths.

    Never raises and never blocks: only regular files owned by this user whose lock can be taken
    at once are removed (see the module docstring); everything else is left alone."""
    removed: list[str] = []
    try:
        dir_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return removed
    try:
        names = [n for n in os.listdir(dir_fd) if n.startswith(NAME_PREFIX)]
        for name in names:
            try:
                if _remove_if_stale(dir_fd, name):
                    removed.append(str(Path(shm_dir) / name))
            except OSError as exc:  # e.g. a file another user planted: not ours to remove
                log.debug("left %s in %s alone: %s", name, shm_dir, exc)
    except OSError as exc:
        log.debug("cannot sweep %s for stale pools: %s", shm_dir, exc)
    finally:
        os.close(dir_fd)
    return removed


def _owned_regular(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def _remove_if_stale(dir_fd: int, name: str) -> bool:
    if not _owned_regular(os.lstat(name, dir_fd=dir_fd)):
        return False  # FIFOs, symlinks, directories, other users' files: never opened
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    fd = os.open(name, flags, dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not _owned_regular(st):
            return False  # swapped between lstat and open
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a live owner holds the lock
        now = os.lstat(name, dir_fd=dir_fd)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return False  # the name points elsewhere now
        os.unlink(name, dir_fd=dir_fd)
        return True
    finally:
        os.close(fd)
