"""Create or attach the file of a shared pool: its slots, its index, and a trailer saying how big.

One file per share name and namespace (``segment_name``): engines of another model, dtype,
geometry, layout, TP size or tenant get another file, so their blocks never meet. The file is
built complete (index initialised, trailer written) before it gets its name, like a private pool
(``pool._new_region``): an engine that finds the name finds a usable pool. Two engines creating
it at once both build one; the second to link it gets ``EEXIST``, drops its own and attaches.
Every engine holds the shared ``flock`` and starts its own reaper (``pool_reaper``): the file
goes when the last of them is gone, however they ended.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvtier.errors import PoolError
from kvtier.pool import (
    NAME_PREFIX,
    HostPool,
    PoolHandle,
    _check_room,
    _new_region,
    _open_dir,
    _reserve,
    cleanup_stale_pools,
    hold_shared,
    slot_stride,
)
from kvtier.pool_reaper import Reaper
from kvtier.shared_pool.index import SharedIndex
from kvtier.shared_pool.layout import MAGIC, VERSION, IndexArrays, Layout, index_offset

log = logging.getLogger(__name__)

TRAILER_BYTES = mmap.PAGESIZE
ATTACH_TRIES = 200
"""Tries (10 ms apart) to attach a file that is being removed before creating a new one."""


def segment_name(share: str, digest: bytes, slot_bytes: int) -> str:
    return f"{NAME_PREFIX}share-{share}-{digest.hex()[:24]}-{slot_bytes}"


def _geometry(num_slots: int, slot_bytes: int) -> tuple[int, Layout, int]:
    """(index offset, index layout, trailer offset) of a file of ``num_slots`` slots."""
    layout = Layout.of(num_slots)
    at = index_offset(num_slots * slot_stride(slot_bytes))
    return at, layout, index_offset(at + layout.size)


def open_shared(
    share: str,
    digest: bytes,
    num_slots: int,
    slot_bytes: int,
    shm_dir: str,
    lock_timeout_s: float,
    quota: float = 0.0,
) -> tuple[HostPool, SharedIndex]:
    """The pool named ``share`` for the namespace ``digest`` (attached, or created with
    ``num_slots`` slots when none exists) and this engine's handle on its index."""
    path = str(Path(shm_dir) / segment_name(share, digest, slot_bytes))
    for _ in range(ATTACH_TRIES):
        fd = _attach_pool(path, digest, slot_bytes)
        if fd is None:
            fd = _create(path, shm_dir, num_slots, slot_bytes, digest)
        if fd is not None:
            return _open(path, fd, slot_bytes, lock_timeout_s, quota)
        time.sleep(0.01)
    raise PoolError(f"cannot attach or create the shared pool {path!r}: it kept being removed")


def _attach_pool(path: str, digest: bytes, slot_bytes: int) -> int | None:
    def check(fd: int, size: int) -> None:
        _check_trailer(fd, size, path, digest, slot_bytes)

    return _attach(path, check)


