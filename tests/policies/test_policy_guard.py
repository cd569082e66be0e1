"""An eviction policy from outside kvtier that raises or answers nonsense: the pool keeps working
(``GuardedPolicy``), every failure is counted, and no pinned or unknown block is ever evicted.
kvtier's own policies are not wrapped: they are on the hot path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from plugin_examples.hostile import HostilePolicy

from kvtier.cache.manager import TierBinding, TieredCache
from kvtier.keys import BlockKey, Namespace
from kvtier.policies import POLICIES, GuardedPolicy, make_policy
from kvtier.policies.hints import RequestHint
from kvtier.pool import HostPool
from kvtier.tiers.base import WriteMode
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.memory import Options as MemoryOptions

HOSTILE = "plugin_examples.hostile:HostilePolicy"
SLOTS = 4


def keys(start: int, n: int) -> list[BlockKey]:
    return [i.to_bytes(16, "little") for i in range(start, start + n)]


def store(cache: TieredCache, pool: HostPool, batch: list[BlockKey]) -> list[BlockKey]:
    reservation = cache.prepare_store(batch)
    for key, slot in zip(reservation.keys, reservation.slots, strict=True):
        pool.view(slot)[:] = key * (pool.slot_bytes // len(key))
    cache.complete_store(reservation.keys)
    return reservation.keys


@pytest.fixture
def guarded(make_pool: Callable[..., HostPool]) -> tuple[HostPool, TieredCache, GuardedPolicy]:
    pool = make_pool(SLOTS, 64)
    policy: Any = make_policy(HOSTILE, SLOTS)
    return pool, TieredCache(pool, policy, writeback_window=2), policy


def hostile(policy: Any) -> HostilePolicy:
    inner = policy.policy if isinstance(policy, GuardedPolicy) else policy
    assert isinstance(inner, HostilePolicy)
    return inner


def test_a_plugin_policy_is_guarded_and_kvtier_policies_run_unwrapped() -> None:
    policy = make_policy(HOSTILE, SLOTS)
    assert isinstance(policy, GuardedPolicy) and isinstance(policy.policy, HostilePolicy)
    for name in POLICIES.names():
        assert not isinstance(make_policy(name, 8), GuardedPolicy), name


@pytest.mark.parametrize(
    "methods",
    [
        {"evict"},
        {"insert", "access", "remove", "evict", "coldest", "on_request", "len"},
    ],
    ids=["evict", "everything"],
)
def test_a_policy_that_raises_leaves_the_pool_working(
    guarded: tuple[HostPool, TieredCache, GuardedPolicy], methods: set[str]
) -> None:
    """Without the guard: ``RuntimeError: hostile evict`` out of ``prepare_store``."""
    pool, cache, policy = guarded
    hostile(policy).fail = methods
    for start in range(0, 40, 2):
        assert store(cache, pool, keys(start, 2)) == keys(start, 2)  # room made all the same
        cache.touch(keys(start, 1))
        cache.hint_request(keys(start, 2), RequestHint(0, 4))
        cache.step()
        assert cache.lookup(keys(start, 2)).hits == 2
    assert policy.errors > 0 and len(policy) == SLOTS
    cache.check_invariants()


EVICT_ANSWERS: dict[str, Callable[[HostilePolicy, int], Any]] = {
    "None": lambda p, n: None,
    "a generator": lambda p, n: (k for k in p.lru.coldest(n)),
    "unknown keys": lambda p, n: keys(10_000, n),
    "unhashable": lambda p, n: [[1, 2]] * n,
    "duplicates": lambda p, n: p.lru.coldest(1) * (n + 3),
    "too many": lambda p, n: p.lru.coldest(SLOTS),
    "pinned ones": lambda p, n: p.lru.coldest(SLOTS),  # the test pins the coldest
    "nothing": lambda p, n: [],
}


@pytest.mark.parametrize("answer", list(EVICT_ANSWERS))
def test_nonsense_victims_never_evict_a_pinned_or_unknown_block(
    guarded: tuple[HostPool, TieredCache, GuardedPolicy], answer: str
) -> None:
    """Without the guard: ``TypeError`` or ``KeyError`` out of ``prepare_store``, or a pinned
    block evicted while the engine loads it."""
    pool, cache, policy = guarded
    hostile(policy).evict_answer = EVICT_ANSWERS[answer]
    store(cache, pool, keys(0, SLOTS))
    pinned = keys(0, 2)
    slots = cache.prepare_load(pinned)  # being loaded: never a victim
    for start in range(100, 120):
        assert store(cache, pool, keys(start, 1)) == keys(start, 1)
        cache.check_invariants()
    assert cache.lookup(pinned).hits == 2
    for key, slot in zip(pinned, slots, strict=True):
        assert bytes(pool.view(slot)) == key * (pool.slot_bytes // 16)
    cache.complete_load(pinned)
    assert len(policy) == SLOTS


@pytest.mark.parametrize(
    "coldest", [lambda p, n: None, lambda p, n: [[0]], lambda p, n: keys(5_000, n)]
)
def test_nonsense_coldest_keys_do_not_reach_write_back(
    ns: Namespace, make_pool: Callable[..., HostPool], coldest: Callable[[HostilePolicy, int], Any]
) -> None:
    """Without the guard: ``TypeError: unhashable type`` out of ``step()``, or a write-back
    copy of keys the pool does not hold."""
    pool = make_pool(SLOTS, 64)
    policy = make_policy(HOSTILE, SLOTS)
    hostile(policy).coldest_answer = coldest
    tier = MemoryTier("mem", ns, pool, MemoryOptions(capacity=1 << 20))
    cache = TieredCache(
        pool, policy, [TierBinding(tier, WriteMode.ON_EVICT)], writeback_window=SLOTS
    )
    try:
        for start in range(0, 12):
            store(cache, pool, keys(start, 1))
            cache.step()
        cache.wait(5.0)
        cache.check_invariants()
    finally:
        cache.close()
