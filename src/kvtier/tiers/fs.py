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
* All file I/O runs on a thread pool of ``threads`` threads; ``lookup``, ``submit`` and ``poll`` do
  not touch the disk and never raise.

Several processes may share one directory (a shared filesystem). Each keeps its own index, built
from the directory at start; ``rescan()`` picks up files the others wrote since and forgets files
they deleted. Capacity is enforced by each process over the files it knows, so give each process
sharing a disk its share of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import operator
import os
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.keys import KEY_BYTES, BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import JobKind, Tier, TierJob
from kvtier.tiers.iovec import advance
from kvtier.tiers.payload import HEADER_BYTES, encode_header, header_matches, payload_matches
from kvtier.validation import Section

BLOCK_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 3600.0
"""A temp file this old is a crash leftover even if we cannot tell whether its writer lives."""

_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True, slots=True)
class Options:
    path: str
    """Directory shared by every namespace; each namespace gets its own subdirectory."""
    capacity: int
    """Bytes on disk (headers included) this tier may use."""
    fsync: bool = False
    """fsync each file and its directory before a block becomes visible (survives power loss)."""
    threads: int = 4

    @classmethod
    def parse(cls, section: Section) -> Options:
        options = cls(
            path=section.string("path"),
            capacity=section.size("capacity", minimum=1),
            fsync=section.boolean("fsync", False),
            threads=section.integer("threads", 4, minimum=1, maximum=256),
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
        self._tmp_ids = itertools.count()
        self._host = _host_tag()
        self._closed = False
        self._prepare_root(options.path)
        self._load_index()
        self._executor = ThreadPoolExecutor(
            max_workers=options.threads, thread_name_prefix=f"kvtier-fs-{name}"
        )

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
        started = 0
        for _ in range(min(n, self.options.threads)):
            try:
                self._executor.submit(self._run_blocks, state)
                started += 1
            except RuntimeError:  # executor already shut down
                break
        if started == 0:
            for i, key in enumerate(job.keys):
                self._block_done(state, i, key, False)

    def close(self) -> None:
        """Wait for running jobs (their results still arrive through ``poll``); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)

    # -- extras ---------------------------------------------------------------------------------

    def rescan(self) -> Future[int]:
        """Re-read the directory on an I/O thread: add files other processes wrote since start (as
        least recently used), forget indexed files that are gone, evict down to capacity if needed,
        remove stale temp files. The future's result is the number of keys added.

        Only needed when several processes share the directory; call it now and then (say every
        few seconds), not on every lookup: it lists the whole namespace directory.
        """
        if not self._closed:
            with contextlib.suppress(RuntimeError):
                return self._executor.submit(self._rescan)
        done: Future[int] = Future()
        done.set_result(0)
        return done

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
            fd = os.open(self._file(key), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget(key)  # deleted by another process sharing the directory
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
        hdr = memoryview(header)
        if not (
            complete
            and header_matches(hdr, self._digest, key, self.pool.slot_bytes)
            and payload_matches(hdr, view)
        ):
            self._drop_corrupt(key)
            return False
        with self._lock:
            self.counters.read_blocks += 1
            self.counters.read_bytes += len(view)
        return True

    def _write_block(self, key: BlockKey, slot: int) -> bool:
        if not self._valid(key, slot):
            return False
        need = self._file_bytes
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
        if victims:
            # Victim bytes were moved into our reservation; any that could not be deleted went back
            # to the index and so no longer belong to it.
            reserved -= sum(size for _, size in victims) - self._delete_victims(victims)
        ok = False
        try:
            if reserved >= need:
                self._write_file(key, self.pool.view(slot))
                ok = True
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
                self._used -= reserved - need
                self.counters.write_blocks += 1
                self.counters.write_bytes += self.pool.slot_bytes
            else:
                self._used -= reserved
                self.counters.errors += 1
        return ok

    def _write_file(self, key: BlockKey, view: memoryview) -> None:
        """Temp file, optional fsync, atomic rename: readers see the whole block or nothing."""
        directory, final = self._paths(key)
        tmp = f"{final[: -len(BLOCK_SUFFIX)]}.{self._host}.{os.getpid()}.{next(self._tmp_ids)}"
        tmp += TMP_SUFFIX
        header = encode_header(self._digest, key, view)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o644)
        except FileNotFoundError:  # first block of this shard (or removed by a peer)
            os.makedirs(directory, exist_ok=True)
            if self.options.fsync:
                _fsync_dir(self.root)
            fd = os.open(tmp, flags, 0o644)
        try:
            try:
                _write_all(fd, [memoryview(header), view])
                if self.options.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        if self.options.fsync:
            _fsync_dir(directory)

    # -- index and capacity (callers hold no lock unless said) ----------------------------------

    def _reserve(self, need: int) -> tuple[Victims, int] | None:
        """Under the lock: claim ``need`` bytes, choosing least-recent unpinned victims when the
        free space is short. Returns (victims, bytes now reserved) or None when it cannot fit.

        Victims leave the index at once (so nobody reads them) but their bytes stay counted, now
        as part of the reservation, until their files are gone: disk use never exceeds capacity.
        """
        free = self.capacity - self._used
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

    def _over_capacity_victims(self) -> Victims:
        """Under the lock: least-recent unpinned entries to drop until the index fits capacity."""
        victims: Victims = []
        excess = self._used - self.capacity
        for key, entry in self._index.items():
            if excess <= 0:
                break
            if self._pins.get(key) or key in self._writing:
                continue
            victims.append((key, entry.size))
            excess -= entry.size
        for key, _ in victims:
            del self._index[key]
            self._deleting.add(key)
        return victims

    def _delete_victims(self, victims: Victims) -> int:
        """Unlink evicted files; returns the bytes really gone. A file that could not be removed
        goes back to the cold end of the index, its bytes still counted."""
        gone = 0
        for key, size in victims:
            removed = _unlink(self._file(key))
            with self._lock:
                self._deleting.discard(key)
                if removed:
                    gone += size
                    self.counters.evictions += 1
                    self._report_evicted(key)
                else:
                    self.counters.errors += 1
                    self._index[key] = _Entry(size, 0)
                    self._index.move_to_end(key, last=False)
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
        removed = _unlink(self._file(key))
        with self._lock:
            self._deleting.discard(key)
            # An undeletable file keeps its bytes counted: accounting errs on the full side.
            if removed:
                self._used -= entry.size
            else:
                self.counters.errors += 1
            self._report_evicted(key)

    def _valid(self, key: BlockKey, slot: int) -> bool:
        # Keys are 16 bytes; a longer one would be truncated in the header and could collide.
        if _valid_block(key, slot, self.pool.num_slots):
            return True
        self._count_error()
        return False

    def _count_error(self) -> None:
        with self._lock:
            self.counters.errors += 1

    # -- directory ------------------------------------------------------------------------------

    def _paths(self, key: BlockKey) -> tuple[str, str]:
        name = key.hex()
        directory = os.path.join(self.root, name[:2])
        return directory, os.path.join(directory, name + BLOCK_SUFFIX)

    def _file(self, key: BlockKey) -> str:
        return self._paths(key)[1]

    def _prepare_root(self, path: str) -> None:
        probe = os.path.join(self.root, f".probe.{self._host}.{os.getpid()}.{id(self)}")
        try:
            os.makedirs(self.root, exist_ok=True)
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                os.write(fd, b"k")
            finally:
                os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise ConfigError("fs.path", path, f"a writable directory ({reason})") from exc

    def _load_index(self) -> None:
        found = self._scan()
        # Oldest first, so the LRU order after a restart follows the files' write times.
        for key, size, _mtime in sorted(found, key=lambda item: item[2]):
            self._index[key] = _Entry(size, 0)
            self._used += size
        with self._lock:
            victims = self._over_capacity_victims()
        self._used -= self._delete_victims(victims)

    def _rescan(self) -> int:
        with self._lock:
            start_seq = self._seq
        on_disk = {key: (size, mtime) for key, size, mtime in self._scan()}
        with self._lock:
            index = self._index
            for key in [k for k, e in index.items() if k not in on_disk and e.seq <= start_seq]:
                if not self._pins.get(key):  # a running read finds out for itself
                    self._used -= index.pop(key).size
                    self._report_evicted(key)
            skip = self._writing | self._deleting
            new = sorted(
                (mtime, key, size)
                for key, (size, mtime) in on_disk.items()
                if key not in index and key not in skip
            )
            # Newest of the newcomers first, each pushed to the cold end: their order follows mtime
            # and they rank below every block this process has used.
            for _mtime, key, size in reversed(new):
                index[key] = _Entry(size, 0)
                index.move_to_end(key, last=False)
                self._used += size
            victims = self._over_capacity_victims()
        gone = self._delete_victims(victims)
        with self._lock:
            self._used -= gone
        return len(new)

    def _scan(self) -> list[tuple[BlockKey, int, float]]:
        """(key, size, mtime) of every block file under the namespace directory; removes stale
        temp files on the way. Files that do not look like ours are left alone."""
        found: list[tuple[BlockKey, int, float]] = []
        now = time.time()
        try:
            shards = [e for e in os.scandir(self.root) if len(e.name) == 2 and e.is_dir()]
        except OSError:
            return found
        for shard in shards:
            try:
                entries = list(os.scandir(shard.path))
            except OSError:
                continue
            for entry in entries:
                name = entry.name
                try:
                    if name.endswith(BLOCK_SUFFIX):
                        stem = name[: -len(BLOCK_SUFFIX)]
                        if (
                            len(stem) == 2 * KEY_BYTES
                            and set(stem) <= _HEX
                            and stem[:2] == shard.name
                        ):
                            st = entry.stat(follow_symlinks=False)
                            if entry.is_file(follow_symlinks=False):
                                found.append((bytes.fromhex(stem), st.st_size, st.st_mtime))
                    elif name.endswith(TMP_SUFFIX) and self._stale_tmp(
                        name, entry.stat(follow_symlinks=False).st_mtime, now
                    ):
                        _unlink(entry.path)
                except OSError:
                    continue  # vanished while we looked (another process): skip it
        return found

    def _stale_tmp(self, name: str, mtime: float, now: float) -> bool:
        """A temp file of a dead writer on this host, or one too old to belong to a live write.
        A live peer's temp file on a shared filesystem must survive, or its rename would fail."""
        parts = name.split(".")  # <key hex>.<host>.<pid>.<n>.tmp
        if len(parts) == 5 and parts[1] == self._host and parts[2].isdigit():
            pid = int(parts[2])
            if pid != os.getpid() and not _pid_alive(pid):
                return True
        return now - mtime > STALE_TMP_S


# -- small I/O helpers (module level so tests can inject faults) --------------------------------


def _valid_block(key: object, slot: object, num_slots: int) -> bool:
    try:
        index = operator.index(slot)  # type: ignore[arg-type]
    except TypeError:
        return False
    return isinstance(key, bytes) and len(key) == KEY_BYTES and 0 <= index < num_slots


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


def _unlink(path: str) -> bool:
    """Remove a file; True when it is gone (removed, or already missing)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
