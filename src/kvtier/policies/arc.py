"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003).

Two resident lists, T1 (seen once recently) and T2 (seen at least twice), and two ghost lists, B1
and B2, remembering keys recently evicted from each. A hit in a ghost list moves the target size
``p`` of T1 towards the list that would have kept it, so the policy adapts between recency and
frequency. Pinned keys are skipped when choosing victims.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Container

from kvtier.keys import BlockKey
from kvtier.policies.base import EvictionPolicy


class ARCPolicy(EvictionPolicy):
    kind = "arc"

    @classmethod
    def create(cls, capacity_blocks: int) -> ARCPolicy:
        return cls(capacity_blocks)

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"ARC capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.p = 0.0
        self._t1: OrderedDict[BlockKey, None] = OrderedDict()
        self._t2: OrderedDict[BlockKey, None] = OrderedDict()
        self._b1: OrderedDict[BlockKey, None] = OrderedDict()
        self._b2: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey) -> None:
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.p = min(float(self.capacity), self.p + max(len(b2) / len(b1), 1.0))
            del b1[key]
            self._t2[key] = None
        elif key in b2:
            self.p = max(0.0, self.p - max(len(b1) / len(b2), 1.0))
            del b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
        self._trim_ghosts()

    def access(self, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t2[key] = None
        else:
            self._t2.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        if key in self._t1:
            del self._t1[key]
        else:
            self._t2.pop(key, None)

    def evict(self, n: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        victims: list[BlockKey] = []
        while len(victims) < n:
            prefer_t1 = len(self._t1) > 0 and len(self._t1) > self.p
            first, second = (self._t1, self._t2) if prefer_t1 else (self._t2, self._t1)
            key = _oldest_unpinned(first, pinned)
            if key is None:
                first, second = second, first
                key = _oldest_unpinned(first, pinned)
                if key is None:
                    break
            del first[key]
            ghost = self._b1 if first is self._t1 else self._b2
            ghost[key] = None
            victims.append(key)
        self._trim_ghosts()
        return victims

    def coldest(self, n: int) -> list[BlockKey]:
        # Approximates ``evict``'s order: the list it prefers now first, then the other.
        prefer_t1 = len(self._t1) > self.p
        first, second = (self._t1, self._t2) if prefer_t1 else (self._t2, self._t1)
        return list(itertools.islice(itertools.chain(first, second), n))

    def _trim_ghosts(self) -> None:
        # Keep |T1| + |B1| <= c and the whole directory <= 2c, as in the paper.
        c = self.capacity
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self._t1) + len(self._t2) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


def _oldest_unpinned(
    order: OrderedDict[BlockKey, None], pinned: Container[BlockKey]
) -> BlockKey | None:
    for key in order:
        if key not in pinned:
            return key
    return None
