"""Eviction policies and the admission filter."""

from __future__ import annotations

from enum import Enum

from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.lru import LRUPolicy


class EvictionKind(Enum):
    LRU = "lru"
    ARC = "arc"


def make_policy(kind: EvictionKind, capacity_blocks: int) -> EvictionPolicy:
    if kind is EvictionKind.ARC:
        return ARCPolicy(capacity_blocks)
    return LRUPolicy()


__all__ = ["ARCPolicy", "EvictionKind", "EvictionPolicy", "LRUPolicy", "make_policy"]
