"""Create or attach the shared-memory file of an fs tier directory's shared accounting.

One file per directory (its device and inode), namespace and block file size, in the pool's
``shm_dir`` under the pool files' prefix: ``kvtier-pool-fs-<digest>``. Like a shared pool's file
(``kvtier.shared_pool.segment``) it is built complete before it gets its name, every engine using
it holds the shared ``flock`` and starts a reaper (``kvtier.pool_reaper``), and the last one out,
however it ended, takes it away; a stale one is swept at a later start.

The engine that creates it indexes the directory as it finds it (the files survive a restart):
the newest block files that fit the capacity, in the order of their write times; it removes the
older ones, those of a wrong size (no block of this namespace) and temp files of dead writers,
so the directory starts within its budget. No engine uses the directory then: the file goes only
when its last user is gone.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import PoolError
from kvtier.keys import BlockKey
from kvtier.pool import NAME_PREFIX, unlink_if_last
from kvtier.pool_reaper import Reaper
from kvtier.shared_pool import table
from kvtier.shared_pool.layout import (
    H_FREE_TOP,
    H_MAGIC,
    H_SLOT_BYTES,
    H_SLOTS,
    H_VERSION,
    VERSION,
    VISIBLE,
    IndexArrays,
    Layout,
)
from kvtier.shared_pool.segment import _attach as attach_file
from kvtier.shared_pool.segment import create_named
from kvtier.tiers.fs.files import Found
from kvtier.tiers.fs.share_index import H_BUDGET, H_DEV, H_INO, H_LIMIT, FsShareIndex

log = logging.getLogger(__name__)

FS_MAGIC = 0x6B76_7469_6572_4653  # "kvtierFS"
ATTACH_TRIES = 200


@dataclass(frozen=True, slots=True)
class Directory:
    """The tier directory whose accounting is shared, and how to list and empty it."""

    dev: int
    ino: int
    digest: bytes
    """The namespace's digest."""
    file_bytes: int
    capacity: int
    """Files the budget holds (``capacity // file_bytes``)."""
    scan: Callable[[], list[Found]]
    remove: Callable[[BlockKey], bool]


def segment_name(directory: Directory) -> str:
    ident = f"{directory.dev}:{directory.ino}:{directory.file_bytes}".encode() + directory.digest
    return f"{NAME_PREFIX}fs-{hashlib.blake2b(ident, digest_size=12).hexdigest()}"


class FsShare:
    """This engine's use of a shared fs accounting: the index, the file, its reaper."""

    def __init__(self, path: str, fd: int, index: FsShareIndex, reaper: Reaper) -> None:
        self.path = path
        self.index = index
        self._fd = fd
        self._reaper = reaper

    def close(self) -> None:
        """Leave the index (what this engine still writes or removes is reaped by the others)
        and the file (removed when this was its last user)."""
        self.index.close()
        removed = unlink_if_last(self._fd, self.path)
        os.close(self._fd)
        if removed:
            self._reaper.stop()
        else:
            self._reaper.leave()


def open_fs_share(shm_dir: str, directory: Directory, lock_timeout_s: float) -> FsShare:
    """The shared accounting of ``directory`` (attached, or created from a listing of it)."""
    path = str(Path(shm_dir) / segment_name(directory))
    for _ in range(ATTACH_TRIES):
        fd = _attach(path, directory)
        if fd is None:
            fd = _create(path, shm_dir, directory)
        if fd is not None:
            return _open(path, fd, lock_timeout_s)
        time.sleep(0.01)
    raise PoolError(f"cannot attach or create the fs tier's shared index {path!r}")


def _attach(path: str, directory: Directory) -> int | None:
    def check(fd: int, size: int) -> None:
        _check(fd, size, path, directory)

    return attach_file(path, check)


def _check(fd: int, size: int, path: str, directory: Directory) -> None:
    if size < mmap.PAGESIZE:
        raise PoolError(f"{path!r} is no fs tier shared index")
    mapping = mmap.mmap(fd, mmap.PAGESIZE, flags=mmap.MAP_SHARED)
    try:
        words = [int(w) for w in memoryview(mapping).cast("q")[:16]]
        digest = bytes(mapping[10 * 8 : 12 * 8])
    finally:
        mapping.close()
    if words[H_MAGIC] != FS_MAGIC or words[H_VERSION] != VERSION:
        raise PoolError(f"{path!r} is no fs tier shared index of version {VERSION}")
    if (words[H_DEV], words[H_INO], words[H_SLOT_BYTES], digest) != (
        directory.dev,
        directory.ino,
        directory.file_bytes,
        directory.digest,
    ):
        raise PoolError(f"{path!r} is the shared index of another directory or namespace")
    if Layout.of(words[H_SLOTS]).size != size:
        raise PoolError(f"{path!r} is not as big as its header says")


def _create(path: str, shm_dir: str, directory: Directory) -> int | None:
    """A new file, complete before it is named; None when another engine named one first."""
    layout = Layout.of(max(1, directory.capacity))
    kept = _keep(directory)

    def initialise(fd: int) -> None:
        _initialise(fd, layout, directory, kept)

    fd = create_named(path, shm_dir, layout.size, initialise)
    if fd is not None:
        log.info("created the fs tier's shared index %s: %d files", path, directory.capacity)
    return fd


def _keep(directory: Directory) -> list[Found]:
    """The files to index, oldest first: the newest of the right size that fit; the others are
    removed (older ones past the budget, wrong sizes)."""
    found = sorted(directory.scan(), key=lambda item: item[2], reverse=True)
    kept: list[Found] = []
    for key, size, mtime in found:
        if size == directory.file_bytes and len(kept) < directory.capacity:
            kept.append((key, size, mtime))
        elif not directory.remove(key):
            log.warning("fs tier: cannot remove a block file past its budget; it stays uncounted")
    return kept[::-1]


def _initialise(fd: int, layout: Layout, directory: Directory, kept: list[Found]) -> None:
    mapping = mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED)
    a = IndexArrays(memoryview(mapping), layout)
    a.initialise(directory.file_bytes, directory.digest)
    h = a.header
    h[H_DEV], h[H_INO] = directory.dev, directory.ino
    h[H_LIMIT] = h[H_BUDGET] = directory.capacity
    now, wall = time.monotonic(), time.time()
    for key, _size, mtime in kept:
        top = int(h[H_FREE_TOP])
        entry = int(a.free[top - 1])
        h[H_FREE_TOP] = top - 1
        k0, k1 = table.key_words(key)
        a.slot_keys[entry, 0], a.slot_keys[entry, 1] = k0, k1
        a.last_use[entry] = now - max(0.0, wall - mtime)  # the files' order survives
        a.state[entry] = VISIBLE
        table.insert(a, k0, k1, entry)
    h[H_MAGIC] = FS_MAGIC
    del a, h
    mapping.close()


def _open(path: str, fd: int, lock_timeout_s: float) -> FsShare:
    try:
        size = os.fstat(fd).st_size
        index_fd = os.dup(fd)  # same open file: its locks are this engine's too
    except BaseException:
        os.close(fd)
        raise
    try:
        mapping = mmap.mmap(index_fd, size, flags=mmap.MAP_SHARED)
        words = memoryview(mapping).cast("q")
        layout = Layout.of(int(words[H_SLOTS]))
        words.release()
        index = FsShareIndex(
            index_fd, mapping, IndexArrays(memoryview(mapping), layout), lock_timeout_s
        )
    except BaseException:
        os.close(index_fd)
        os.close(fd)
        raise
    return FsShare(path, fd, index, Reaper.start(path, fd))
