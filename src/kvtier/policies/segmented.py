"""Segmented LRU with a long ghost history: frequency without counters.

Most prefix blocks are never used again (on the bundled trace 26k of 44k distinct blocks are used
once), while a block used twice is used again with a probability near 0.8: a conversation that
came back once tends to come back. So a new block enters a small *probation* segment, and only a
block used a second time (a hit while in probation, or a store of a key remembered in the ghost
history after its eviction) enters the *protected* segment, which gets the rest of the pool.
Victims come from probation while it is above its target size, then from protected; each segment
is least-recently-used first.

The ghost history remembers evicted keys (only keys, ``ghost_factor`` times the capacity, oldest
forgotten first). It must be long: a conversation's next turn typically arrives after several
hundred other requests, far beyond what the pool itself remembers.

Parameters were chosen on the bundled trace (docs/policies.md has the sweep): probation 5% of the
capacity, ghost 4x. An ARC-like rule that moves the probation target on ghost hits did worse at
every capacity and is not used.
"""

from __future__ import annotations

import itertools
from collections.abc import Container

from kvtier.keys import BlockKey
from kvtier.policies.segments import SegmentedBase, remember_evicted
from kvtier.policies.segments import take as _take


class SegmentedPolicy(SegmentedBase):
    """Options and segments: ``SegmentedBase`` (``policies/segments.py``, with the defaults,
    ``PROBATION_FRACTION`` and ``GHOST_FACTOR``)."""

    kind = "segmented"

    def insert(self, key: BlockKey) -> None:
        ghost = self._ghost
        if key in ghost:
            # Stored again after an eviction: its second use, so it is protected.
            del ghost[key]
            self._protected[key] = None
        else:
            self._probation[key] = None

    def access(self, key: BlockKey) -> None:
        probation = self._probation
        if key in probation:
            del probation[key]
            self._protected[key] = None
        else:
            self._protected.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        if key in self._probation:
            del self._probation[key]
        else:
            self._protected.pop(key, None)

    def evict(self, n: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        victims: list[BlockKey] = []
        if n <= 0:
            return victims
        probation, protected = self._probation, self._protected
        # Probation gives victims down to its target; protected the rest; whichever is left
        # when the other has only pinned keys.
        surplus = max(0, len(probation) - self.probation_target)
        if surplus:
            _take(probation, min(n, surplus), pinned, victims)
        if len(victims) < n:
            _take(protected, n - len(victims), pinned, victims)
        if len(victims) < n:
            _take(probation, n - len(victims), pinned, victims)
        remember_evicted(self._ghost, victims, self.ghost_capacity)
        return victims

    def coldest(self, n: int) -> list[BlockKey]:
        # evict's order when nothing is pinned: the probation surplus, protected, the rest.
        surplus = max(0, len(self._probation) - self.probation_target)
        head = list(itertools.islice(self._probation, min(n, surplus)))
        rest = itertools.chain(self._protected, itertools.islice(self._probation, surplus, None))
        return head + list(itertools.islice(rest, n - len(head)))

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)
