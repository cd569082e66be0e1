"""A secondary tier on a local disk or a shared filesystem.

Layout: ``<path>/<namespace hex>/<first two hex digits of key>/<key hex>.kvb``. Each file is the
64-byte payload header followed by the bytes of one pool slot. File names come from key bytes only
(hex), so no user string ever reaches a path.

``FsTier`` is a ``BlockTier`` (``block_tier.py``: validation, header and checksum, corrupt ->
drop, pins, counters, fan-out to I/O threads) whose storage is this module's ``exists`` / ``put``
/ ``get`` / ``delete``; the file primitives are in ``files.py``, the index and capacity
accounting in ``index.py``, the options in ``options.py``.

What callers may rely on (besides the ``Tier`` contract):

* A key is visible to ``lookup`` only after its file was completely written and atomically renamed
  into place. A read reports ``ok=True`` only after the header and checksum matched; a mismatch,
  a short file or a file of another namespace is a miss, counted in ``counters.corrupt``, and the
  file is removed and the key reported through ``take_evicted``.
* The bytes of the files this tier knows plus those reserved by in-flight writes never exceed
  ``capacity`` (headers included). Blocks are evicted to make room in the order of the
  ``eviction`` policy (``lru`` by default; ``index.py``); a block that an in-flight job reads
  or writes is never evicted.
* Disk full: the tier also stays below the space the filesystem really has. Its limit is
  ``min(capacity, used + free - min_free)``, with the free space re-read at most once a second and
  at once after a write fails with ENOSPC or EDQUOT (which evicts to make room and retries the
  block once). It starts on a full disk (with nothing to write there, writes are ``rejected``).
* All file I/O runs on ``threads`` I/O threads (``workers.WorkerPool``); ``lookup``, ``submit`` and
  ``poll`` do not touch the disk and never raise. A thread stuck in I/O longer than
  ``io_timeout_s`` (a hung NFS server) takes no new work; while every thread is stuck, new jobs
  fail at once and queued blocks fail after ``io_timeout_s`` instead of waiting. A block a stuck
  thread is in the middle of is reported only when the thread returns: until then it may still
  read or write its pool slot, so the slot must stay reserved. At most ``threads`` blocks (and the
  jobs they belong to) can be held that way. ``close()`` returns within ``io_timeout_s``.

Hostile files (other users, other tenants on a shared filesystem): the tier never follows a
symbolic link below ``path`` (namespace and shard directories and block files are opened with
``O_NOFOLLOW`` relative to their parent's descriptor), never opens anything but a regular file
(``lstat`` first, then ``O_NONBLOCK`` and ``fstat``, so a FIFO cannot block a thread), creates
temp files with ``O_EXCL`` and gives files ``file_mode`` (0600) and the directories it creates
``dir_mode`` (0700) whatever the umask. Such a file where a block should be is a corrupt block:
dropped (the link or FIFO itself is removed, never what it points to).

Several processes may share one directory (a shared filesystem). Each keeps its own index, built
from the directory at start (the newest files up to its capacity; older ones are left alone);
``rescan()`` picks up files the others wrote since and forgets files they deleted. Capacity is
enforced by each process over the files it knows, so give each process sharing a disk its share of
it. A process deletes only its own files (those it wrote or found at start): a file a rescan found
is forgotten when room is needed, never deleted, so a smaller share never eats a larger one
(``index.py``). A file this process cannot delete (another user's, a read-only directory) is
forgotten, no longer counted and not indexed again by ``rescan``.

Behind a shared pool (``pool.share``) the engines of a node share the directory's index and
budget instead: ``shared.SharedFsTier``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future

from kvtier.keys import BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.redaction import printable
from kvtier.tiers.block_tier import BlockTier, Got, Put
from kvtier.tiers.eviction import count_errors_in, tier_policy
from kvtier.tiers.fs import files
from kvtier.tiers.fs.files import FULL_ERRNOS, BlockFiles, Found, Read
from kvtier.tiers.fs.index import FsIndex, Victims
from kvtier.tiers.fs.options import Options
from kvtier.tiers.payload import HEADER_BYTES

log = logging.getLogger(__name__)

MIN_FREE_MAX = 256 * 1024**2
"""The default ``min_free`` is 1% of the filesystem, at most this."""
FREE_SPACE_REFRESH_S = 1.0
"""How old the free-space figure of the filesystem may get before a write re-reads it."""
MAX_VICTIM_ROUNDS = 8
"""Times a write picks more victims when the ones it chose could not be deleted."""

__all__ = ["FsTier", "Options"]

_GOT = {
    Read.FOUND: Got.FOUND,
    Read.NOT_REGULAR: Got.DAMAGED,  # dropped as a corrupt block: the thing itself removed
    Read.DAMAGED: Got.DAMAGED,
    Read.FAILED: Got.FAILED,
}


FsOptions = Options
"""``Options`` under a name the tier class's ``Options`` attribute does not hide."""