def _attach(path: str, check: Callable[[int, int], None]) -> int | None:
    """The open, share-locked file at ``path`` that ``check(fd, size)`` accepts (it raises
    ``PoolError`` otherwise); None when there is none (or it is being removed: the caller tries
    again)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise PoolError(f"cannot attach the shared pool {path!r}: {exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PoolError(f"shared pool {path!r} is not a regular file of this user")
        try:
            hold_shared(fd, path)
        except PoolError:
            os.close(fd)
            return None
        check(fd, st.st_size)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return fd


def _trailer(fd: int, size: int) -> tuple[mmap.mmap, np.ndarray]:
    mapping = mmap.mmap(fd, TRAILER_BYTES, flags=mmap.MAP_SHARED, offset=size - TRAILER_BYTES)
    return mapping, np.frombuffer(mapping, dtype=np.int64, count=8)


def _check_trailer(fd: int, size: int, path: str, digest: bytes, slot_bytes: int) -> None:
    if size < TRAILER_BYTES or size % TRAILER_BYTES:
        raise PoolError(f"shared pool {path!r} has a size no shared pool has")
    mapping, words = _trailer(fd, size)
    try:
        magic, version, num_slots, its_slot_bytes = (int(w) for w in words[:4])
        its_digest = words[4:6].tobytes()
    finally:
        del words
        mapping.close()
    if magic != MAGIC or version != VERSION:
        raise PoolError(f"shared pool {path!r} is not a kvtier shared pool of version {VERSION}")
    if its_slot_bytes != slot_bytes or its_digest != digest:
        raise PoolError(f"shared pool {path!r} holds another namespace's blocks")
    if _geometry(num_slots, slot_bytes)[2] + TRAILER_BYTES != size:
        raise PoolError(f"shared pool {path!r} is not as big as its trailer says")


def _create(path: str, shm_dir: str, num_slots: int, slot_bytes: int, digest: bytes) -> int | None:
    """A new file, complete before it is named; None when another engine named one first."""
    at, layout, trailer_at = _geometry(num_slots, slot_bytes)

    def initialise(fd: int) -> None:
        _initialise(fd, at, layout, trailer_at, slot_bytes, digest)

    fd = create_named(path, shm_dir, trailer_at + TRAILER_BYTES, initialise)
    if fd is not None:
        log.info("created shared pool %s: %d slots of %d bytes", path, num_slots, slot_bytes)
    return fd


def create_named(
    path: str, shm_dir: str, size: int, initialise: Callable[[int], None]
) -> int | None:
    """The open, share-locked file of ``size`` bytes that ``initialise`` filled, named ``path``
    only once complete; None when another engine named one first (attach that one). Stale pool
    files are swept first; the file's memory is claimed at once (``pool._reserve``)."""
    dir_fd = _open_dir(shm_dir)
    try:
        cleanup_stale_pools(shm_dir)
        _check_room(dir_fd, size, shm_dir)
        fd, publish, discard = _new_region(dir_fd, Path(path).name, shm_dir)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            os.ftruncate(fd, size)
            _reserve(fd, size, shm_dir)
            initialise(fd)
            publish(fd)
        except FileExistsError:
            os.close(fd)
            discard()
            return None
        except BaseException:
            os.close(fd)
            discard()
            raise
    finally:
        os.close(dir_fd)
    return fd


def _initialise(
    fd: int, at: int, layout: Layout, trailer_at: int, slot_bytes: int, digest: bytes
) -> None:
    mapping = mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED, offset=at)
    arrays = IndexArrays(memoryview(mapping), layout)
    arrays.initialise(slot_bytes, digest)
    del arrays
    mapping.close()
    tmap, words = _trailer(fd, trailer_at + TRAILER_BYTES)
    words[1:4] = (VERSION, layout.num_slots, slot_bytes)
    words[4:6] = np.frombuffer(digest, dtype=np.int64, count=2)
    words[0] = MAGIC
    del words
    tmap.close()


def _open(
    path: str, fd: int, slot_bytes: int, lock_timeout_s: float, quota: float
) -> tuple[HostPool, SharedIndex]:
    """The pool over the slots and the index over its arrays, from an open, locked file."""
    try:
        size = os.fstat(fd).st_size
        tmap, words = _trailer(fd, size)
        num_slots = int(words[2])
        del words
        tmap.close()
        at, layout, _ = _geometry(num_slots, slot_bytes)
        index_fd = os.dup(fd)  # same open file: its locks are this engine's too
    except BaseException:
        os.close(fd)
        raise
    try:
        mapping = mmap.mmap(index_fd, layout.size, flags=mmap.MAP_SHARED, offset=at)
        arrays = IndexArrays(memoryview(mapping), layout)
        index = SharedIndex(index_fd, mapping, arrays, lock_timeout_s, int(quota * num_slots))
    except BaseException:
        os.close(index_fd)
        os.close(fd)
        raise
    handle = PoolHandle(path, num_slots, slot_bytes, slot_stride(slot_bytes))
    try:
        pool = HostPool(handle, fd, owner=False, reaper=Reaper.start(path, fd))
    except BaseException:
        index.close()
        os.close(fd)
        raise
    pool.last_out_unlinks = True
    return pool, index
