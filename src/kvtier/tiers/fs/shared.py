"""The fs tier behind a shared pool (``pool.share``): one directory, one budget, one index for every
engine on the node that uses it.

``SharedFsTier`` is an ``FsTier`` (the same files: header and checksum, temp file and rename,
``O_NOFOLLOW`` everywhere) whose index and capacity accounting are the shared ones
(``share_index.FsShareIndex`` in a file of the pool's ``shm_dir``, ``share_segment``) instead of
this process's: a block any engine wrote is a hit for all (``exists`` reads the shared table, no
lock, no I/O), ``capacity`` bounds the files of all engines together, and eviction takes the least
recently used files of all engines (sampled LRU; the tier's ``eviction`` option does not apply).

A read needs no pin across engines: a file is never changed in place, so a reader that opened it
reads the whole block even if another engine removes it meanwhile, and one that comes too late
finds no file (a miss; its entry is freed). Index calls that could not get the lock in time (an
engine stopped while holding it) are misses or rejected writes; the ones that must happen
(publishing a written file, freeing a removed one) are retried from ``poll``, on an I/O thread,
as is the clean-up of what dead engines left (``share_index``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvtier.keys import BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import JobResult
from kvtier.tiers.block_tier import Put
from kvtier.tiers.fs.files import FULL_ERRNOS
from kvtier.tiers.fs.options import Options
from kvtier.tiers.fs.share_index import Begin, FsShareIndex, Victim
from kvtier.tiers.fs.share_segment import Directory, FsShare, open_fs_share
from kvtier.tiers.fs.tier import MAX_VICTIM_ROUNDS, FsTier

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ShareSettings:
    """Where the shared accounting lives and how long its lock is waited for (the pool's)."""

    shm_dir: str
    lock_timeout_s: float


class SharedFsTier(FsTier):
    """An ``FsTier`` whose directory, budget and index every engine of a shared pool shares."""

    def __init__(
        self,
        name: str,
        namespace: Namespace,
        pool: HostPool,
        options: Options,
        share: ShareSettings,
    ) -> None:
        self._settings = share
        self._share: FsShare | None = None
        self._later_commits: list[tuple[int, bool]] = []
        self._later_frees: list[int] = []
        """Index calls that found the lock busy (guarded by ``_lock``): retried from ``poll``."""
        self._housekeeping = threading.Lock()
        super().__init__(name, namespace, pool, options)

    @property
    def share_index(self) -> FsShareIndex:
        assert self._share is not None
        return self._share.index

    # -- the storage ----------------------------------------------------------------------------

    def exists(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        if self._share is None or self._closed:
            return [False] * len(keys)
        return list(self.share_index.present(list(keys)))

    def generation(self) -> int | None:
        return None  # the other engines change the shared index: no answer may be kept

    def _touch(self, key: BlockKey) -> bool:
        index = self.share_index
        if not index.present([key])[0]:
            return False
        index.touch([key])
        return True

    def _forget(self, key: BlockKey) -> None:
        self.share_index.forget(key)

    def put(self, key: BlockKey, header: bytes, payload: memoryview) -> Put:
        index = self.share_index
        self._refresh_limit()
        removed: list[int] = []
        for _ in range(MAX_VICTIM_ROUNDS):
            start = index.begin_write(key, removed)
            removed = []
            if start.what is Begin.EVICT:
                removed = self._remove_victims(start.victims)
                continue
            if start.what is Begin.LOCKED:
                self._free_later(removed)
            if start.what is not Begin.WRITE:
                # Held or being written by another engine: there, or soon, for every engine.
                kept = start.what in (Begin.KEPT, Begin.BUSY)
                return Put.KEPT if kept else Put.REJECTED
            break
        else:
            self._free_later(removed)
            return Put.REJECTED
        ok = False
        try:
            self._files.write(key, [memoryview(header), payload])
            ok = True
        except OSError as exc:
            if exc.errno in FULL_ERRNOS:
                self._refresh_limit(force=True)  # the next writes evict down to what fits
            log.debug("fs tier %s: write failed", self.name, exc_info=True)
        if not index.commit(start.entry, ok):
            with self._lock:
                self._later_commits.append((start.entry, ok))
        return Put.STORED if ok else Put.FAILED

    def _remove_victims(self, victims: list[Victim]) -> list[int]:
        """Remove the victims' files (a file that cannot be removed is forgotten: uncounted,
        left alone, as in a private tier); their entries, to free."""
        for _entry, key in victims:
            removed = self._files.remove(key)
            with self._lock:
                if removed:
                    self.counters.evictions += 1
                else:
                    self._note_undeletable(key)
                self._report_evicted(key)
        return [entry for entry, _ in victims]

    def delete(self, key: BlockKey) -> bool:
        """Remove a corrupt block's file for every engine."""
        entry = self.share_index.start_delete(key)
        if entry is None:
            return False
        self._files.remove(key)
        self._free_later([entry])
        self._settle()
        return True

    def _free_later(self, entries: list[int]) -> None:
        if entries:
            with self._lock:
                self._later_frees += entries

    # -- housekeeping ---------------------------------------------------------------------------

    def poll(self) -> list[JobResult]:
        """Results, as every tier's; and now and then: reap dead engines and clean up what they
        left, retry index calls that found the lock busy (on an I/O thread)."""
        if self._share is not None and not self._closed:
            index = self.share_index
            index.maintain()
            with self._lock:
                due = bool(index.orphans or self._later_commits or self._later_frees)
            release = self._housekeeping.release
            if due and self._housekeeping.acquire(blocking=False):
                queued = self._run_on_worker(self._clean_up, release, "clean-up")
                if not queued:
                    release()
        return super().poll()

    def _clean_up(self) -> None:
        try:
            orphans = self.share_index.take_orphans()
            for _entry, key in orphans:
                self._files.remove(key, stale_temps=True)  # whole or not: dropped
            self._free_later([entry for entry, _ in orphans])
            self._settle()
        finally:
            self._housekeeping.release()

    def _settle(self) -> None:
        """Retry the commits and frees that found the lock busy."""
        with self._lock:
            commits, self._later_commits = self._later_commits, []
            frees, self._later_frees = self._later_frees, []
        index = self.share_index
        failed = [(entry, ok) for entry, ok in commits if not index.commit(entry, ok)]
        unsettled = frees if not index.settle(frees) else []
        with self._lock:
            self._later_commits += failed
            self._later_frees += unsettled

    # -- extras ---------------------------------------------------------------------------------

    def rescan(self) -> Future[int]:
        """Nothing to do: the shared index sees every engine's files as they are written."""
        done: Future[int] = Future()
        done.set_result(0)
        return done

    @property
    def limit(self) -> int:
        return self.share_index.limit * self._file_bytes

    @property
    def used_bytes(self) -> int:
        return self.share_index.used_slots() * self._file_bytes

    def __len__(self) -> int:
        return self.share_index.visible_count() if self._share is not None else 0

    def check_invariants(self, settled: bool = False) -> None:
        self.share_index.check_invariants(settled)

    # -- the index's file -----------------------------------------------------------------------

    def _load_index(self) -> None:
        st = os.fstat(self._root_fd)
        directory = Directory(
            st.st_dev,
            st.st_ino,
            self.namespace.digest,
            self._file_bytes,
            self.capacity // self._file_bytes,
            self._files.scan,
            self._files.remove,
        )
        self._share = open_fs_share(
            self._settings.shm_dir, directory, self._settings.lock_timeout_s
        )
        self._refresh_limit(force=True)

    def _set_limit(self, free: int, reserve: int) -> None:
        index = self.share_index  # the budget is the one of the engine that made the index
        index.set_limit(index.used_slots() + (free - reserve) // self._file_bytes)

    def _close_storage(self, abandoned: bool) -> None:
        # With a block abandoned on a stuck thread the index stays open (its entries this
        # engine's, its lock held) until the process ends: the others must not remove a file
        # that thread may still rename into place.
        if self._share is not None and not abandoned:
            self._settle()
            share, self._share = self._share, None
            share.close()
        super()._close_storage(abandoned)
