"""Segments of a policy (``segmented``'s base with its options; taking the oldest unpinned keys of
a segment) and the ghost history of evicted keys (``segmented``, ``hinted``)."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Container, Iterable
from itertools import filterfalse, islice, repeat
from typing import ClassVar, TypeVar

from kvtier.keys import BlockKey
from kvtier.policies.base import EvictionPolicy

V = TypeVar("V")

PROBATION_FRACTION = 0.05
GHOST_FACTOR = 4.0


def segment_sizes(
    policy: str, capacity: int, probation_fraction: float, ghost_factor: float
) -> tuple[int, int]:
    """(probation target, ghost capacity) in keys for a pool of ``capacity`` blocks; a
    ``ValueError`` naming the bad option (and ``policy``, for a bad capacity) otherwise."""
    if capacity <= 0:
        raise ValueError(f"{policy} policy capacity must be positive, got {capacity}")
    if not 0.0 < probation_fraction < 1.0:
        raise ValueError(f"probation_fraction must be in (0, 1), got {probation_fraction}")
    if ghost_factor < 0.0:
        raise ValueError(f"ghost_factor must be >= 0, got {ghost_factor}")
    return max(1, int(probation_fraction * capacity)), int(ghost_factor * capacity)


class SegmentedBase(EvictionPolicy):
    """Probation, protected and the ghost history, sized from the options. A subclass sets up
    what it adds in ``_setup`` (called last by ``__init__``)."""

    kind: ClassVar[str] = "segmented"
    """The policy's name in errors."""

    @classmethod
    def create(cls, capacity_blocks: int) -> SegmentedBase:
        return cls(capacity_blocks)

    def __init__(
        self,
        capacity: int,
        probation_fraction: float = PROBATION_FRACTION,
        ghost_factor: float = GHOST_FACTOR,
    ) -> None:
        sizes = segment_sizes(self.kind, capacity, probation_fraction, ghost_factor)
        self.capacity = capacity
        self.probation_target, self.ghost_capacity = sizes
        # Oldest first in each (OrderedDict: popping from the front of a dict leaves tombstones).
        self._probation: OrderedDict[BlockKey, None] = OrderedDict()
        self._protected: OrderedDict[BlockKey, None] = OrderedDict()
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()
        self._setup()

    def _setup(self) -> None:
        """A subclass's own state (none here)."""


def drain(calls: Iterable[object]) -> None:
    """Run a lazy ``map`` of calls to its end in C, results dropped: a store's eviction and a
    request's hint touch hundreds of keys, where a Python loop costs a step per key."""
    deque(calls, maxlen=0)


def oldest_unpinned(
    order: Iterable[BlockKey], n: int, pinned: Container[BlockKey]
) -> list[BlockKey]:
    """Up to ``n`` keys of ``order`` (a segment, oldest first) not in ``pinned``; the segment is
    unchanged."""
    # In C, not a loop per key: a store's eviction takes hundreds.
    return list(islice(filterfalse(pinned.__contains__, order), max(0, n)))


def take(
    order: OrderedDict[BlockKey, V],
    n: int,
    pinned: Container[BlockKey],
    victims: list[BlockKey],
) -> None:
    """Move up to ``n`` unpinned keys, oldest first, from ``order`` to ``victims``."""
    take_keys(order, oldest_unpinned(order, n, pinned), victims)


def take_keys(
    order: OrderedDict[BlockKey, V], keys: list[BlockKey], victims: list[BlockKey]
) -> None:
    """Move ``keys`` (in ``order``) from it to ``victims``."""
    drain(map(order.__delitem__, keys))
    victims.extend(keys)


def remember_evicted(
    ghost: OrderedDict[BlockKey, None], victims: list[BlockKey], capacity: int
) -> None:
    """Add ``victims`` to the ghost history, forgetting the oldest keys beyond ``capacity``
    (0: no history)."""
    if capacity:
        # In C: a store's eviction remembers hundreds of keys. A key already there keeps its
        # place (an assignment, as ``update`` makes), and the oldest go.
        ghost.update(zip(victims, repeat(None)))
        over = len(ghost) - capacity
        if over > 0:
            drain(map(ghost.__delitem__, list(islice(ghost, over))))
