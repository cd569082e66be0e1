"""Two engine instances (two ``TieredCache`` managers, separate pools) share prefixes through
one Redis: the second finds, promotes and loads bit-exact what the first stored."""

from __future__ import annotations

import time

import pytest
from support.blocks import payload_for
from support.redis_servers import RedisServer
from support.redis_tier import make_tier

from kvtier.cache.manager import TierBinding, TieredCache
from kvtier.keys import Namespace, chain_keys
from kvtier.policies import LRUPolicy
from kvtier.pool import HostPool
from kvtier.tiers.base import WriteMode

pytestmark = pytest.mark.redis
DEADLINE_S = 15.0


def _lookup_final(cache: TieredCache, keys: list[bytes]) -> int:
    end = time.monotonic() + DEADLINE_S
    while True:
        result = cache.lookup(keys)
        if result.final:
            return result.hits
        assert time.monotonic() < end, "lookup never became final"
        cache.step()
        time.sleep(0.002)


def _drain(cache: TieredCache) -> None:
    end = time.monotonic() + DEADLINE_S
    while cache.jobs_in_flight:
        assert time.monotonic() < end, "jobs never finished"
        cache.step()
        time.sleep(0.002)


@pytest.mark.parametrize("mode", [WriteMode.THROUGH, WriteMode.ON_EVICT])
def test_second_engine_reuses_the_first_engines_prefix(
    server: RedisServer, pool: HostPool, pool_b: HostPool, namespace: Namespace, mode: WriteMode
) -> None:
    tier_a = make_tier(pool, namespace, name="shared", url=server.url())
    tier_b = make_tier(pool_b, namespace, name="shared", url=server.url())
    engine_a = TieredCache(pool, LRUPolicy(), [TierBinding(tier_a, mode)])
    engine_b = TieredCache(pool_b, LRUPolicy(), [TierBinding(tier_b, mode)])
    try:
        prompt = list(range(1000, 1000 + 16 * 12))
        keys = chain_keys(namespace, prompt)
        assert len(keys) == 12

        # Engine A computes the prompt's KV and stores it.
        reservation = engine_a.prepare_store(keys)
        assert reservation.keys == keys
        for key, slot in zip(reservation.keys, reservation.slots, strict=True):
            pool.view(slot)[:] = payload_for(key, pool.slot_bytes)
        engine_a.complete_store(reservation.keys)
        if mode is WriteMode.ON_EVICT:
            # Fill A's pool with other blocks so the prompt's blocks are evicted to Redis.
            other = chain_keys(namespace, list(range(10**6, 10**6 + 16 * pool.num_slots)))
            for start in range(0, len(other), 8):
                filler = engine_a.prepare_store(other[start : start + 8])
                engine_a.complete_store(filler.keys)
                engine_a.step()
        _drain(engine_a)
        assert tier_a.counters.write_blocks >= 12

        # Engine B sees the same prompt: pending while Redis is asked, then all 12 blocks.
        assert _lookup_final(engine_b, keys) == 12
        slots = engine_b.prepare_load(keys)
        assert len(slots) == 12
        for key, slot in zip(keys, slots, strict=True):
            assert bytes(pool_b.view(slot)) == payload_for(key, pool_b.slot_bytes)
        engine_b.complete_load(keys)
        stats = engine_b.stats()
        assert stats.cache.promoted_blocks >= 12 or stats.cache.promotions >= 12
        assert stats.tiers["shared"].read_blocks == 12
        assert stats.tiers["shared"].corrupt == 0
    finally:
        engine_a.close()
        engine_b.close()


def test_engine_goes_on_without_a_dead_redis(
    server: RedisServer, pool: HostPool, namespace: Namespace
) -> None:
    tier = make_tier(pool, namespace, url=server.url(), timeout_s=0.5)
    engine = TieredCache(pool, LRUPolicy(), [TierBinding(tier)])
    try:
        server.kill()
        keys = chain_keys(namespace, list(range(16 * 4)))
        reservation = engine.prepare_store(keys)
        engine.complete_store(reservation.keys)
        _drain(engine)
        # Lookups are final at once (the tier answers False while unhealthy): the pool's hits.
        started = time.monotonic()
        assert _lookup_final(engine, keys) == 4
        other = chain_keys(namespace, list(range(5000, 5000 + 16 * 4)))
        assert _lookup_final(engine, other) == 0
        assert time.monotonic() - started < 2
    finally:
        engine.close()
