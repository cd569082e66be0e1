"""The fs tier's index and capacity accounting: the blocks this process counts and the bytes they
and in-flight writes hold against the limit in force, ``min(capacity, used + free - min_free)``.

Which blocks to give up when room is needed is the tier's eviction policy's choice (an
``EvictionPolicy``, the tier's ``eviction`` option): the index tells it what happened (``insert``
on a commit and for the files of the first listing, oldest first; ``access`` on a read hit or a
store of a block already held; ``remove`` when a block is deleted or forgotten) and asks it for
victims, never one that is pinned (a job moves it now). Files that a rescan finds (another
process wrote them) are not this process's blocks yet: they wait in ``unused``, ordered by their
write time, and are evicted before anything the policy ranks; their first use here hands them to
the policy. With ``lru`` this is exactly one LRU order with the rescan's files at its cold end.

Every method runs under the tier's lock (the caller holds it) and touches no file: the tier
deletes victims' files outside the lock and settles the accounting afterwards. Victims leave the
index at once (so nobody reads them) but their bytes stay counted until their files are gone, so
disk use never exceeds the limit.

Several processes may share one directory: ``merge_scan`` folds in a listing of it (files others
wrote, files others deleted) without counting a file twice or past the limit. A file this process
cannot delete is forgotten, no longer counted and not indexed again (``undeletable``).

Whose files are deleted: a process deletes only files it wrote, and those of the first listing
(a restart inherits its own earlier files; it indexes the newest of them up to its capacity and
leaves the rest on disk, uncounted). A file a rescan found (``Entry.theirs``) stays another
process's, counted against that process's capacity, even once used here: when it is chosen to
make room or to get under the limit it is forgotten (uncounted, reported evicted, left on disk),
never deleted. So a process with a smaller capacity never deletes a larger one's files.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from kvtier.keys import BlockKey
from kvtier.policies.base import EvictionPolicy
from kvtier.tiers.eviction import victims_for
from kvtier.tiers.fs.files import Found

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
    theirs: bool = False
    """Found by a rescan: another process's file, forgotten rather than deleted."""


