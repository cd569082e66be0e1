"""Counted pins of ``TieredCache``: visible keys being read (loads, copies to tiers) and slots
held by jobs after their key left the pool. Loops here, not a call per key: a request's
promoted blocks, a write job's and a promotion's protected hits are hundreds."""

from __future__ import annotations

from collections.abc import Iterable

from kvtier.keys import BlockKey


def unpin_all(pins: dict[BlockKey, int], keys: Iterable[BlockKey]) -> None:
    """Drop one pin of each key."""
    for key in keys:
        count = pins.get(key, 0)
        if count == 1:
            del pins[key]
        elif count > 1:
            pins[key] = count - 1


def release_held(held: dict[int, int], slots: Iterable[int]) -> list[int]:
    """A job that held ``slots`` ended: the slots no other job holds (to free)."""
    free: list[int] = []
    for slot in slots:
        count = held.get(slot, 0)
        if count <= 1:
            held.pop(slot, None)
            free.append(slot)
        else:
            held[slot] = count - 1
    return free
