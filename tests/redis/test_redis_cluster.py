"""The redis tier on a 3-node Redis Cluster on loopback ports."""

from __future__ import annotations

import pytest
from redis_helpers import Driver, make_keys, make_tier
from redis_servers import RedisCluster

from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.pool import HostPool

pytestmark = pytest.mark.redis


def test_cluster_round_trip_spreads_keys(
    cluster: RedisCluster, pool: HostPool, pool_b: HostPool, namespace: Namespace
) -> None:
    a = make_tier(pool, namespace, url=cluster.url, cluster=True, pipeline_blocks=8)
    b = make_tier(pool_b, namespace, url=cluster.url, cluster=True, pipeline_blocks=5)
    try:
        assert a.healthy and b.healthy
        keys = make_keys(30, "cluster")
        assert Driver(a).store(keys) == [True] * 30
        assert Driver(b).lookup(keys) == [True] * 30
        assert Driver(b).load_exact(keys, first_slot=30) == [True] * 30
        # No hash tag: blocks land on every node, one pipeline split per node.
        sizes = [int(s.cli("dbsize")) for s in cluster.servers]
        assert all(size > 0 for size in sizes), sizes
        assert sum(sizes) >= 30
    finally:
        a.close()
        b.close()


def test_cluster_corruption_and_isolation(
    cluster: RedisCluster, pool: HostPool, pool_b: HostPool, namespace: Namespace
) -> None:
    other = Namespace(
        model=namespace.model,
        dtype=namespace.dtype,
        block_tokens=namespace.block_tokens,
        tenant="someone-else",
    )
    a = make_tier(pool, namespace, url=cluster.url, cluster=True)
    b = make_tier(pool_b, other, url=cluster.url, cluster=True)
    try:
        keys = make_keys(6, "cluster-iso")
        assert Driver(a).store(keys) == [True] * 6
        assert Driver(b).lookup(keys) == [False] * 6
        assert Driver(b).load_exact(keys) == [False] * 6
        rkey = a.redis_key(keys[0]).decode()
        for server in cluster.servers:
            if server.cli("exists", rkey) == "1":
                raw = server.client()
                old = raw.getrange(rkey, 100, 100)
                assert isinstance(old, bytes)
                raw.setrange(rkey, 100, bytes([old[0] ^ 0xFF]))
                raw.close()
        assert Driver(a).load_exact(keys, first_slot=10) == [False] + [True] * 5
        assert a.counters.corrupt == 1
    finally:
        a.close()
        b.close()


def test_cluster_flag_must_match_the_server(
    cluster: RedisCluster, pool: HostPool, namespace: Namespace
) -> None:
    with pytest.raises(ConfigError) as info:
        make_tier(pool, namespace, url=cluster.url, cluster=False)
    assert info.value.field == "tiers[0].cluster"


def test_standalone_server_with_cluster_flag(
    make_server: object, pool: HostPool, namespace: Namespace
) -> None:
    srv = make_server()  # type: ignore[operator]
    with pytest.raises(ConfigError) as info:
        make_tier(pool, namespace, url=srv.url(), cluster=True)
    assert info.value.field == "tiers[0].cluster"
