"""Losing the server: no exception, no hang, requests go on without it, recovery by itself."""

from __future__ import annotations

import time

import pytest
from support.blocks import make_keys
from support.drivers import Driver, wait_for
from support.redis_servers import RedisServer
from support.redis_tier import make_tier

from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import TierJobKind

pytestmark = pytest.mark.redis


def test_server_killed_and_restarted(
    server: RedisServer, pool: HostPool, pool_b: HostPool, namespace: Namespace
) -> None:
    tier = make_tier(pool, namespace, url=server.url(), timeout_s=1.0)
    other = make_tier(pool_b, namespace, url=server.url(), timeout_s=1.0, health_interval_s=0.1)
    drv = Driver(tier)
    try:
        keys = make_keys(8, "restart")
        assert drv.store(keys[:4]) == [True] * 4
        assert Driver(other).lookup(keys[:4]) == [True] * 4

        server.kill()
        started = time.monotonic()
        # In-flight and new jobs fail (reported, never raised), within the deadline.
        assert drv.store(keys[4:]) == [False] * 4
        assert drv.load_exact(keys[:4], first_slot=10) == [False] * 4
        assert not tier.healthy
        assert tier.lookup(keys) == [False] * 8  # at once, without the network
        assert time.monotonic() - started < 5
        assert tier.counters.rejected + tier.counters.errors + tier.counters.timeouts >= 8
        # The idle instance notices through its periodic probe.
        wait_for(lambda: not other.healthy, what="the idle tier to notice", deadline_s=10)

        server.restart()
        wait_for(lambda: tier.healthy and other.healthy, what="recovery", deadline_s=10)
        # The restarted server is empty: what we believed present was forgotten.
        assert Driver(other).lookup(keys[:4]) == [False] * 4
        assert drv.store(keys) == [True] * 8
        assert Driver(other).load_exact(keys, first_slot=20) == [True] * 8
    finally:
        tier.close()
        other.close()


def test_restart_between_probes_is_noticed(
    server: RedisServer, pool: HostPool, pool_b: HostPool, namespace: Namespace
) -> None:
    """A quick restart while the tier was idle: the new run id drops stale positive entries."""
    writer = make_tier(pool, namespace, url=server.url())
    reader = make_tier(pool_b, namespace, url=server.url(), health_interval_s=0.1)
    try:
        keys = make_keys(3, "quick")
        assert Driver(writer).store(keys) == [True] * 3
        assert Driver(reader).lookup(keys) == [True] * 3
        server.restart()
        wait_for(
            lambda: reader.lookup(keys) != [True] * 3, what="stale entries dropped", deadline_s=10
        )
        assert Driver(reader).lookup(keys) == [False] * 3
    finally:
        writer.close()
        reader.close()


def test_frozen_server_times_out_then_recovers(
    server: RedisServer, pool: HostPool, namespace: Namespace
) -> None:
    tier = make_tier(pool, namespace, url=server.url(), timeout_s=0.3, health_interval_s=60)
    drv = Driver(tier)
    try:
        keys = make_keys(4, "frozen")
        assert drv.store(keys[:2]) == [True, True]
        server.pause()
        try:
            started = time.monotonic()
            assert drv.load_exact(keys[:2], first_slot=5) == [False, False]
            assert time.monotonic() - started < 3
            assert tier.counters.timeouts >= 1
            assert not tier.healthy
            assert tier.lookup(keys) == [False] * 4
        finally:
            server.resume()
        wait_for(lambda: tier.healthy, what="recovery after SIGCONT", deadline_s=10)
        assert drv.store(keys) == [True] * 4
        assert drv.load_exact(keys, first_slot=8) == [True] * 4
    finally:
        tier.close()


def test_unreachable_at_start_then_server_appears(
    make_server: object, pool: HostPool, namespace: Namespace
) -> None:
    srv = make_server(start=False)  # type: ignore[operator]
    srv.start()
    url = srv.url()
    srv.kill()
    tier = make_tier(pool, namespace, url=url, timeout_s=0.5)
    try:
        assert not tier.healthy
        assert tier.lookup(make_keys(2)) == [False, False]
        drv = Driver(tier)
        assert drv.wait(drv.submit(TierJobKind.WRITE, make_keys(1), [0])) == [False]
        assert tier.counters.rejected == 1
        srv.restart()
        wait_for(lambda: tier.healthy, what="the tier to find the server", deadline_s=10)
        assert drv.store(make_keys(2, "late")) == [True, True]
    finally:
        tier.close()


def test_close_while_server_is_frozen_does_not_hang(
    server: RedisServer, pool: HostPool, namespace: Namespace
) -> None:
    tier = make_tier(pool, namespace, url=server.url(), timeout_s=0.3, io_threads=2)
    keys = make_keys(6, "closefrozen")
    drv = Driver(tier)
    server.pause()
    try:
        ids = [drv.submit(TierJobKind.WRITE, [k], [i]) for i, k in enumerate(keys)]
        started = time.monotonic()
        tier.close()
        assert time.monotonic() - started < 5
        assert [drv.wait(i, deadline_s=1) for i in ids] == [[False]] * 6
    finally:
        server.resume()


def test_kept_connections_closed_by_the_server_are_replaced(
    server: RedisServer, pool: HostPool, namespace: Namespace
) -> None:
    """I/O threads keep their connections between batches; the server closing them while idle
    (its ``timeout`` setting, CLIENT KILL) costs no block and leaves the tier healthy."""
    tier = make_tier(pool, namespace, url=server.url(), io_threads=2, health_interval_s=60.0)
    drv = Driver(tier)
    try:
        keys = make_keys(12, "kept")
        assert drv.store(keys[:6]) == [True] * 6
        killed = int(server.cli("client", "kill", "type", "normal", "skipme", "no"))
        assert killed >= 1  # at least the kept data connections
        assert drv.store(keys[6:]) == [True] * 6
        assert drv.load_exact(keys, first_slot=20) == [True] * 12
        assert tier.healthy
        assert tier.counters.errors == tier.counters.timeouts == tier.counters.rejected == 0
    finally:
        tier.close()


def test_close_is_bounded_with_commands_stuck_on_a_frozen_server(
    server: RedisServer, pool: HostPool, namespace: Namespace
) -> None:
    """SIGSTOP with reads, writes and lookups in flight: close() returns within its documented
    bound and reports every job once, failed."""
    from kvtier.tiers.redis.tier import CLOSE_ABORT_S

    timeout_s = 1.0
    tier = make_tier(
        pool, namespace, url=server.url(), timeout_s=timeout_s, io_threads=2, pipeline_blocks=1
    )
    drv = Driver(tier)
    keys = make_keys(12, "stuck")
    try:
        assert drv.store(keys[:4]) == [True] * 4
        server.pause()
        ids = [drv.submit(TierJobKind.READ, [k], [20 + i]) for i, k in enumerate(keys[:4])]
        ids += [drv.submit(TierJobKind.WRITE, [k], [30 + i]) for i, k in enumerate(keys[4:])]
        assert tier.lookup(keys[4:]) == [None] * 8  # EXISTS asked on the lookup thread
        started = time.monotonic()
        tier.close()
        assert time.monotonic() - started < timeout_s + CLOSE_ABORT_S + 1.0
        results = [drv.wait(i, deadline_s=0.1) for i in ids]
        assert all(not any(ok) for ok in results)
        assert tier.poll() == []
    finally:
        server.resume()
