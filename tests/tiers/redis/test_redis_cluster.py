"""The redis tier on a 3-node Redis Cluster on loopback ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from support import require
from support.blocks import make_keys
from support.drivers import Driver, wait_for
from support.redis_servers import RedisCluster, binaries_missing
from support.redis_tier import make_tier

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


@pytest.fixture(scope="module")
def auth_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    reason = binaries_missing()
    if reason is not None:
        require.missing("redis", reason)
    directory: Path = tmp_path_factory.mktemp("auth-cluster")
    nodes = RedisCluster(directory, config=["requirepass cl-pw", "masterauth cl-pw"]).start()
    yield nodes
    nodes.stop()


def test_cluster_with_password(
    auth_cluster: RedisCluster, pool: HostPool, pool_b: HostPool, namespace: Namespace
) -> None:
    url = auth_cluster.servers[0].url(password="cl-pw")
    a = make_tier(pool, namespace, url=url, cluster=True)
    b = make_tier(pool_b, namespace, url=url, cluster=True)
    try:
        keys = make_keys(6, "cluster-auth")
        assert Driver(a).store(keys) == [True] * 6
        assert Driver(b).load_exact(keys, first_slot=8) == [True] * 6
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("password", [None, "wrong-cl-pw"])
def test_cluster_wrong_password_is_a_clear_error(
    auth_cluster: RedisCluster, pool: HostPool, namespace: Namespace, password: str | None
) -> None:
    url = auth_cluster.servers[0].url(password=password)
    with pytest.raises(ConfigError) as info:
        make_tier(pool, namespace, url=url, cluster=True)
    assert info.value.field == "tiers[0].url"
    assert "credentials" in str(info.value)
    assert "wrong-cl-pw" not in str(info.value) and "cl-pw" not in str(info.value)


def test_cluster_key_of_the_wrong_type_is_deleted_as_corrupt(
    cluster: RedisCluster, pool: HostPool, namespace: Namespace
) -> None:
    tier = make_tier(pool, namespace, url=cluster.url, cluster=True)
    try:
        key = make_keys(1, "cluster-wrongtype")[0]
        rkey = tier.redis_key(key).decode()
        raw = redis.RedisCluster.from_url(cluster.url)
        raw.rpush(rkey, b"x")
        assert Driver(tier).load_exact([key], first_slot=3) == [False]
        assert tier.counters.corrupt == 1 and tier.counters.errors == 0
        wait_for(lambda: raw.exists(rkey) == 0, what="the wrong-type key deleted")
        raw.close()
        assert Driver(tier).store([key]) == [True]
        assert Driver(tier).load_exact([key], first_slot=4) == [True]
    finally:
        tier.close()
