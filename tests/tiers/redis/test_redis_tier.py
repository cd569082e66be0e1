"""The redis tier against a real redis-server: sharing, integrity, isolation, caches, TTL."""

from __future__ import annotations

import time

import pytest
from support.blocks import make_keys, payload_for
from support.drivers import Driver, wait_for
from support.redis_servers import RedisServer
from support.redis_tier import make_tier

from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import TierJob, TierJobKind
from kvtier.tiers.payload import HEADER_BYTES

pytestmark = pytest.mark.redis


def test_two_instances_share_blocks_bit_exact(
    server: RedisServer, pool: HostPool, pool_b: HostPool, namespace: Namespace
) -> None:
    a = make_tier(pool, namespace, url=server.url(), pipeline_blocks=3)
    b = make_tier(pool_b, namespace, url=server.url(), pipeline_blocks=3)
    try:
        keys = make_keys(10, "share")
        assert Driver(a).store(keys) == [True] * 10
        drv_b = Driver(b)
        assert drv_b.lookup(keys) == [True] * 10
        assert drv_b.load_exact(keys, first_slot=20) == [True] * 10
        assert a.counters.write_blocks == 10
        assert b.counters.read_blocks == 10
        assert b.counters.read_bytes == 10 * pool_b.slot_bytes
        assert b.counters.corrupt == b.counters.errors == 0
        # The value on the server is header + slot bytes, nothing else.
        raw = server.cli("strlen", a.redis_key(keys[0]).decode())
        assert int(raw) == HEADER_BYTES + pool.slot_bytes
    finally:
        a.close()
        b.close()


def test_lookup_unknown_then_answered(
    server: RedisServer, pool: HostPool, namespace: Namespace
) -> None:
    tier = make_tier(pool, namespace, url=server.url())
    try:
        keys = make_keys(4, "lookup")
        Driver(tier).store(keys[:2])
        # Written by us: known at once. Others: "not known yet", then answered.
        first = tier.lookup(keys)
        assert first[:2] == [True, True]
        assert first[2:] == [None, None]
        assert Driver(tier).lookup(keys) == [True, True, False, False]
        assert tier.counters.lookup_hits >= 4
    finally:
        tier.close()


def test_negative_cache_expires(
    server: RedisServer, pool: HostPool, pool_b: HostPool, namespace: Namespace
) -> None:
    reader = make_tier(pool, namespace, url=server.url(), negative_cache_s=0.5)
    writer = make_tier(pool_b, namespace, url=server.url())
    try:
        keys = make_keys(2, "negative")
        drv = Driver(reader)
        assert drv.lookup(keys) == [False, False]
        assert Driver(writer).store(keys) == [True, True]
        # Still answered from the negative cache, without asking the server.
        assert reader.lookup(keys) == [False, False]
        time.sleep(0.6)
        assert reader.lookup(keys) == [None, None]
        assert drv.lookup(keys) == [True, True]
    finally:
        reader.close()
        writer.close()


def test_zero_negative_cache_still_answers_once(
    server: RedisServer, pool: HostPool, namespace: Namespace
) -> None:
    tier = make_tier(pool, namespace, url=server.url(), negative_cache_s=0)
    try:
        keys = make_keys(3, "zero")
        assert tier.lookup(keys) == [None] * 3
        wait_for(lambda: tier._presence._pending == set(), what="EXISTS answers")
        time.sleep(0.05)
        assert tier.lookup(keys) == [False] * 3  # served once although already expired
        assert tier.lookup(keys) == [None] * 3
    finally:
        tier.close()


