"""``TieredCache.origins``: the tier each pool block came from (engine hit metrics split by it)."""

from __future__ import annotations

from support.blocks import keys_for
from support.scripted_tier import ScriptedTier

from kvtier.cache.manager import TierBinding, TieredCache
from kvtier.policies import LRUPolicy
from kvtier.tiers.base import WriteMode


def _store(cache: TieredCache, keys: list[bytes]) -> None:
    res = cache.prepare_store(keys)
    cache.complete_store(res.keys)


def test_origins_name_the_promoting_tier_until_the_block_leaves_the_pool(ns, make_pool):
    pool = make_pool(4)
    fast = ScriptedTier("fast", ns, pool)
    slow = ScriptedTier("slow", ns, pool)
    cache = TieredCache(
        pool,
        LRUPolicy(),
        [TierBinding(fast, WriteMode.THROUGH), TierBinding(slow, WriteMode.THROUGH)],
        copy_share=2.0,
    )
    a, b = keys_for(ns, 2), keys_for(ns, 2, seed=5)
    _store(cache, a)
    fast.release()
    slow.release()
    cache.step()
    del fast.stored[a[1]]  # only the slow tier keeps the second block
    assert cache.origins(a) == ["pool", "pool"]  # stored by the engine

    _store(cache, keys_for(ns, 4, seed=9))  # evicts a
    for tier in (fast, slow):
        tier.release()
    cache.step()
    assert cache.lookup(a) == (0, False)
    fast.release()
    slow.release()
    cache.step()
    assert cache.lookup(a) == (2, True)
    assert cache.origins(a) == ["fast", "slow"]
    assert cache.origins(b) == ["pool", "pool"]  # not in the pool at all

    # Evicted, then stored again by the engine: its origin is the pool again.
    _store(cache, keys_for(ns, 4, seed=11))
    fast.release()
    slow.release()
    cache.step()
    assert cache.lookup(a[:1]) == (0, False)  # promoting again; drop that answer
    fast.release()
    cache.step()
    _store(cache, keys_for(ns, 4, seed=12))  # evicts everything again
    fast.release()
    slow.release()
    cache.step()
    fast.stored.clear()
    slow.stored.clear()
    _store(cache, a)
    assert cache.origins(a) == ["pool", "pool"]
