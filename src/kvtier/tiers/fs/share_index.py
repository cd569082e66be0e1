"""The accounting of an fs tier directory that several engines share (behind ``pool.share``).

Every block file of the namespace directory has the same size (header + one pool slot), so the
budget ``capacity`` is a number of files, and the accounting is an index of ``capacity //
file_bytes`` entries in shared memory, one per file that may exist: the shared pool's index
structure (``kvtier.shared_pool``: the same table, engines, lock and repair) with entries for
slots. An entry is

* ``FREE``: no file counted;
* ``WRITING`` (by one engine): its file is being written (a temp file, then renamed into place);
  not a hit, and no other engine writes the key;
* ``VISIBLE``: its file is complete; a hit for every engine;
* ``DELETING`` (by one engine): its file is being removed (an eviction, a corrupt block); not a
  hit, and nobody writes the key meanwhile.

Every entry that is not ``FREE`` is counted, so the files on disk (temp files included) never
outnumber the entries in use, and those never exceed the limit in force (``H_LIMIT``: the
capacity in files, lower while the filesystem is short of space): a write takes a free entry only
below the limit; above it, it first marks the least recently used visible entries (of a random
sample) ``DELETING``, removes their files outside the lock, and frees them in the same lock hold
that takes its own entry (``begin_write(key, deleted)``), so another engine cannot take the room
it made. Nothing is held across I/O: a lock hold is a few table operations.

An engine killed at any point leaves entries ``WRITING`` or ``DELETING`` under its number. The
engine that finds it dead (``reap_dead``) takes them over (``orphans``) and, on an I/O thread,
removes their files and the dead writer's temp files, then frees them: no file outlives its entry
uncounted, and none of a half-written block was ever visible (temp files are renamed only when
complete). An engine that leaves with such entries (an I/O thread still busy) lets the others
reap them the same way once its lock is gone.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from kvtier.keys import BlockKey
from kvtier.shared_pool import checks, table
from kvtier.shared_pool.base import REGISTER_TIMEOUT_S, LockedIndex
from kvtier.shared_pool.layout import FREE, H_FREE_TOP, VISIBLE, WRITING

DELETING = 3
H_LIMIT, H_DEV, H_INO, H_BUDGET = 12, 13, 14, 15
"""Header words of the fs index: the entries allowed now, the directory's device and inode, the
budget in files (``capacity // file_bytes`` of the engine that created it)."""
EVICT_SAMPLE = 16
MAX_VICTIMS = 8
"""Victims one write marks at most (more than one only while the limit is shrinking)."""

Victim = tuple[int, BlockKey]
"""(entry, key) of a file to remove."""


class Begin(Enum):
    """What ``begin_write`` decided."""

    WRITE = "write"
    """An entry is reserved (``WRITING``): write the file, then ``commit``."""
    EVICT = "evict"
    """No room yet: remove the victims' files, then call ``begin_write`` again with them."""
    KEPT = "kept"
    """The block's file is there already."""
    BUSY = "busy"
    """Another engine writes or removes this key now."""
    FULL = "full"
    """Nothing can be evicted (the limit is 0)."""
    LOCKED = "locked"
    """The index lock could not be had in time (nothing done, the victims passed not freed)."""


@dataclass(slots=True)
class Start:
    what: Begin
    entry: int = -1
    victims: list[Victim] = field(default_factory=list)


class FsShareIndex(LockedIndex):
    """One engine's handle on a shared fs accounting (``share_segment.open_fs_share``)."""

    LIVE_STATES = (WRITING, VISIBLE, DELETING)

    def _setup(self) -> None:
        self.orphans: list[Victim] = []
        """Entries of dead engines this engine took over: remove their files, then ``settle``."""
        self._rng = np.random.default_rng()
        self._local = threading.Lock()
        # The kernel's lock belongs to the open file, which this process's I/O threads share:
        # it does not exclude them from each other; this lock does.

    def _enter(self, timeout_s: float | None = None) -> bool:
        if not self._local.acquire(timeout=self.lock_timeout_s if timeout_s is None else timeout_s):
            self.lock_timeouts += 1
            return False
        if super()._enter(timeout_s):
            return True
        self._local.release()
        return False

    def _leave(self) -> None:
        super()._leave()
        self._local.release()

    def _reclaim(self, e: int) -> None:
        """Take over engine ``e``'s ``WRITING`` and ``DELETING`` entries (their files are not
        known to be whole or gone): they stay counted until ``orphans`` are cleaned up."""
        a = self.a
        mine = np.flatnonzero((a.writer == e) & ((a.state == WRITING) | (a.state == DELETING)))
        for entry in mine.tolist():
            a.writer[entry] = self.me
            self.orphans.append((entry, a.slot_keys[entry].tobytes()))
        a.writer[(a.writer == e) & (a.state == VISIBLE)] = -1

    # -- lock-free ------------------------------------------------------------------------------

    def present(self, keys: list[BlockKey]) -> list[bool]:
        """Whether each key's file is complete (no lock; a read confirms)."""
        if not keys:
            return []
        return list(map(bool, table.visible(self.a, table.keys_array(keys)) >= 0))

    def set_limit(self, entries: int) -> None:
        """The files allowed now (``min(capacity, what the filesystem has room for)``): one word,
        stored without the lock (any engine's latest measure will do)."""
        h = self.a.header
        h[H_LIMIT] = max(0, min(int(h[H_BUDGET]), entries))

    @property
    def limit(self) -> int:
        return int(self.a.header[H_LIMIT])

    def visible_count(self) -> int:
        return int(np.count_nonzero(self.a.state == VISIBLE))

    # -- writes ---------------------------------------------------------------------------------

    def begin_write(self, key: BlockKey, deleted: list[int] | None = None) -> Start:
        """Reserve an entry for ``key``'s file, first freeing ``deleted`` (entries whose files this
        engine removed: the victims of an earlier ``EVICT``); see ``Begin``."""
        if not self._enter():
            return Start(Begin.LOCKED)
        a, me = self.a, self.me
        try:
            for entry in deleted or ():
                if a.state[entry] == DELETING and a.writer[entry] == me:
                    self._free_slot(entry)
            k0, k1 = table.key_words(key)
            found = table.find_one(a, k0, k1)[1]
            if found >= 0:
                if a.state[found] != VISIBLE:
                    return Start(Begin.BUSY)
                a.last_use[found] = self._clock()
                return Start(Begin.KEPT)
            top = int(a.header[H_FREE_TOP])
            used = self.num_slots - top
            if used < self.limit:
                entry = int(a.free[top - 1])
                a.header[H_FREE_TOP] = top - 1
                a.slot_keys[entry, 0], a.slot_keys[entry, 1] = k0, k1
                a.writer[entry] = me
                a.last_use[entry] = self._clock()
                a.state[entry] = WRITING
                table.insert(a, k0, k1, entry)
                return Start(Begin.WRITE, entry)
            victims = self._victims(min(MAX_VICTIMS, used - self.limit + 1))
            return Start(Begin.EVICT, victims=victims) if victims else Start(Begin.FULL)
        finally:
            self._leave()

    def _victims(self, n: int) -> list[Victim]:
        """Mark the ``n`` least recently used visible entries of a random sample (of
        ``EVICT_SAMPLE`` per victim: a scan of a big index under the lock would cost
        milliseconds) ``DELETING``."""
        a = self.a
        if self.num_slots <= EVICT_SAMPLE * n:  # a sample would be as big: exact LRU
            candidates = np.flatnonzero(a.state == VISIBLE)
        else:
            sample = np.unique(self._rng.integers(0, self.num_slots, EVICT_SAMPLE * n))
            candidates = sample[a.state[sample] == VISIBLE]
        if candidates.size < n:
            candidates = np.flatnonzero(a.state == VISIBLE)
        if candidates.size > n:
            candidates = candidates[np.argpartition(a.last_use[candidates], n - 1)[:n]]
        out: list[Victim] = []
        for entry in candidates.tolist():
            a.state[entry] = DELETING
            a.writer[entry] = self.me
            out.append((entry, a.slot_keys[entry].tobytes()))
        return out

    def commit(self, entry: int, ok: bool) -> bool:
        """The file of a ``WRITING`` entry is in place (``ok``: visible to all) or not (freed);
        False (nothing done) when the lock could not be had: try again later."""
        if not self._enter():
            return False
        a = self.a
        try:
            if a.state[entry] == WRITING and a.writer[entry] == self.me:
                if ok:
                    a.last_use[entry] = self._clock()
                    a.state[entry] = VISIBLE
                else:
                    self._free_slot(entry)
        finally:
            self._leave()
        return True

    # -- removals -------------------------------------------------------------------------------

    def start_delete(self, key: BlockKey) -> int | None:
        """Mark ``key``'s visible entry ``DELETING`` (its file is to be removed: corrupt); its
        entry, or None when it is not visible (or the lock could not be had)."""
        if not self._enter():
            return None
        a = self.a
        try:
            entry = table.find_one(a, *table.key_words(key))[1]
            if entry < 0 or a.state[entry] != VISIBLE:
                return None
            a.state[entry] = DELETING
            a.writer[entry] = self.me
            return entry
        finally:
            self._leave()

    def settle(self, entries: list[int]) -> bool:
        """Free ``DELETING`` entries of this engine whose files are gone; False when the lock
        could not be had (try again later)."""
        if not entries:
            return True
        if not self._enter():
            return False
        a = self.a
        try:
            for entry in entries:
                if a.state[entry] in (DELETING, WRITING) and a.writer[entry] == self.me:
                    self._free_slot(entry)
        finally:
            self._leave()
        return True

    def forget(self, key: BlockKey) -> None:
        """``key``'s file is gone (a read found none): its visible entry is freed."""
        if not self._enter():
            return
        a = self.a
        try:
            entry = table.find_one(a, *table.key_words(key))[1]
            if entry >= 0 and a.state[entry] == VISIBLE:
                self._free_slot(entry)
        finally:
            self._leave()

    # -- reports and lifetime -------------------------------------------------------------------

    def take_orphans(self) -> list[Victim]:
        """The dead engines' entries taken over since the last call (to clean up)."""
        with self._local:  # appended to inside the lock (``_reclaim``)
            orphans, self.orphans = self.orphans, []
        return orphans

    def holds_entries(self) -> bool:
        """Whether entries of this engine are being written or removed (or are orphans)."""
        a = self.a
        owned = (a.writer == self.me) & ((a.state == WRITING) | (a.state == DELETING))
        return bool(owned.any())

    def check_invariants(self, settled: bool = False) -> None:
        """Reap dead engines, then raise ``AssertionError`` naming the first broken invariant
        (``shared_pool.checks``; ``settled``: no file is being written or removed)."""
        self.reap_dead()
        if not self._enter(REGISTER_TIMEOUT_S):
            raise AssertionError("fs share index: its lock stayed held for 5 s")
        try:
            checks.check(
                self.a, self.alive_engines(), settled, self.LIVE_STATES, (WRITING, DELETING)
            )
            used = self.num_slots - int(self.a.header[H_FREE_TOP])
            assert used <= self.num_slots and int(np.count_nonzero(self.a.state != FREE)) == used
        finally:
            self._leave()

    def close(self, release: bool = True) -> None:
        """Leave the index. Entries this engine still writes or removes stay, under its number,
        for the others to clean up as a dead engine's once its lock is gone."""
        if self.me >= 0 and (self.orphans or self.holds_entries()):
            release = False
        super().close(release)