@pytest.mark.parametrize("where", ["magic", "header_key", "length", "payload", "truncated"])
def test_corrupt_value_is_a_counted_dropped_miss(
    server: RedisServer, pool: HostPool, pool_b: HostPool, namespace: Namespace, where: str
) -> None:
    writer = make_tier(pool, namespace, url=server.url())
    reader = make_tier(pool_b, namespace, url=server.url())
    try:
        key = make_keys(1, f"corrupt-{where}")[0]
        assert Driver(writer).store([key]) == [True]
        rkey = writer.redis_key(key).decode()
        raw = server.client()
        if where == "magic":
            raw.setrange(rkey, 0, b"X")
        elif where == "header_key":
            raw.setrange(rkey, 30, b"\x00\x01")
        elif where == "length":
            raw.setrange(rkey, 40, b"\x07")
        elif where == "payload":
            last = HEADER_BYTES + pool.slot_bytes - 1
            old = raw.getrange(rkey, last, last)
            assert isinstance(old, bytes)
            raw.setrange(rkey, last, bytes([old[0] ^ 0x01]))
        else:
            raw.set(rkey, b"short")
        raw.close()
        drv = Driver(reader)
        assert drv.load_exact([key], first_slot=5) == [False]
        assert reader.counters.corrupt == 1
        assert reader.counters.read_blocks == 0
        assert key in reader.take_evicted()
        wait_for(lambda: server.cli("exists", rkey) == "0", what="the corrupt copy deleted")
        assert reader.lookup([key]) == [False]
    finally:
        writer.close()
        reader.close()


def test_value_of_another_key_is_rejected(
    server: RedisServer, pool: HostPool, namespace: Namespace
) -> None:
    """A valid block copied under another key (a confused or malicious writer) is a miss."""
    tier = make_tier(pool, namespace, url=server.url())
    try:
        k1, k2 = make_keys(2, "swap")
        assert Driver(tier).store([k1]) == [True]
        server.cli("copy", tier.redis_key(k1).decode(), tier.redis_key(k2).decode())
        assert Driver(tier).load_exact([k2], first_slot=3) == [False]
        assert tier.counters.corrupt == 1
        assert Driver(tier).load_exact([k1], first_slot=4) == [True]
    finally:
        tier.close()


def test_missing_key_is_a_reported_miss(
    server: RedisServer, pool: HostPool, namespace: Namespace
) -> None:
    tier = make_tier(pool, namespace, url=server.url())
    try:
        keys = make_keys(2, "gone")
        assert Driver(tier).store(keys) == [True, True]
        server.cli("del", tier.redis_key(keys[1]).decode())  # evicted by the server, say
        assert tier.lookup(keys) == [True, True]  # we still believe it
        assert Driver(tier).load_exact(keys, first_slot=8) == [True, False]
        assert tier.take_evicted() == [keys[1]]
        assert tier.counters.evictions == 1 and tier.counters.corrupt == 0
        assert tier.lookup(keys) == [True, False]
    finally:
        tier.close()


def test_tenants_are_isolated(
    server: RedisServer, pool: HostPool, pool_b: HostPool, namespace: Namespace
) -> None:
    other = Namespace(
        model=namespace.model,
        dtype=namespace.dtype,
        block_tokens=namespace.block_tokens,
        tenant="b",
    )
    assert other.fingerprint == namespace.fingerprint and other.digest != namespace.digest
    tenant_a = make_tier(pool, namespace, url=server.url())
    tenant_b = make_tier(pool_b, other, url=server.url())
    try:
        keys = make_keys(3, "tenant")
        assert Driver(tenant_a).store(keys) == [True] * 3
        assert Driver(tenant_b).lookup(keys) == [False] * 3
        assert Driver(tenant_b).load_exact(keys) == [False] * 3
        # Even a copy planted under tenant B's key name is refused: the header names tenant A.
        server.cli(
            "copy", tenant_a.redis_key(keys[0]).decode(), tenant_b.redis_key(keys[0]).decode()
        )
        assert Driver(tenant_b).load_exact(keys[:1]) == [False]
        assert tenant_b.counters.corrupt == 1
        assert Driver(tenant_a).load_exact(keys, first_slot=10) == [True] * 3
    finally:
        tenant_a.close()
        tenant_b.close()


def test_ttl_is_applied_and_expiry_is_a_miss(
    server: RedisServer, pool: HostPool, namespace: Namespace
) -> None:
    tier = make_tier(pool, namespace, url=server.url(), ttl_s=0.6)
    try:
        key = make_keys(1, "ttl")[0]
        assert Driver(tier).store([key]) == [True]
        pttl = int(server.cli("pttl", tier.redis_key(key).decode()))
        assert 0 < pttl <= 600
        time.sleep(0.8)
        assert server.cli("exists", tier.redis_key(key).decode()) == "0"
        # Positive entries expire before the TTL does, so the lookup asks the server again.
        assert Driver(tier).lookup([key]) == [False]
    finally:
        tier.close()


