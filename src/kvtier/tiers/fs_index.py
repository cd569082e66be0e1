"""The fs tier's index and capacity accounting: the blocks this process counts, in LRU order, and
the bytes they and in-flight writes hold against the limit in force,
``min(capacity, used + free - min_free)``.

Every method runs under the tier's lock (the caller holds it) and touches no file: the tier
deletes victims' files outside the lock and settles the accounting afterwards. Victims leave the
index at once (so nobody reads them) but their bytes stay counted until their files are gone, so
disk use never exceeds the limit.

Several processes may share one directory: ``merge_scan`` folds in a listing of it (files others
wrote, files others deleted) without counting a file twice or past the limit. A file this process
cannot delete is forgotten, no longer counted and not indexed again (``undeletable``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvtier.keys import BlockKey
from kvtier.tiers.fs_files import Found

MAX_UNDELETABLE = 65536
"""Keys remembered as undeletable (so rescans do not index them again); oldest forgotten first."""

Victims = list[tuple[BlockKey, int]]
"""(key, bytes) of blocks chosen for eviction, out of the index, bytes still counted."""


@dataclass(slots=True)
class Entry:
    size: int
    """Bytes of the file (header included)."""
    seq: int
    """Commit order of our own writes (0 for files found on disk): tells ``merge_scan`` which
    entries are newer than its directory listing and so must not be judged by it."""


class FsIndex:
    """See the module docstring. ``pinned(key)``: a job moves this key now (never evicted)."""

    def __init__(self, capacity: int, pinned: Callable[[BlockKey], bool]) -> None:
        self.capacity = capacity
        self._pinned = pinned
        self.entries: OrderedDict[BlockKey, Entry] = OrderedDict()
        """Ordered oldest -> most recently used."""
        self.used = 0
        """Bytes of indexed files + bytes reserved by in-flight writes (which include the files
        they are deleting to make room): the quantity kept <= ``limit``."""
        self.limit = capacity
        """``min(capacity, used + free - min_free)`` as last measured (``set_limit``)."""
        self.writing: set[BlockKey] = set()
        self.deleting: set[BlockKey] = set()
        self.seq = 0
        """Bumped by every commit."""
        self.scans = 0
        """Rescans running; while any does, deleted keys are remembered in ``deleted``."""
        self.deleted: set[BlockKey] = set()
        """Keys deleted while a rescan ran: its listing may still show them."""
        self.undeletable: OrderedDict[BlockKey, None] = OrderedDict()
        """Keys whose file could not be removed: forgotten and not indexed again."""

    def __len__(self) -> int:
        return len(self.entries)

    def load(self, found: Iterable[Found]) -> None:
        """Index the files of a first listing, oldest first, so the LRU order after a restart
        follows the files' write times."""
        for key, size, _mtime in sorted(found, key=lambda item: item[2]):
            self.entries[key] = Entry(size, 0)
            self.used += size

    def set_limit(self, free: int, min_free: int) -> None:
        self.limit = max(0, min(self.capacity, self.used + free - min_free))

    def touch(self, key: BlockKey) -> bool:
        """Mark ``key`` most recently used; False when it is not indexed."""
        if key not in self.entries:
            return False
        self.entries.move_to_end(key)
        return True

    def busy(self, key: BlockKey) -> bool:
        """Another write or a deletion moves this key right now."""
        return key in self.writing or key in self.deleting

    # -- writes ---------------------------------------------------------------------------------

    def reserve(self, need: int) -> tuple[Victims, int] | None:
        """Claim ``need`` bytes, choosing least-recent unpinned victims when the free space
        (below ``limit``) is short. Returns (victims, bytes now reserved) or None when it cannot
        fit. The victims' bytes become part of the reservation."""
        free = self.limit - self.used
        if free >= need:
            self.used += need
            return [], need
        victims: Victims = []
        freed = 0
        for key, entry in self.entries.items():
            if self._pinned(key):
                continue
            victims.append((key, entry.size))
            freed += entry.size
            if free + freed >= need:
                break
        else:
            return None
        self._take(victims)
        take = max(0, need - freed)
        self.used += take
        return victims, freed + take

    def commit(self, key: BlockKey, size: int, reserved: int) -> None:
        """A write of ``size`` bytes that had ``reserved`` bytes succeeded: index it."""
        old = self.entries.pop(key, None)
        if old is not None:  # cannot happen today; keeps the accounting right if it does
            self.used -= old.size
        self.seq += 1
        self.entries[key] = Entry(size, self.seq)
        self.undeletable.pop(key, None)  # replaced by our own file
        self.used -= reserved - size

    # -- evictions and deletions ----------------------------------------------------------------

    def pick_victims(self, need: int) -> Victims:
        """Least-recent unpinned entries worth ``need`` bytes (fewer if there are not enough),
        out of the index; their bytes stay counted until they are deleted."""
        victims: Victims = []
        for key, entry in self.entries.items():
            if need <= 0:
                break
            if self._pinned(key) or key in self.writing:
                continue
            victims.append((key, entry.size))
            need -= entry.size
        self._take(victims)
        return victims

    def over_limit_victims(self) -> Victims:
        """Least-recent unpinned entries to drop until the index fits the limit."""
        return self.pick_victims(self.used - self.limit)

    def start_delete(self, key: BlockKey) -> Entry | None:
        """Take ``key`` out of the index for deletion (its bytes stay counted); None when it is
        not indexed."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.deleting.add(key)
        return entry

    def end_delete(self, key: BlockKey) -> None:
        """The deletion of a victim or of ``start_delete``'s key is over (its file gone or not):
        a running rescan may have listed the file before it went."""
        self.deleting.discard(key)
        if self.scans:
            self.deleted.add(key)

    def forget(self, key: BlockKey) -> bool:
        """Drop an entry whose file is already gone; True when it was indexed."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return False
        self.used -= entry.size
        return True

    def note_undeletable(self, key: BlockKey) -> bool:
        """Remember a key whose file could not be removed (another user's, a read-only
        directory): counting it would hold its bytes against our capacity forever. True when
        it is the first one remembered (worth a warning)."""
        undeletable = self.undeletable
        first = not undeletable
        undeletable[key] = None
        undeletable.move_to_end(key)
        if len(undeletable) > MAX_UNDELETABLE:
            undeletable.popitem(last=False)
        return first

    def _take(self, victims: Victims) -> None:
        for key, _ in victims:
            del self.entries[key]
            self.deleting.add(key)

    # -- rescans --------------------------------------------------------------------------------

    def start_scan(self) -> int:
        """A rescan begins its listing; returns the commit sequence it starts from."""
        if not self.scans:
            self.deleted.clear()
        self.scans += 1
        return self.seq

    def end_scan(self) -> None:
        self.scans -= 1

    def merge_scan(
        self, on_disk: dict[BlockKey, tuple[int, float]], start_seq: int
    ) -> tuple[int, list[BlockKey]]:
        """Forget indexed files the listing misses, index the ones it found that we do not know.
        A key that changed since the listing began is left as it is: committed by us since (its
        seq), being written or deleted now, or deleted since (``deleted``: the listing may still
        show it, and counting it again would count a file that is gone). Returns (keys added,
        keys forgotten)."""
        entries = self.entries
        forgotten: list[BlockKey] = []
        for key in [k for k, e in entries.items() if k not in on_disk and e.seq <= start_seq]:
            if not self._pinned(key):  # a running read finds out for itself
                self.used -= entries.pop(key).size
                forgotten.append(key)
        undeletable = self.undeletable
        for key in [k for k in undeletable if k not in on_disk]:
            del undeletable[key]  # gone after all: may be indexed again when it comes back
        skip = self.writing | self.deleting | self.deleted
        new = sorted(
            (mtime, key, size)
            for key, (size, mtime) in on_disk.items()
            if key not in entries and key not in skip and key not in undeletable
        )
        # Newest of the newcomers first, each pushed to the cold end: their order follows mtime
        # and they rank below every block this process has used. Only as many as fit below the
        # limit: the others are another process's files, counted against its own capacity, and
        # indexing them would count this tier past its bound (or evict its own blocks for them).
        added = 0
        for _mtime, key, size in reversed(new):
            if self.used + size > self.limit:
                break
            entries[key] = Entry(size, 0)
            entries.move_to_end(key, last=False)
            self.used += size
            added += 1
        return added, forgotten
