"""Plugins that break their contract, for the tests of kvtier's plugin boundary: classes that
cannot be built, and a tier and a policy whose every call can be made to fail or to answer
nonsense."""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from kvtier.keys import BlockKey
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.lru import LRUPolicy
from plugin_examples.dict_tier import DictTier


class TierWithoutOptions(DictTier):
    """Has no ``Options`` of its own and its module has none: nothing can parse its section."""

    Options = None  # type: ignore[assignment]


class FailingOptions:
    @classmethod
    def parse(cls, section: Any) -> FailingOptions:
        raise RuntimeError("cannot read my own options")


class TierWithFailingOptions(DictTier):
    Options = FailingOptions  # type: ignore[assignment]


class TierFailingToBuild(DictTier):
    def __init__(self, *args: Any) -> None:
        raise RuntimeError("cannot connect to the moon")


class TierWithoutCounters(DictTier):
    """Forgets to call the base constructor: no name, no counters."""

    def __init__(self, *args: Any) -> None:
        pass


class PolicyFailingToBuild(LRUPolicy):
    @classmethod
    def create(cls, capacity_blocks: int) -> PolicyFailingToBuild:
        raise SystemExit(3)


class HostilePolicy(EvictionPolicy):
    """An LRU whose answers a test can replace: ``fail`` names the methods that raise,
    ``evict_answer`` / ``coldest_answer`` replace what ``evict`` / ``coldest`` return."""

    def __init__(self) -> None:
        self.lru = LRUPolicy()
        self.fail: set[str] = set()
        self.evict_answer: Any = None
        self.coldest_answer: Any = None

    def _maybe_fail(self, method: str) -> None:
        if method in self.fail:
            raise RuntimeError(f"hostile {method}")

    def insert(self, key: BlockKey) -> None:
        self._maybe_fail("insert")
        self.lru.insert(key)

    def access(self, key: BlockKey) -> None:
        self._maybe_fail("access")
        self.lru.access(key)

    def remove(self, key: BlockKey) -> None:
        self._maybe_fail("remove")
        self.lru.remove(key)

    def evict(self, n: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        self._maybe_fail("evict")
        if self.evict_answer is not None:
            answer: list[BlockKey] = self.evict_answer(self, n)
            return answer
        return self.lru.evict(n, pinned)

    def coldest(self, n: int) -> list[BlockKey]:
        self._maybe_fail("coldest")
        if self.coldest_answer is not None:
            answer: list[BlockKey] = self.coldest_answer(self, n)
            return answer
        return self.lru.coldest(n)

    def on_request(self, keys: Any, hint: Any) -> None:
        self._maybe_fail("on_request")

    def __len__(self) -> int:
        self._maybe_fail("len")
        return len(self.lru)