def test_read_refreshes_ttl(server: RedisServer, pool: HostPool, namespace: Namespace) -> None:
    tier = make_tier(pool, namespace, url=server.url(), ttl_s=100)
    try:
        key = make_keys(1, "touch")[0]
        assert Driver(tier).store([key]) == [True]
        server.cli("pexpire", tier.redis_key(key).decode(), "5000")
        assert Driver(tier).load_exact([key], first_slot=2) == [True]
        assert int(server.cli("pttl", tier.redis_key(key).decode())) > 50_000
    finally:
        tier.close()


def test_no_ttl_by_default(server: RedisServer, pool: HostPool, namespace: Namespace) -> None:
    tier = make_tier(pool, namespace, url=server.url())
    try:
        key = make_keys(1, "nottl")[0]
        assert Driver(tier).store([key]) == [True]
        assert server.cli("pttl", tier.redis_key(key).decode()) == "-1"
    finally:
        tier.close()


def test_jobs_split_into_batches_over_threads(
    server: RedisServer, pool: HostPool, pool_b: HostPool, namespace: Namespace
) -> None:
    a = make_tier(pool, namespace, url=server.url(), pipeline_blocks=2, io_threads=3)
    b = make_tier(pool_b, namespace, url=server.url(), pipeline_blocks=5, io_threads=2)
    try:
        keys = make_keys(40, "many")
        drv = Driver(a)
        # Several jobs in flight at once, results matched by id.
        ids = [drv.submit(TierJobKind.WRITE, [], []) for _ in range(2)]
        for i, key in enumerate(keys):
            pool.view(i)[:] = payload_for(key, pool.slot_bytes)
        ids += [
            drv.submit(TierJobKind.WRITE, keys[i : i + 10], list(range(i, i + 10)))
            for i in range(0, 40, 10)
        ]
        results = [drv.wait(job_id) for job_id in ids]
        assert results[:2] == [[], []]
        assert all(r == [True] * 10 for r in results[2:])
        assert Driver(b).load_exact(keys, first_slot=0) == [True] * 40
    finally:
        a.close()
        b.close()


def test_bad_jobs_fail_without_raising(
    server: RedisServer, pool: HostPool, namespace: Namespace
) -> None:
    tier = make_tier(pool, namespace, url=server.url())
    try:
        drv = Driver(tier)
        assert drv.wait(drv.submit(TierJobKind.WRITE, make_keys(2), [0])) == [False, False]
        assert drv.wait(drv.submit(TierJobKind.READ, [b"short"], [0])) == [False]
        assert drv.wait(drv.submit(TierJobKind.READ, make_keys(1), [10_000])) == [False]
        assert tier.counters.errors == 4
    finally:
        tier.close()


def test_close_reports_every_job_and_later_calls_are_noops(
    server: RedisServer, pool: HostPool, namespace: Namespace
) -> None:
    tier = make_tier(pool, namespace, url=server.url(), io_threads=1, pipeline_blocks=1)
    keys = make_keys(30, "close")
    for i in range(30):
        tier.submit(TierJob(i, TierJobKind.WRITE, [keys[i]], [i]))
    tier.close()
    tier.close()
    reported = {r.job_id for r in tier.poll()}
    assert reported == set(range(30))
    tier.submit(TierJob(99, TierJobKind.READ, keys[:1], [0]))
    assert [r.ok for r in tier.poll()] == [[False]]
    assert tier.lookup(keys[:2]) == [False, False]
    assert not tier.healthy


