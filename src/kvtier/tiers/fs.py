"""A secondary tier on a local disk or a shared filesystem.

Layout: ``<path>/<namespace hex>/<first two hex digits of key>/<key hex>.kvb``. Each file is the
64-byte payload header followed by the bytes of one pool slot. File names come from key bytes only
(hex), so no user string ever reaches a path.

What callers may rely on (besides the ``Tier`` contract):

* A key is visible to ``lookup`` only after its file was completely written and atomically renamed
  into place. A read reports ``ok=True`` only after the header and checksum matched; a mismatch,
  a short file or a file of another namespace is a miss, counted in ``counters.corrupt``, and the
  file is removed and the key reported through ``take_evicted``.
* The bytes of the files this tier knows plus those reserved by in-flight writes never exceed
  ``capacity`` (headers included). Least-recently used blocks are evicted to make room; a block
  that an in-flight job reads or writes is never evicted.
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
from the directory at start; ``rescan()`` picks up files the others wrote since and forgets files
they deleted. Capacity is enforced by each process over the files it knows, so give each process
sharing a disk its share of it. A file this process cannot delete (another user's, a read-only
directory) is forgotten, no longer counted and not indexed again by ``rescan``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import itertools
import logging
import os
import socket
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvtier.errors import ConfigError
from kvtier.keys import KEY_BYTES, BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import JobKind, JobResult, Tier, TierJob
from kvtier.tiers.block_tier import valid_block
from kvtier.tiers.iovec import advance
from kvtier.tiers.payload import HEADER_BYTES, block_matches, encode_header
from kvtier.tiers.workers import WorkerPool
from kvtier.validation import Section

log = logging.getLogger(__name__)

BLOCK_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 3600.0
"""A temp file this old is a crash leftover even if we cannot tell whether its writer lives."""

_HEX = frozenset("0123456789abcdef")
MIN_FREE_MAX = 256 * 1024**2
"""The default ``min_free`` is 1% of the filesystem, at most this."""
FREE_SPACE_REFRESH_S = 1.0
"""How old the free-space figure of the filesystem may get before a write re-reads it."""
MAX_UNDELETABLE = 65536
"""Keys remembered as undeletable (so rescans do not index them again); oldest forgotten first."""
MAX_VICTIM_ROUNDS = 8
"""Times a write picks more victims when the ones it chose could not be deleted."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})


@dataclass(frozen=True, slots=True)
class Options:
    path: str
    """Directory shared by every namespace; each namespace gets its own subdirectory."""
    capacity: int
    """Bytes on disk (headers included) this tier may use."""
    fsync: bool = False
    """fsync each file and its directory before a block becomes visible (survives power loss)."""
    threads: int = 4
    file_mode: int = 0o600
    """Permission bits of block files (set with fchmod, so the umask does not matter)."""
    dir_mode: int = 0o700
    """Permission bits of the directories the tier creates."""
    min_free: int | None = None
    """Bytes of the filesystem left free: the tier shrinks below ``capacity`` to keep them. None:
    1% of the filesystem's size, at most ``MIN_FREE_MAX``."""
    io_timeout_s: float = 10.0
    """An I/O thread busy on one block this long is stuck; see the module docstring."""
    config_path: str = field(default="fs", compare=False)
    """Where these options came from in the config (``tiers[1]``), for error messages."""

    @classmethod
    def parse(cls, section: Section) -> Options:
        options = cls(
            path=section.file_path("path"),
            capacity=section.size("capacity", minimum=1),
            fsync=section.boolean("fsync", False),
            threads=section.integer("threads", 4, minimum=1, maximum=256),
            file_mode=_mode(section, "file_mode", 0o600, 0o600),
            dir_mode=_mode(section, "dir_mode", 0o700, 0o700),
            min_free=section.size("min_free") if section.has("min_free") else None,
            io_timeout_s=section.number("io_timeout_s", 10.0, minimum=0.01, maximum=3600.0),
            config_path=section.path or "fs",
        )
        section.done()
        return options


