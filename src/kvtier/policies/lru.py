"""Least-recently-used eviction."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Container

from kvtier.keys import BlockKey
from kvtier.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    kind = "lru"

    def __init__(self) -> None:
        # Oldest first. OrderedDict, not dict: popping from the front of a plain dict leaves
        # tombstones that make the next scan from the front slower and slower.
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey) -> None:
        self._order[key] = None

    def access(self, key: BlockKey) -> None:
        self._order.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        victims: list[BlockKey] = []
        if n <= 0:
            return victims
        for key in self._order:
            if key not in pinned:
                victims.append(key)
                if len(victims) == n:
                    break
        order = self._order
        for key in victims:
            del order[key]
        return victims

    def coldest(self, n: int) -> list[BlockKey]:
        return list(itertools.islice(self._order, n))

    def __len__(self) -> int:
        return len(self._order)