def test_full_server_with_noeviction_refuses_writes_but_stays_healthy(
    make_server: object, pool: HostPool, namespace: Namespace
) -> None:
    srv: RedisServer = make_server("maxmemory 2mb", "maxmemory-policy noeviction")  # type: ignore[operator]
    tier = make_tier(pool, namespace, url=srv.url())
    try:
        ok = Driver(tier).store(make_keys(60, "full"))
        assert not all(ok)
        assert tier.counters.errors == ok.count(False)
        assert tier.healthy
        # What was stored reads back.
        stored = [k for k, good in zip(make_keys(60, "full"), ok, strict=True) if good][:4]
        assert Driver(tier).load_exact(stored, first_slot=60 - len(stored)) == [True] * len(stored)
    finally:
        tier.close()


def test_lru_eviction_by_the_server_is_a_reported_miss(
    make_server: object, pool: HostPool, pool_b: HostPool, namespace: Namespace
) -> None:
    srv: RedisServer = make_server("maxmemory 3mb", "maxmemory-policy allkeys-lru")  # type: ignore[operator]
    writer = make_tier(pool, namespace, url=srv.url())
    reader = make_tier(pool_b, namespace, url=srv.url())
    try:
        keys = make_keys(60, "lru")
        assert Driver(writer).store(keys) == [True] * 60  # the server evicts to make room
        assert writer.lookup(keys) == [True] * 60  # the writer still believes all stored
        ok = Driver(writer).load_exact(keys[:20], first_slot=0)
        assert not all(ok)
        evicted = writer.take_evicted()
        assert set(evicted) == {k for k, good in zip(keys[:20], ok, strict=True) if not good}
        assert writer.counters.evictions == len(evicted)
        assert writer.counters.corrupt == 0
        # Another instance asks the server and agrees with it.
        on_server = [srv.cli("exists", writer.redis_key(k).decode()) == "1" for k in keys]
        assert Driver(reader).lookup(keys) == on_server
    finally:
        writer.close()
        reader.close()


def test_unix_socket(make_server: object, pool: HostPool, namespace: Namespace, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "redis.sock"
    make_server(f"unixsocket {path}", "unixsocketperm 700")  # type: ignore[operator]
    tier = make_tier(pool, namespace, url=f"unix://{path}")
    try:
        keys = make_keys(5, "unix")
        assert Driver(tier).store(keys) == [True] * 5
        assert Driver(tier).load_exact(keys, first_slot=10) == [True] * 5
    finally:
        tier.close()


def test_numpy_slot_numbers_are_accepted(
    server: RedisServer, pool: HostPool, namespace: Namespace
) -> None:
    import numpy as np

    tier = make_tier(pool, namespace, url=server.url())
    try:
        drv = Driver(tier)
        key = make_keys(1, "np")
        slots = list(np.arange(3, 4))
        pool.view(3)[:] = payload_for(key[0], pool.slot_bytes)
        assert drv.wait(drv.submit(TierJobKind.WRITE, key, slots)) == [True]
    finally:
        tier.close()


@pytest.mark.parametrize("kind", ["list", "hash"])
def test_key_of_the_wrong_type_is_deleted_as_corrupt(
    server: RedisServer, pool: HostPool, namespace: Namespace, kind: str
) -> None:
    """Finding 13c: someone made a kvtier key a list or a hash. Reads got WRONGTYPE forever;
    now the key is corrupt: counted, deleted and reported, and the block is stored again."""
    tier = make_tier(pool, namespace, url=server.url())
    try:
        key, other = make_keys(2, f"wrongtype-{kind}")
        rkey = tier.redis_key(key).decode()
        foreign = "someone:else:" + key.hex()  # not kvtier's: never touched
        for name in (rkey, foreign):
            if kind == "list":
                server.cli("rpush", name, "x")
            else:
                server.cli("hset", name, "f", "x")
        drv = Driver(tier)
        assert drv.load_exact([key, other], first_slot=3) == [False, False]
        assert tier.counters.corrupt == 1
        assert tier.counters.errors == 0
        assert key in tier.take_evicted()
        wait_for(lambda: server.cli("exists", rkey) == "0", what="the wrong-type key deleted")
        assert server.cli("type", foreign) == kind
        assert tier.lookup([key]) == [False]
        assert drv.store([key]) == [True]
        assert drv.load_exact([key], first_slot=5) == [True]
    finally:
        tier.close()