class FsIndex:
    """See the module docstring. ``pins``: keys a job moves now (never evicted), read live (the
    tier's pin counts, under the same lock); ``policy``: a new, empty eviction policy;
    ``forgotten``: told each key of another process's file that was forgotten to make room."""

    def __init__(
        self,
        capacity: int,
        pins: Collection[BlockKey],
        policy: EvictionPolicy,
        forgotten: Callable[[BlockKey], None] = lambda key: None,
    ) -> None:
        self.capacity = capacity
        self._pins = pins
        self.policy = policy
        self._forgotten = forgotten
        self.entries: dict[BlockKey, Entry] = {}
        """Every indexed block: those the policy ranks and those in ``unused``."""
        self.unused: OrderedDict[BlockKey, None] = OrderedDict()
        """Files a rescan found and this process has not used: the first victims, in order."""
        self.indexed = 0
        """Bytes of the indexed files."""
        self.largest = 0
        """The largest file ever indexed: ``need // largest`` victims never free too much."""
        self.used = 0
        """Bytes of indexed files + bytes reserved by in-flight writes (which include the files
        they are deleting to make room): the quantity kept <= ``limit``."""
        self.limit = capacity
        """``min(capacity, used + free - min_free)`` as last measured (``set_limit``)."""
        self.writing: set[BlockKey] = set()
        self.deleting: set[BlockKey] = set()
        self.seq = 0
        """Bumped by every commit."""
        self.changes = 0
        """Bumped after every change of ``entries`` (``FsTier.generation``)."""
        self.scans = 0
        """Rescans running; while any does, deleted keys are remembered in ``deleted``."""
        self.deleted: set[BlockKey] = set()
        """Keys deleted while a rescan ran: its listing may still show them."""
        self.undeletable: OrderedDict[BlockKey, None] = OrderedDict()
        """Keys whose file could not be removed: forgotten and not indexed again."""

    def __len__(self) -> int:
        return len(self.entries)

    def load(self, found: Iterable[Found]) -> None:
        """Index the newest files of a first listing that fit the capacity, handed to the policy
        oldest first, so the order after a restart follows the files' write times. The older
        ones are left on disk, uncounted: they may be another running process's."""
        newest_first = sorted(found, key=lambda item: item[2], reverse=True)
        kept = 0
        for _key, size, _mtime in newest_first:
            if self.used + size > self.capacity:
                break
            self.used += size
            kept += 1
        for key, size, _mtime in reversed(newest_first[:kept]):
            self._add(key, Entry(size, 0))
            self.policy.insert(key)

    def set_limit(self, free: int, min_free: int) -> None:
        self.limit = max(0, min(self.capacity, self.used + free - min_free))

    def touch(self, key: BlockKey) -> bool:
        """A read hit or a store of a block already held; False when it is not indexed."""
        if key not in self.entries:
            return False
        if key in self.unused:
            del self.unused[key]  # a rescan's file, used here for the first time
            self.policy.insert(key)
        else:
            self.policy.access(key)
        return True

    def busy(self, key: BlockKey) -> bool:
        """Another write or a deletion moves this key right now."""
        return key in self.writing or key in self.deleting

    # -- writes ---------------------------------------------------------------------------------

    def reserve(self, need: int) -> tuple[Victims, int] | None:
        """Claim ``need`` bytes, choosing unpinned victims when the free space (below ``limit``)
        is short. Returns (victims, bytes now reserved) or None, choosing none, when it cannot
        fit. The victims' bytes become part of the reservation."""
        free = self.limit - self.used
        if free >= need:
            self.used += need
            return [], need
        if free + self._unpinned_bytes() < need:
            return None
        victims = self._choose(need - free)
        free = self.limit - self.used  # the files of others it forgot are uncounted already
        freed = sum(size for _, size in victims)
        # Never past the limit, even when a policy gave fewer victims than it could: the write
        # then fails for want of room (its victims are deleted all the same).
        take = max(0, min(free, need - freed))
        self.used += take
        return victims, freed + take

    def commit(self, key: BlockKey, size: int, reserved: int) -> None:
        """A write of ``size`` bytes that had ``reserved`` bytes succeeded: index it."""
        old = self._pop(key)
        if old is not None:  # cannot happen today; keeps the accounting right if it does
            self.used -= old.size
        self.seq += 1
        self._add(key, Entry(size, self.seq))
        self.policy.insert(key)
        self.undeletable.pop(key, None)  # replaced by our own file
        self.used -= reserved - size

    # -- evictions and deletions ----------------------------------------------------------------

    def pick_victims(self, need: int) -> Victims:
        """Unpinned entries worth ``need`` bytes (fewer if there are not enough), out of the
        index; their bytes stay counted until they are deleted."""
        return self._choose(need)

    def over_limit_victims(self) -> Victims:
        """Unpinned entries to drop until the index fits the limit."""
        return self._choose(self.used - self.limit)

    def start_delete(self, key: BlockKey) -> Entry | None:
        """Take ``key`` out of the index for deletion (its bytes stay counted); None when it is
        not indexed."""
        entry = self._pop(key)
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
        entry = self._pop(key)
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

    # -- the entries and the policy -------------------------------------------------------------

    def _add(self, key: BlockKey, entry: Entry) -> None:
        """Index an entry (the caller tells the policy or puts it in ``unused``)."""
        self.entries[key] = entry
        self.indexed += entry.size
        self.largest = max(self.largest, entry.size)
        self.changes += 1

    def _pop(self, key: BlockKey) -> Entry | None:
        """Unindex ``key`` for a reason other than eviction (None when it is not indexed)."""
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.changes += 1
            self.indexed -= entry.size
            if key in self.unused:
                del self.unused[key]
            else:
                self.policy.remove(key)
        return entry

    def _unpinned_bytes(self) -> int:
        """Bytes of the indexed files that no job pins (all that eviction could free)."""
        entries = self.entries
        return self.indexed - sum(entries[key].size for key in self._pins if key in entries)

    def _choose(self, need: int) -> Victims:
        """Victims worth ``need`` bytes, out of the index (their bytes still counted, their keys
        in ``deleting``): the rescan's unused files first, then the policy's choice; fewer when
        not enough are unpinned. Another process's files among them are forgotten here, not
        returned (see the module docstring)."""
        pins, entries = self._pins, self.entries
        victims: Victims = []
        for key in self.unused:
            if need <= 0:
                break
            if key not in pins:
                victims.append((key, entries[key].size))
                need -= entries[key].size
        for key, _ in victims:
            del self.unused[key]
        chosen = victims_for(
            self.policy, pins, entries, lambda key: entries[key].size, self.largest, need
        )
        victims += [(key, entries[key].size) for key in chosen]
        own: Victims = []
        for key, size in victims:
            entry = entries.pop(key)
            self.indexed -= size
            if entry.theirs:
                self.used -= size
                self._forgotten(key)
            else:
                self.deleting.add(key)
                own.append((key, size))
        if victims:
            self.changes += 1
        return own

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
            if key not in self._pins:  # a running read finds out for itself
                self.used -= entries[key].size
                self._pop(key)
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
        # Newest of the newcomers first, each pushed to the front of ``unused``: their order
        # follows mtime and they go before every block this process has used. Only as many as
        # fit below the limit: the others are another process's files, counted against its own
        # capacity, and indexing them would count this tier past its bound (or evict its own
        # blocks for them).
        added = 0
        for _mtime, key, size in reversed(new):
            if self.used + size > self.limit:
                break
            self._add(key, Entry(size, 0, theirs=True))
            self.unused[key] = None
            self.unused.move_to_end(key, last=False)
            self.used += size
            added += 1
        return added, forgotten
