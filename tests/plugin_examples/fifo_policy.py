"""An eviction policy outside kvtier: first in, first out (a hit does not protect a block).

Written against ``EvictionPolicy.create(capacity_blocks)``, the one call that builds a policy: the
default builds ``cls()``; this one keeps the capacity, so it says how it is built."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container

from kvtier.keys import BlockKey
from kvtier.policies.base import EvictionPolicy


class FifoPolicy(EvictionPolicy):
    @classmethod
    def create(cls, capacity_blocks: int) -> FifoPolicy:
        return cls(capacity_blocks)

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._order: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey) -> None:
        self._order[key] = None

    def access(self, key: BlockKey) -> None:
        pass  # the difference from LRU: order of insertion only

    def remove(self, key: BlockKey) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        victims = [key for key in self._order if key not in pinned][: max(0, n)]
        for key in victims:
            del self._order[key]
        return victims

    def coldest(self, n: int) -> list[BlockKey]:
        return list(self._order)[: max(0, n)]

    def __len__(self) -> int:
        return len(self._order)


class NotAPolicy:
    """Has the methods' names but not the base class: refused by the registry."""