class FsTier(BlockTier):
    """Blocks as files on a local or shared filesystem; see the module docstring."""

    kind = "fs"
    Options = Options

    def __init__(self, name: str, namespace: Namespace, pool: HostPool, options: FsOptions) -> None:
        file_bytes = HEADER_BYTES + pool.slot_bytes
        policy = tier_policy(
            options.eviction, options.capacity // file_bytes, f"{options.config_path}.eviction"
        )  # before the I/O threads start: a policy that fails to build leaves nothing running
        super().__init__(
            name,
            namespace,
            pool,
            threads=options.threads,
            stuck_after_s=options.io_timeout_s,
            # A promotion is on a waiting request's path; a write is the cascade's, and a job
            # of a stored prompt's blocks (300 MB at 8B) would hold every thread ahead of it.
            reads_first=True,
        )
        self.options = options
        self.capacity = options.capacity
        self.root = os.path.join(options.path, namespace.hex)
        self._file_bytes = file_bytes
        self._index = FsIndex(options.capacity, self._pins, policy, self._report_evicted)
        count_errors_in(policy, self.counters)  # under the tier's lock, as the index's calls are
        """Guarded by ``_lock`` (the skeleton's lock, shared with its counters and pins); only
        ``exists`` and ``__len__`` read it without (a dict's membership test and length)."""
        self._free_at = -FREE_SPACE_REFRESH_S
        self._root_fd = -1
        try:
            self._root_fd = files.open_root(
                options.path,
                self.root,
                options.dir_mode,
                options.file_mode,
                f"{options.config_path}.path",
                name,
            )
            self._files = BlockFiles(
                self._root_fd, options.file_mode, options.dir_mode, options.fsync
            )
            self._load_index()
        except BaseException:
            self.close()  # the I/O threads are idle: they exit at once
            raise

    # -- the storage ----------------------------------------------------------------------------

    def exists(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        # Without the lock: this runs on the engine's scheduler thread for every lookup that
        # misses the pool, while the I/O threads take the lock for every block they move; a
        # dict's membership test is atomic by itself (the GIL, or the dict's own lock in a
        # free-threaded build), and the answer may go stale right after either way.
        return list(map(self._index.entries.__contains__, keys))

    def get(self, key: BlockKey, header: memoryview, payload: memoryview) -> Got:
        if not self._touch(key):
            return Got.MISSING  # dropped since the lookup
        read = self._files.read(key, [header, payload], self._file_bytes)
        if read is Read.MISSING:
            self._forget(key)  # deleted by another process sharing the directory
            return Got.MISSING
        return _GOT[read]

    def _touch(self, key: BlockKey) -> bool:
        """A read of ``key`` starts: False when it is not held (any more)."""
        with self._lock:
            return self._index.touch(key)

    def put(self, key: BlockKey, header: bytes, payload: memoryview) -> Put:
        need = self._file_bytes
        self._refresh_limit()
        with self._lock:
            index = self._index
            if index.touch(key):
                return Put.KEPT
            if index.busy(key):
                # Another job moves this key right now (the manager should not let that happen).
                return Put.REJECTED
            reservation = index.reserve(need)
            if reservation is None:
                return Put.REJECTED
            victims, reserved = reservation
            index.writing.add(key)
        ok = False
        try:
            reserved = self._evict_for(victims, reserved, need)
            if reserved >= need:
                ok = self._write_or_make_room(key, [memoryview(header), payload], need)
        except Exception:
            log.debug("fs tier %s: write failed", self.name, exc_info=True)
        finally:
            with self._lock:
                index.writing.discard(key)
                if ok:
                    index.commit(key, need, reserved)
                else:
                    index.used -= reserved
        return Put.STORED if ok else Put.FAILED

    def delete(self, key: BlockKey) -> bool:
        """Remove a block that is not ours to serve (a corrupt one); its file is removed only
        when it is indexed (one this process does not count is not its to judge)."""
        with self._lock:
            entry = self._index.start_delete(key)
        if entry is None:
            return False
        removed = self._files.remove(key)
        with self._lock:
            self._index.end_delete(key)
            self._index.used -= entry.size
            if not removed:
                self._note_undeletable(key)
        return True

    def _close_storage(self, abandoned: bool) -> None:
        if self._root_fd >= 0 and not abandoned:
            # A stuck thread may still use the descriptors; closing them could hand their numbers
            # to other files. Leaked in that case, on purpose.
            files = getattr(self, "_files", None)  # absent when the directory failed to open
            if files is not None:
                files.close()
            os.close(self._root_fd)

    # -- extras ---------------------------------------------------------------------------------

    def rescan(self) -> Future[int]:
        """Re-read the directory on an I/O thread: add files other processes wrote since start (the
        first to be evicted, oldest first, until this process uses them), forget indexed files
        that are gone, evict down to capacity if needed, remove stale temp files. The future's
        result is the number of keys added.

        Only needed when several processes share the directory; call it now and then (say every
        few seconds), not on every lookup: it lists the whole namespace directory.
        """
        done: Future[int] = Future()

        def run() -> None:
            try:
                done.set_result(self._rescan())
            except BaseException as exc:
                done.set_exception(exc)

        if not self._run_on_worker(run, lambda: done.set_result(0), "rescan"):
            done.set_result(0)
        return done

    @property
    def limit(self) -> int:
        """The capacity in force: ``min(capacity, used + free - min_free)`` as last measured."""
        with self._lock:
            return self._index.limit

    @property
    def used_bytes(self) -> int:
        """Bytes of indexed files plus reservations of in-flight writes (never above capacity)."""
        with self._lock:
            return self._index.used

    def is_empty(self) -> bool:
        return len(self) == 0

    def generation(self) -> int | None:
        # Bumped under the lock after each change of the index (an int read: atomic without it).
        return self._index.changes

    def __len__(self) -> int:
        return len(self._index)  # atomic; asked per lookup through is_empty (see exists)

    # -- making room (I/O threads; no lock held on entry) ---------------------------------------

    def _evict_for(self, victims: Victims, reserved: int, need: int) -> int:
        """Delete a reservation's victims; returns the bytes still reserved. Victim bytes were
        moved into the reservation; those of files that could not be deleted were uncounted
        (forgotten) and so no longer belong to it: more victims are claimed for them."""
        rounds = 0
        while victims:
            lost = sum(size for _, size in victims) - self._delete_victims(victims)
            reserved -= lost
            victims = []
            rounds += 1
            if lost and reserved < need and rounds < MAX_VICTIM_ROUNDS:
                with self._lock:
                    more = self._index.reserve(need - reserved)
                if more is not None:
                    victims, extra = more
                    reserved += extra
        return reserved

    def _write_or_make_room(self, key: BlockKey, buffers: list[memoryview], need: int) -> bool:
        """Write the block; when the filesystem is full (ENOSPC, EDQUOT: it has less room than
        our limit said, say because others filled it), re-read the free space, evict blocks worth
        ``need`` bytes and try once more. Raises OSError when the block fails."""
        try:
            self._files.write(key, buffers)
            return True
        except OSError as exc:
            if exc.errno not in FULL_ERRNOS:
                raise
        self._refresh_limit(force=True)
        with self._lock:
            victims = self._index.pick_victims(need)
        if self._evict(victims) == 0:
            return False  # nothing of ours left to remove: the disk is full of other files
        self._files.write(key, buffers)
        return True

    def _evict(self, victims: Victims) -> int:
        """Delete victims that hold no reservation and uncount the bytes gone (returned)."""
        gone = self._delete_victims(victims)
        with self._lock:
            self._index.used -= gone
        return gone

    def _delete_victims(self, victims: Victims) -> int:
        """Unlink evicted files; returns the bytes really gone (the caller uncounts them). A file
        that could not be removed is forgotten: uncounted here, not indexed again (see
        ``FsIndex.undeletable``), its bytes not returned."""
        gone = 0
        for key, size in victims:
            removed = self._files.remove(key)
            with self._lock:
                self._index.end_delete(key)
                if removed:
                    gone += size
                    self.counters.evictions += 1
                else:
                    self._note_undeletable(key)
                    self._index.used -= size
                self._report_evicted(key)
        return gone

    def _forget(self, key: BlockKey) -> None:
        """Drop an index entry whose file is already gone."""
        with self._lock:
            if self._index.forget(key):
                self._report_evicted(key)

    def _note_undeletable(self, key: BlockKey) -> None:
        """Under the lock: a file we cannot remove (another user's, a read-only directory) is not
        ours to manage (counted in ``errors``, forgotten)."""
        self.counters.errors += 1
        if self._index.note_undeletable(key):
            log.warning(
                "fs tier %s: cannot remove %s; files this process cannot delete are left alone "
                "and not counted",
                self.name,
                printable(os.path.join(self.root, *files.names(key))),
            )

    def _refresh_limit(self, force: bool = False) -> None:
        """Re-read the filesystem's free space (at most every FREE_SPACE_REFRESH_S unless forced)
        and set the limit to ``min(capacity, used + free - min_free)``. On an I/O thread: statvfs
        of a network filesystem can wait."""
        now = time.monotonic()
        if not force and now - self._free_at < FREE_SPACE_REFRESH_S:
            return
        self._free_at = now
        try:
            st = os.statvfs(self._root_fd)
        except OSError:
            return  # keep the last figure; the write itself will tell
        free = st.f_bavail * st.f_frsize
        reserve = self.options.min_free
        if reserve is None:
            reserve = min(MIN_FREE_MAX, st.f_blocks * st.f_frsize // 100)
        self._set_limit(free, reserve)

    def _set_limit(self, free: int, reserve: int) -> None:
        """The filesystem has ``free`` bytes and ``reserve`` of them must stay free."""
        with self._lock:
            self._index.set_limit(free, reserve)

    # -- the directory listing ------------------------------------------------------------------

    def _load_index(self) -> None:
        found = self._scan()
        with self._lock:
            self._index.load(found)
        self._refresh_limit(force=True)
        with self._lock:
            victims = self._index.over_limit_victims()
        self._evict(victims)

    def _rescan(self) -> int:
        with self._lock:
            start_seq = self._index.start_scan()
        try:
            on_disk = {key: (size, mtime) for key, size, mtime in self._scan()}
            self._refresh_limit()
            with self._lock:
                added, forgotten = self._index.merge_scan(on_disk, start_seq)
                for key in forgotten:
                    self._report_evicted(key)
                victims = self._index.over_limit_victims()
        finally:
            with self._lock:
                self._index.end_scan()
        self._evict(victims)
        return added

    def _scan(self) -> list[Found]:
        """(key, size, mtime) of every block file under the namespace directory (stale temp
        files removed on the way); see ``BlockFiles.scan``."""
        return self._files.scan()
