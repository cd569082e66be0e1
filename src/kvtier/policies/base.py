"""The eviction-policy interface.

A policy orders the keys that are visible in the pool. The manager tells it what happened
(``insert``, ``access``, ``remove``) and asks it for victims; it never evicts on its own.

A policy is built by ``create(capacity_blocks)``, the one call ``make_policy`` makes for every
policy, built-in or a plugin: the default builds ``cls()``; a policy that sizes itself by the
capacity overrides it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Sequence

from kvtier.keys import BlockKey
from kvtier.policies.hints import RequestHint


class EvictionPolicy(ABC):
    @classmethod
    def create(cls, capacity_blocks: int) -> EvictionPolicy:
        """A new policy for a pool (or a tier) of ``capacity_blocks`` blocks: ``cls()`` unless
        overridden."""
        return cls()

    @abstractmethod
    def insert(self, key: BlockKey) -> None:
        """A key became visible in the pool (it must not be tracked already)."""

    @abstractmethod
    def access(self, key: BlockKey) -> None:
        """A tracked key was hit or touched."""

    @abstractmethod
    def remove(self, key: BlockKey) -> None:
        """A tracked key left the pool for a reason other than eviction (no-op if untracked)."""

    @abstractmethod
    def evict(self, n: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        """Choose up to ``n`` victims that are not in ``pinned``, stop tracking them, return them.

        Fewer than ``n`` only when fewer unpinned keys are tracked.
        """

    @abstractmethod
    def coldest(self, n: int) -> list[BlockKey]:
        """Up to ``n`` keys in the order they would be evicted, pins ignored; nothing changes."""

    def insert_many(self, keys: Sequence[BlockKey]) -> None:
        """``insert`` of each key in turn (a store or a promotion lands a run of blocks).
        Optional: a policy may do it in one pass, deciding exactly as the loop would."""
        for key in keys:
            self.insert(key)

    def access_many(self, keys: Sequence[BlockKey]) -> None:
        """``access`` of each key in turn (a lookup or a store touches a request's run).
        Optional, as ``insert_many``."""
        for key in keys:
            self.access(key)

    def admit_store(self, n: int, free: int) -> int:
        """How many of ``n`` new blocks (the leading ones) a store may bring into a pool that
        has ``free`` free slots; the rest are not stored. Optional: the default admits all.
        ``hinted`` refuses newcomers while its pool is under pressure (``policies/pressure.py``).
        """
        return n

    def on_request(self, keys: Sequence[BlockKey], hint: RequestHint) -> None:
        """A request with these blocks (in order) was served; ``hint`` says what the engine knows
        of it. Optional: the default ignores it, and a policy must work when it never comes."""
        return None

    @abstractmethod
    def __len__(self) -> int: ...
