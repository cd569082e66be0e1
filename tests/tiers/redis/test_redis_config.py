"""The redis tier built from a kvtier config, as an engine adapter builds it."""

from __future__ import annotations

import pytest
from support.blocks import payload_for
from support.redis_servers import RedisServer

from kvtier.cache.factory import build_cache
from kvtier.config import parse_config
from kvtier.errors import ConfigError
from kvtier.keys import Namespace, chain_keys
from kvtier.tiers.redis.tier import Options, RedisTier

pytestmark = pytest.mark.redis


def test_config_builds_a_working_redis_tier(server: RedisServer, namespace: Namespace) -> None:
    config = parse_config(
        {
            "pool": {"size": "4MiB"},
            "tiers": [
                {"kind": "redis", "name": "shared", "url": server.url(), "ttl_s": 600},
            ],
        }
    )
    options = config.tiers[0].options
    assert isinstance(options, Options)
    assert options.config_path == "tiers[0]" and options.ttl_s == 600
    pool, cache = build_cache(config, namespace, slot_bytes=256 * 1024)
    try:
        keys = chain_keys(namespace, list(range(16 * 4)))
        reservation = cache.prepare_store(keys)
        for key, slot in zip(reservation.keys, reservation.slots, strict=True):
            pool.view(slot)[:] = payload_for(key, pool.slot_bytes)
        cache.complete_store(reservation.keys)
        deadline = 200
        while cache.jobs_in_flight and deadline:
            cache.step()
            cache.wait(0.05)
            deadline -= 1
        stats = cache.stats().tiers["shared"]
        assert stats.write_blocks == 4 and stats.errors == 0
        assert int(server.cli("dbsize")) == 4
    finally:
        cache.close()
        pool.close()


def test_config_errors_name_the_tier_field(server: RedisServer) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": [{"kind": "redis", "url": server.url(), "ttl": 5}]})
    assert info.value.field == "tiers[0].ttl"
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": [{"kind": "redis", "url": "redis://u:secret@h", "password": "x"}]})
    assert info.value.field == "tiers[0].password"
    assert "secret" not in str(info.value)


def test_tier_class_from_registry_is_ours() -> None:
    from kvtier.tiers import tier_class

    assert tier_class("redis") is RedisTier
