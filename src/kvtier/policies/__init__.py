"""Eviction policies and the admission filter."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.segmented import SegmentedPolicy


class EvictionKind(Enum):
    LRU = "lru"
    ARC = "arc"
    SEGMENTED = "segmented"


DEFAULT_EVICTION = EvictionKind.SEGMENTED
"""The default policy: above LRU and ARC at every pool size measured (docs/policies.md)."""

_FACTORIES: dict[EvictionKind, Callable[[int], EvictionPolicy]] = {
    EvictionKind.LRU: lambda capacity: LRUPolicy(),
    EvictionKind.ARC: ARCPolicy,
    EvictionKind.SEGMENTED: SegmentedPolicy,
}


def make_policy(kind: EvictionKind, capacity_blocks: int) -> EvictionPolicy:
    """A new policy of ``kind`` for a pool of ``capacity_blocks`` blocks."""
    factory = _FACTORIES.get(kind)
    if factory is None:
        # An enum member without a factory must fail loudly, not quietly become LRU.
        raise ValueError(f"no eviction policy implements {kind!r}")
    return factory(capacity_blocks)


__all__ = [
    "DEFAULT_EVICTION",
    "ARCPolicy",
    "EvictionKind",
    "EvictionPolicy",
    "LRUPolicy",
    "SegmentedPolicy",
    "make_policy",
]