@dataclass(slots=True)
class _Entry:
    size: int
    """Bytes of the file (header included)."""
    seq: int
    """Commit order of our own writes (0 for files found on disk): tells ``rescan`` which entries
    are newer than its directory listing and so must not be judged by it."""


@dataclass(slots=True)
class _Job:
    job_id: int
    keys: list[BlockKey]
    slots: list[int]
    work: Callable[[BlockKey, int], bool]
    ok: list[bool]
    remaining: int
    cursor: Iterator[int]
    """Next block index to take; shared by the job's workers (``next`` on a count is atomic)."""


Victims = list[tuple[BlockKey, int]]


class FsTier(Tier):
    """Blocks as files on a local or shared filesystem; see the module docstring."""

    def __init__(self, name: str, namespace: Namespace, pool: HostPool, options: Options) -> None:
        super().__init__(name, namespace, pool)
        self.options = options
        self.capacity = options.capacity
        self.root = os.path.join(options.path, namespace.hex)
        self._digest = namespace.digest
        self._file_bytes = HEADER_BYTES + pool.slot_bytes
        self._lock = threading.Lock()
        # Guarded by _lock. Ordered oldest -> most recently used.
        self._index: OrderedDict[BlockKey, _Entry] = OrderedDict()
        # Bytes of indexed files + bytes reserved by in-flight writes (which include the files
        # they are deleting to make room): the quantity kept <= capacity.
        self._used = 0
        self._pins: dict[BlockKey, int] = {}
        self._writing: set[BlockKey] = set()
        self._deleting: set[BlockKey] = set()
        self._seq = 0
        """Bumped by every commit and, while a rescan runs, every deletion."""
        self._scans = 0
        """Rescans running; while any does, deleted keys are remembered in ``_deleted``."""
        self._deleted: set[BlockKey] = set()
        """Keys deleted while a rescan ran: its listing may still show them."""
        self._undeletable: OrderedDict[BlockKey, None] = OrderedDict()
        """Keys whose file could not be removed: forgotten and not indexed again."""
        self._limit = options.capacity
        """``min(capacity, used + free - min_free)`` as of ``_free_at``."""
        self._free_at = -FREE_SPACE_REFRESH_S
        self._tmp_ids = itertools.count()
        self._host = _host_tag()
        self._closed = False
        self._root_fd = -1
        self._prepare_root(options.path)
        try:
            self._load_index()
            self._workers = WorkerPool(f"kvtier-fs-{name}", options.threads, options.io_timeout_s)
        except BaseException:
            os.close(self._root_fd)
            raise

    # -- the Tier interface ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        with self._lock:
            index = self._index
            out: list[bool | None] = [key in index for key in keys]
            self.counters.lookups += len(out)
            self.counters.lookup_hits += sum(1 for hit in out if hit)
        return out

    def submit(self, job: TierJob) -> None:
        n = len(job.keys)
        reading = job.kind is JobKind.READ
        work = self._read_block if reading else self._write_block
        state = _Job(
            job.job_id, list(job.keys), list(job.slots), work, [False] * n, n, itertools.count()
        )
        with self._lock:
            if reading:
                self.counters.read_jobs += 1
            else:
                self.counters.write_jobs += 1
            if n != len(job.slots):
                self.counters.errors += n
        if self._closed or n == 0 or n != len(job.slots):
            self._finish(job.job_id, state.ok)
            return
        with self._lock:
            # Pinned from submit on, so a write submitted later cannot evict what this job moves.
            for key in job.keys:
                self._pins[key] = self._pins.get(key, 0) + 1
        # A few workers per job, each taking the next block until none is left: blocks spread
        # over the threads without one queued task (and its cost on this thread) per block.
        label = f"{job.kind.value} job {job.job_id}"
        started = 0
        for _ in range(min(n, self.options.threads)):
            if not self._workers.submit(
                lambda: self._run_blocks(state), lambda: self._fail_rest(state), label
            ):
                break  # closed, or every thread stuck: fail fast rather than queue forever
            started += 1
        if started == 0:
            self._fail_rest(state)

    def poll(self) -> list[JobResult]:
        # Blocks queued behind stuck threads for longer than io_timeout_s fail here.
        self._workers.expire()
        return super().poll()

    def close(self) -> None:
        """Wait up to ``io_timeout_s`` for queued and running blocks (their results still arrive
        through ``poll``), then fail the blocks not started and abandon those on stuck threads
        (logged; their jobs are never reported, their slots must stay reserved). Idempotent."""
        if self._closed:
            return
        self._closed = True
        abandoned = self._workers.close(self.options.io_timeout_s)
        if not abandoned:
            # A stuck thread may still use the descriptor; closing it could hand its number to
            # another file. Leaked in that case, on purpose.
            os.close(self._root_fd)

    # -- extras ---------------------------------------------------------------------------------

    def rescan(self) -> Future[int]:
        """Re-read the directory on an I/O thread: add files other processes wrote since start (as
        least recently used), forget indexed files that are gone, evict down to capacity if needed,
        remove stale temp files. The future's result is the number of keys added.

        Only needed when several processes share the directory; call it now and then (say every
        few seconds), not on every lookup: it lists the whole namespace directory.
        """
        done: Future[int] = Future()

        def run() -> None:
            try:
                done.set_result(self._rescan())
            except BaseException as exc:
                done.set_exception(exc)

        if self._closed or not self._workers.submit(run, lambda: done.set_result(0), "rescan"):
            done.set_result(0)
        return done

    @property
    def stuck_threads(self) -> int:
        """I/O threads busy on one block for longer than ``io_timeout_s``."""
        return self._workers.stuck

    @property
    def limit(self) -> int:
        """The capacity in force: ``min(capacity, used + free - min_free)`` as last measured."""
        with self._lock:
            return self._limit

    @property
    def used_bytes(self) -> int:
        """Bytes of indexed files plus reservations of in-flight writes (never above capacity)."""
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # -- per-block work (I/O threads) -----------------------------------------------------------

    def _run_blocks(self, state: _Job) -> None:
        n = len(state.keys)
        for i in state.cursor:
            if i >= n:
                return
            key = state.keys[i]
            ok = False
            try:
                ok = state.work(key, state.slots[i])
            except Exception:  # last line of defence: every job must be reported, as a failure
                self._count_error()
            finally:
                self._block_done(state, i, key, ok)

    def _fail_rest(self, state: _Job) -> None:
        """Fail the blocks of a job no thread has taken yet (refused or expired work)."""
        n = len(state.keys)
        for i in state.cursor:
            if i >= n:
                return
            self._count_error()
            self._block_done(state, i, state.keys[i], False)

    def _block_done(self, state: _Job, i: int, key: BlockKey, ok: bool) -> None:
        with self._lock:
            state.ok[i] = ok
            pins = self._pins.get(key, 0) - 1
            if pins > 0:
                self._pins[key] = pins
            else:
                self._pins.pop(key, None)
            state.remaining -= 1
            last = state.remaining == 0
        if last:
            self._finish(state.job_id, state.ok)

    def _read_block(self, key: BlockKey, slot: int) -> bool:
        if not self._valid(key, slot):
            return False
        with self._lock:
            if key not in self._index:
                return False  # dropped since the lookup: a plain miss
            self._index.move_to_end(key)
        view = self.pool.view(slot)
        header = bytearray(HEADER_BYTES)
        try:
            fd = self._open_block(key)
        except FileNotFoundError:
            self._forget(key)  # deleted by another process sharing the directory
            return False
        except _NotRegular:
            self._drop_corrupt(key)  # a FIFO, a device, a directory or a symbolic link
            return False
        except OSError:
            self._count_error()
            return False
        try:
            # Size first: a truncated or grown file is rejected without reading it.
            complete = os.fstat(fd).st_size == self._file_bytes and _read_exact(
                fd, [memoryview(header), view]
            )
        except OSError:
            self._count_error()
            return False
        finally:
            os.close(fd)
        if not (complete and block_matches(memoryview(header), self._digest, key, view)):
            self._drop_corrupt(key)
            return False
        with self._lock:
            self.counters.read_blocks += 1
            self.counters.read_bytes += len(view)
        return True

    def _open_block(self, key: BlockKey) -> int:
        """A descriptor of the key's block file, read-only and blocking. Raises ``_NotRegular``
        for anything but a regular file (nothing else is opened; a FIFO swapped in between the
        check and the open is opened non-blocking and refused), OSError as the calls do."""
        shard_name, name = self._names(key)
        try:
            shard = os.open(shard_name, _DIR_FLAGS, dir_fd=self._root_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise _NotRegular(shard_name) from exc
            raise
        try:
            if not stat.S_ISREG(os.stat(name, dir_fd=shard, follow_symlinks=False).st_mode):
                raise _NotRegular(name)
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            try:
                fd = os.open(name, flags, dir_fd=shard)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise _NotRegular(name) from exc
                raise
        finally:
            os.close(shard)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise _NotRegular(name)
            # Regular files ignore O_NONBLOCK on Linux; cleared anyway so a read never sees EAGAIN.
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _write_block(self, key: BlockKey, slot: int) -> bool:
        if not self._valid(key, slot):
            return False
        need = self._file_bytes
        self._refresh_limit()
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return True
            if key in self._writing or key in self._deleting:
                # Another job moves this key right now (the manager should not let that happen).
                self.counters.rejected += 1
                return False
            reservation = self._reserve(need)
            if reservation is None:
                self.counters.rejected += 1
                return False
            victims, reserved = reservation
            self._writing.add(key)
        rounds = 0
        while victims:
            # Victim bytes were moved into our reservation; those of files that could not be
            # deleted were uncounted (forgotten) and so no longer belong to it: claim more.
            lost = sum(size for _, size in victims) - self._delete_victims(victims)
            reserved -= lost
            victims = []
            rounds += 1
            if lost and reserved < need and rounds < MAX_VICTIM_ROUNDS:
                with self._lock:
                    more = self._reserve(need - reserved)
                if more is not None:
                    victims, extra = more
                    reserved += extra
        ok = False
        try:
            if reserved >= need:
                ok = self._write_or_make_room(key, self.pool.view(slot), need)
        except Exception:
            ok = False
        with self._lock:
            self._writing.discard(key)
            if ok:
                old = self._index.pop(key, None)
                if old is not None:  # cannot happen today; keeps the accounting right if it does
                    self._used -= old.size
                self._seq += 1
                self._index[key] = _Entry(need, self._seq)
                self._undeletable.pop(key, None)  # replaced by our own file
                self._used -= reserved - need
                self.counters.write_blocks += 1
                self.counters.write_bytes += self.pool.slot_bytes
            else:
                self._used -= reserved
                self.counters.errors += 1
        return ok

    def _write_or_make_room(self, key: BlockKey, view: memoryview, need: int) -> bool:
        """Write the block; when the filesystem is full (ENOSPC, EDQUOT: it has less room than
        our limit said, say because others filled it), re-read the free space, evict least-recent
        blocks worth ``need`` bytes and try once more. Raises OSError when the block fails."""
        try:
            self._write_file(key, view)
            return True
        except OSError as exc:
            if exc.errno not in _FULL:
                raise
        self._refresh_limit(force=True)
        with self._lock:
            victims = self._pick_victims(need)
        gone = self._delete_victims(victims)
        with self._lock:
            self._used -= gone
        if gone == 0:
            return False  # nothing of ours left to remove: the disk is full of other files
        self._write_file(key, view)
        return True

    def _write_file(self, key: BlockKey, view: memoryview) -> None:
        """Temp file (created exclusively, never through a link), optional fsync, atomic rename:
        readers see the whole block or nothing."""
        shard_name, final = self._names(key)
        tmp = f"{final[: -len(BLOCK_SUFFIX)]}.{self._host}.{os.getpid()}.{next(self._tmp_ids)}"
        tmp += TMP_SUFFIX
        header = encode_header(self._digest, key, view)
        shard = self._open_shard(shard_name)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, self.options.file_mode, dir_fd=shard)
            try:
                try:
                    os.fchmod(fd, self.options.file_mode)  # the umask may have masked bits off
                    _write_all(fd, [memoryview(header), view])
                    if self.options.fsync:
                        os.fsync(fd)
                finally:
                    os.close(fd)
                os.replace(tmp, final, src_dir_fd=shard, dst_dir_fd=shard)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=shard)
                raise
            if self.options.fsync:
                os.fsync(shard)
        finally:
            os.close(shard)

    def _open_shard(self, name: str) -> int:
        """A descriptor of a shard directory, created (``dir_mode``) if missing; OSError (ELOOP,
        ENOTDIR) when something else, a symbolic link say, sits in its place."""
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=self._root_fd)
        except FileNotFoundError:
            pass
        created = True
        try:
            os.mkdir(name, self.options.dir_mode, dir_fd=self._root_fd)
        except FileExistsError:  # a concurrent writer (here or in a peer) made it first
            created = False
        fd = os.open(name, _DIR_FLAGS, dir_fd=self._root_fd)
        if created:
            try:
                os.fchmod(fd, self.options.dir_mode)
                if self.options.fsync:
                    os.fsync(self._root_fd)
            except BaseException:
                os.close(fd)
                raise
        return fd

    def _remove(self, key: BlockKey) -> bool:
        """Remove the key's file (never what a link there points to); True when it is gone."""
        shard_name, name = self._names(key)
        try:
            shard = os.open(shard_name, _DIR_FLAGS, dir_fd=self._root_fd)
        except FileNotFoundError:
            return True
        except OSError as exc:
            # Our shard directory was replaced (by a link or a file): nothing of ours is there.
            return exc.errno in (errno.ELOOP, errno.ENOTDIR)
        try:
            return _unlink(name, shard)
        finally:
            os.close(shard)

    # -- index and capacity (callers hold no lock unless said) ----------------------------------

    def _reserve(self, need: int) -> tuple[Victims, int] | None:
        """Under the lock: claim ``need`` bytes, choosing least-recent unpinned victims when the
        free space (below ``_limit``) is short. Returns (victims, bytes now reserved) or None when
        it cannot fit.

        Victims leave the index at once (so nobody reads them) but their bytes stay counted, now
        as part of the reservation, until their files are gone: disk use never exceeds the limit.
        """
        free = self._limit - self._used
        if free >= need:
            self._used += need
            return [], need
        victims: Victims = []
        freed = 0
        for key, entry in self._index.items():
            if self._pins.get(key):
                continue
            victims.append((key, entry.size))
            freed += entry.size
            if free + freed >= need:
                break
        else:
            return None
        for key, _ in victims:
            del self._index[key]
            self._deleting.add(key)
        take = max(0, need - freed)
        self._used += take
        return victims, freed + take

    def _pick_victims(self, need: int) -> Victims:
        """Under the lock: least-recent unpinned entries worth ``need`` bytes (fewer if there are
        not enough), out of the index; their bytes stay counted until they are deleted."""
        victims: Victims = []
        for key, entry in self._index.items():
            if need <= 0:
                break
            if self._pins.get(key) or key in self._writing:
                continue
            victims.append((key, entry.size))
            need -= entry.size
        for key, _ in victims:
            del self._index[key]
            self._deleting.add(key)
        return victims

    def _over_capacity_victims(self) -> Victims:
        """Under the lock: least-recent unpinned entries to drop until the index fits the limit."""
        return self._pick_victims(self._used - self._limit)

    def _delete_victims(self, victims: Victims) -> int:
        """Unlink evicted files; returns the bytes really gone (the caller uncounts them). A file
        that could not be removed is forgotten: uncounted here, not indexed again (see
        ``_undeletable``), its bytes not returned."""
        gone = 0
        for key, size in victims:
            removed = self._remove(key)
            with self._lock:
                self._deleting.discard(key)
                self._note_deleted(key)
                if removed:
                    gone += size
                    self.counters.evictions += 1
                else:
                    self._note_undeletable(key)
                    self._used -= size
                self._report_evicted(key)
        return gone

    def _forget(self, key: BlockKey) -> None:
        """Drop an index entry whose file is already gone."""
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is None:
                return
            self._used -= entry.size
            self._report_evicted(key)

    def _drop_corrupt(self, key: BlockKey) -> None:
        with self._lock:
            self.counters.corrupt += 1
            entry = self._index.pop(key, None)
            if entry is None:
                return
            self._deleting.add(key)
        removed = self._remove(key)
        with self._lock:
            self._deleting.discard(key)
            self._note_deleted(key)
            self._used -= entry.size
            if not removed:
                self._note_undeletable(key)
            self._report_evicted(key)

    def _note_deleted(self, key: BlockKey) -> None:
        """Under the lock: a running rescan may have listed this file before it went."""
        if self._scans:
            self._deleted.add(key)

    def _note_undeletable(self, key: BlockKey) -> None:
        """Under the lock: a file we cannot remove (another user's, a read-only directory) is not
        ours to manage: counting it would hold its bytes against our capacity forever."""
        self.counters.errors += 1
        undeletable = self._undeletable
        if not undeletable:
            log.warning(
                "fs tier %s: cannot remove %s; files this process cannot delete are left alone "
                "and not counted",
                self.name,
                os.path.join(self.root, *self._names(key)),
            )
        undeletable[key] = None
        undeletable.move_to_end(key)
        if len(undeletable) > MAX_UNDELETABLE:
            undeletable.popitem(last=False)

    def _refresh_limit(self, force: bool = False) -> None:
        """Re-read the filesystem's free space (at most every FREE_SPACE_REFRESH_S unless forced)
        and set ``_limit = min(capacity, used + free - min_free)``. On an I/O thread: statvfs of
        a network filesystem can wait."""
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
        with self._lock:
            self._limit = max(0, min(self.capacity, self._used + free - reserve))

    def _valid(self, key: BlockKey, slot: int) -> bool:
        if valid_block(key, slot, self.pool.num_slots):
            return True
        self._count_error()
        return False

    def _count_error(self) -> None:
        with self._lock:
            self.counters.errors += 1

    # -- directory ------------------------------------------------------------------------------

    def _names(self, key: BlockKey) -> tuple[str, str]:
        """(shard directory, file name) of a key, each relative to its parent."""
        name = key.hex()
        return name[:2], name + BLOCK_SUFFIX

    def _file(self, key: BlockKey) -> str:
        return os.path.join(self.root, *self._names(key))

    def _prepare_root(self, path: str) -> None:
        """Create ``path`` (missing components get ``dir_mode``; existing ones are the admin's
        and may be links) and the namespace directory, which must be a real directory; hold a
        descriptor of it. Writability is tried with an empty probe file, which a full disk
        does not fail."""
        probe = f".probe.{self._host}.{os.getpid()}.{id(self)}"
        mode = self.options.dir_mode
        fd = -1
        try:
            _make_dirs(path, mode)
            try:
                os.mkdir(self.root, mode)
                created = True
            except FileExistsError:
                created = False
            fd = os.open(self.root, _DIR_FLAGS)
            st = os.fstat(fd)
            if created or (st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & ~mode):
                # Ours: private (or as configured) whatever the umask, and stores written with
                # looser modes by older versions are closed to others here.
                os.fchmod(fd, mode)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                os.close(os.open(probe, flags, self.options.file_mode, dir_fd=fd))
                os.unlink(probe, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in _FULL:
                    raise
                log.warning("fs tier %s: %s is full (%s)", self.name, self.root, exc.strerror)
        except OSError as exc:
            if fd >= 0:
                os.close(fd)
            reason = exc.strerror or str(exc)
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and fd < 0:
                reason += f"; {self.root} must be a directory, not a symbolic link"
            field_name = f"{self.options.config_path}.path"
            raise ConfigError(field_name, path, f"a writable directory ({reason})") from exc
        self._root_fd = fd

    def _load_index(self) -> None:
        found = self._scan()
        # Oldest first, so the LRU order after a restart follows the files' write times.
        for key, size, _mtime in sorted(found, key=lambda item: item[2]):
            self._index[key] = _Entry(size, 0)
            self._used += size
        self._refresh_limit(force=True)
        with self._lock:
            victims = self._over_capacity_victims()
        gone = self._delete_victims(victims)
        with self._lock:
            self._used -= gone

    def _rescan(self) -> int:
        with self._lock:
            start_seq = self._seq
            if not self._scans:
                self._deleted.clear()
            self._scans += 1
        try:
            on_disk = {key: (size, mtime) for key, size, mtime in self._scan()}
            self._refresh_limit()
            with self._lock:
                added = self._merge_scan(on_disk, start_seq)
                victims = self._over_capacity_victims()
        finally:
            with self._lock:
                self._scans -= 1
        gone = self._delete_victims(victims)
        with self._lock:
            self._used -= gone
        return added

    def _merge_scan(self, on_disk: dict[BlockKey, tuple[int, float]], start_seq: int) -> int:
        """Under the lock: forget indexed files the listing misses, index the ones it found that
        we do not know. A key that changed since the listing began is left as it is: committed by
        us since (its seq), being written or deleted now, or deleted since (``_deleted``: the
        listing may still show it, and counting it again would count a file that is gone)."""
        index = self._index
        for key in [k for k, e in index.items() if k not in on_disk and e.seq <= start_seq]:
            if not self._pins.get(key):  # a running read finds out for itself
                self._used -= index.pop(key).size
                self._report_evicted(key)
        undeletable = self._undeletable
        for key in [k for k in undeletable if k not in on_disk]:
            del undeletable[key]  # gone after all: may be indexed again when it comes back
        skip = self._writing | self._deleting | self._deleted
        new = sorted(
            (mtime, key, size)
            for key, (size, mtime) in on_disk.items()
            if key not in index and key not in skip and key not in undeletable
        )
        # Newest of the newcomers first, each pushed to the cold end: their order follows mtime
        # and they rank below every block this process has used. Only as many as fit below the
        # limit: the others are another process's files, counted against its own capacity, and
        # indexing them would count this tier past its bound (or evict its own blocks for them).
        added = 0
        for _mtime, key, size in reversed(new):
            if self._used + size > self._limit:
                break
            index[key] = _Entry(size, 0)
            index.move_to_end(key, last=False)
            self._used += size
            added += 1
        return added

    def _scan(self) -> list[tuple[BlockKey, int, float]]:
        """(key, size, mtime) of every block file under the namespace directory; removes stale
        temp files on the way. Files that do not look like ours are left alone; links, FIFOs and
        other non-regular files are neither followed nor listed."""
        found: list[tuple[BlockKey, int, float]] = []
        now = time.time()
        try:
            with os.scandir(self._root_fd) as listing:
                shards = [
                    e.name
                    for e in listing
                    if len(e.name) == 2 and set(e.name) <= _HEX and e.is_dir(follow_symlinks=False)
                ]
        except OSError:
            return found
        for shard_name in shards:
            try:
                shard = os.open(shard_name, _DIR_FLAGS, dir_fd=self._root_fd)
            except OSError:
                continue  # gone, or replaced by a link since the listing
            try:
                self._scan_shard(shard, shard_name, found, now)
            finally:
                os.close(shard)
        return found

    def _scan_shard(
        self, shard: int, shard_name: str, found: list[tuple[BlockKey, int, float]], now: float
    ) -> None:
        try:
            with os.scandir(shard) as listing:
                entries = list(listing)
        except OSError:
            return
        for entry in entries:
            name = entry.name
            try:
                if name.endswith(BLOCK_SUFFIX):
                    stem = name[: -len(BLOCK_SUFFIX)]
                    if (
                        len(stem) == 2 * KEY_BYTES
                        and set(stem) <= _HEX
                        and stem[:2] == shard_name
                        and entry.is_file(follow_symlinks=False)
                    ):
                        st = entry.stat(follow_symlinks=False)
                        found.append((bytes.fromhex(stem), st.st_size, st.st_mtime))
                elif (
                    name.endswith(TMP_SUFFIX)
                    and entry.is_file(follow_symlinks=False)
                    and self._stale_tmp(name, entry.stat(follow_symlinks=False).st_mtime, now)
                ):
                    _unlink(name, shard)
            except OSError:
                continue  # vanished while we looked (another process): skip it

    def _stale_tmp(self, name: str, mtime: float, now: float) -> bool:
        """A temp file of a dead writer on this host, or one too old to belong to a live write.
        A live peer's temp file on a shared filesystem must survive, or its rename would fail."""
        parts = name.split(".")  # <key hex>.<host>.<pid>.<n>.tmp
        if len(parts) == 5 and parts[1] == self._host and parts[2].isdigit():
            pid = int(parts[2])
            if pid != os.getpid() and not _pid_alive(pid):
                return True
        return now - mtime > STALE_TMP_S


class _NotRegular(OSError):
    """A path where a block file should be holds something else (a link, a FIFO, a directory)."""


def _mode(section: Section, key: str, default: int, required: int) -> int:
    """Permission bits from an int (YAML reads ``0640`` as octal) or an octal string ("0640",
    "0o640"); must keep the ``required`` owner bits and hold nothing above 0o777."""
    raw = section.data.get(key) if section.has(key) else None
    if isinstance(raw, str):
        text = raw.strip().lower().removeprefix("0o")
        if not text or len(text) > 4 or set(text) - set("01234567"):
            section.string(key)  # marks the key read
            raise ConfigError(
                f"{section.path}.{key}" if section.path else key,
                raw,
                'permission bits in octal, such as "0600" or "0640"',
            )
        section.string(key)
        mode = int(text, 8)
    else:
        mode = section.integer(key, default, minimum=0, maximum=0o777)
    allowed = f'permission bits 0..0777 that include {required:#o} (in octal: "{required:04o}")'
    if mode > 0o777 or mode & required != required:
        raise ConfigError(f"{section.path}.{key}" if section.path else key, raw, allowed)
    return mode


def _make_dirs(path: str, mode: int) -> None:
    """``os.makedirs`` that gives every directory it creates ``mode`` whatever the umask (and
    never changes one that exists)."""
    missing: list[str] = []
    head = os.path.abspath(path)
    while not os.path.lexists(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            continue  # made by someone else meanwhile: theirs, left as it is
        fd = os.open(directory, _DIR_FLAGS)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)


# -- small I/O helpers (module level so tests can inject faults) --------------------------------


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    """writev until every byte is written (one syscall in the common case)."""
    pending = [b.cast("B") for b in buffers if b.nbytes]
    while pending:
        n = os.writev(fd, pending)
        if n <= 0:
            raise OSError("writev wrote nothing")
        advance(pending, n)


def _read_exact(fd: int, buffers: list[memoryview]) -> bool:
    """readv until every buffer is full; False when the file ends first."""
    pending = [b.cast("B") for b in buffers if b.nbytes]
    while pending:
        n = os.readv(fd, pending)
        if n <= 0:
            return False
        advance(pending, n)
    return True


def _unlink(name: str, dir_fd: int) -> bool:
    """Remove ``name`` in the directory ``dir_fd`` (a link itself, never its target); True when
    it is gone (removed, or already missing)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def _host_tag() -> str:
    # Hashed: a host name may hold characters we do not want in file names.
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()
