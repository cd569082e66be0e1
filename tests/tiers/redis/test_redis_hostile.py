"""A hostile or broken "Redis": every misbehaviour is a miss or a failed job, reported within the
command deadline, never an exception into the engine, never wrong data, never a hang."""

from __future__ import annotations

import resource
import time

import pytest
from support.blocks import make_keys
from support.drivers import Driver, wait_for
from support.hostile_server import HostileServer, Mode, wait_port_free
from support.redis_servers import RedisServer
from support.redis_tier import make_tier

from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import TierJobKind
from kvtier.tiers.redis.tier import CLOSE_ABORT_S

TIMEOUT_S = 0.5
"""The tier's ``timeout_s`` here: the total deadline of one command."""
SLACK_S = 1.0
"""Scheduling slack on the 2-core CI machine."""


def _stored_on(server: HostileServer, pool: HostPool, namespace: Namespace, label: str) -> list:
    """Keys stored through an honest phase of ``server`` (the mode is switched after)."""
    mode, server.mode = server.mode, Mode.HONEST
    tier = make_tier(pool, namespace, url=server.url())
    try:
        keys = make_keys(3, label)
        assert Driver(tier).store(keys) == [True] * 3
    finally:
        tier.close()
    server.mode = mode
    return keys


@pytest.mark.parametrize("mode", [Mode.TRICKLE_GET, Mode.TRICKLE_SET])
def test_trickled_reply_fails_at_the_deadline_and_close_is_bounded(
    pool: HostPool, namespace: Namespace, mode: Mode
) -> None:
    """Finding 13a: one byte per 0.2 s (under any per-recv timeout) must not hold a thread."""
    with HostileServer(Mode.HONEST, interval_s=0.2) as srv:
        keys = _stored_on(srv, pool, namespace, "trickle")
        srv.mode = mode
        tier = make_tier(pool, namespace, url=srv.url(), timeout_s=TIMEOUT_S, io_threads=1)
        drv = Driver(tier)
        reading = mode is Mode.TRICKLE_GET
        try:
            started = time.monotonic()
            if reading:
                assert drv.load_exact(keys[:1], first_slot=5) == [False]
            else:
                assert drv.store(keys[:1], first_slot=5) == [False]
            assert time.monotonic() - started < TIMEOUT_S + SLACK_S
            assert tier.counters.timeouts == 1
            assert tier.counters.read_blocks == tier.counters.write_blocks == 0
        finally:
            # close() while a trickled job is in flight and more jobs are queued behind it.
            wait_for(lambda: tier.healthy, what="recovery", deadline_s=10)
            kind = TierJobKind.READ if reading else TierJobKind.WRITE
            ids = [drv.submit(kind, [k], [10 + i]) for i, k in enumerate(keys)]
            time.sleep(0.1)
            started = time.monotonic()
            tier.close()
            closed_in = time.monotonic() - started
            assert closed_in < TIMEOUT_S + CLOSE_ABORT_S + SLACK_S
            assert [drv.wait(i, deadline_s=0.1) for i in ids] == [[False]] * 3
            assert tier.poll() == []


def test_server_trickling_everything_at_start_is_bounded(
    pool: HostPool, namespace: Namespace
) -> None:
    """Connection set-up replies trickled too: the constructor returns within its deadlines,
    the tier starts unhealthy and closes within its bound."""
    with HostileServer(Mode.TRICKLE_ALL, interval_s=0.1) as srv:
        started = time.monotonic()
        tier = make_tier(pool, namespace, url=srv.url(), timeout_s=TIMEOUT_S)
        try:
            assert time.monotonic() - started < TIMEOUT_S + SLACK_S
            assert not tier.healthy
            assert tier.lookup(make_keys(2)) == [False, False]
        finally:
            started = time.monotonic()
            tier.close()
            assert time.monotonic() - started < TIMEOUT_S + CLOSE_ABORT_S + SLACK_S


def test_huge_bulk_length_is_not_read_or_allocated(pool: HostPool, namespace: Namespace) -> None:
    with HostileServer(Mode.HONEST) as srv:
        keys = _stored_on(srv, pool, namespace, "huge")
        srv.mode = Mode.HUGE_BULK
        tier = make_tier(pool, namespace, url=srv.url(), timeout_s=5.0)
        try:
            rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            started = time.monotonic()
            assert Driver(tier).load_exact(keys, first_slot=5) == [False] * 3
            # Refused at the length line, not after reading (or allocating) a terabyte.
            assert time.monotonic() - started < 2.0
            grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before
            assert grown_kib < 64 * 1024
            assert tier.counters.corrupt >= 1
            assert tier.counters.read_blocks == 0
        finally:
            tier.close()


@pytest.mark.parametrize(
    "mode",
    [
        Mode.LONGER_THAN_SAID,
        Mode.NEGATIVE_LENGTH,
        Mode.GARBAGE,
        Mode.RESET_MID_REPLY,
        Mode.BAD_INTEGER,
    ],
)
def test_bad_replies_are_failed_jobs_never_wrong_data(
    pool: HostPool, namespace: Namespace, mode: Mode
) -> None:
    with HostileServer(Mode.HONEST) as srv:
        keys = _stored_on(srv, pool, namespace, f"bad-{mode.value}")
        srv.mode = mode
        tier = make_tier(pool, namespace, url=srv.url(), timeout_s=TIMEOUT_S)
        drv = Driver(tier)
        try:
            for _ in range(4):  # load_exact: a block reported ok is bit-exact
                assert drv.load_exact(keys, first_slot=5) == [False] * 3
                assert drv.store(make_keys(2, f"w-{mode.value}"), first_slot=20) in (
                    [True, True],  # modes that only break reads
                    [False, False],
                )
            c = tier.counters
            assert c.read_blocks == 0
            assert c.errors + c.corrupt + c.timeouts >= 3
        finally:
            tier.close()


@pytest.mark.parametrize("mode", [Mode.GARBAGE, Mode.LONGER_THAN_SAID, Mode.BAD_INTEGER])
def test_consecutive_protocol_errors_make_the_tier_unhealthy(
    pool: HostPool, namespace: Namespace, mode: Mode
) -> None:
    """Replies that are no RESP, again and again: lookups miss at once and jobs fail at once
    instead of piling up behind a server that cannot answer."""
    with HostileServer(Mode.HONEST) as srv:
        keys = _stored_on(srv, pool, namespace, f"proto-{mode.value}")
        srv.mode = mode
        tier = make_tier(pool, namespace, url=srv.url(), timeout_s=TIMEOUT_S, io_threads=1)
        drv = Driver(tier)
        try:
            for key in keys:
                drv.load_exact([key], first_slot=5)
            drv.store(make_keys(3, "proto-w"), first_slot=20)
            wait_for(lambda: not tier.healthy, what="unhealthy", deadline_s=5)
            assert tier.lookup(keys) == [False] * 3
            started = time.monotonic()
            assert drv.load_exact(keys, first_slot=5) == [False] * 3
            assert time.monotonic() - started < 0.5  # failed at once, not sent
        finally:
            tier.close()


@pytest.mark.redis
@pytest.mark.parametrize(
    "mode", [Mode.ERR_EVERYTHING, Mode.OK_EVERYTHING, Mode.MEMCACHED, Mode.HTTP]
)
def test_port_taken_over_by_a_non_redis_server(
    server: RedisServer, pool: HostPool, namespace: Namespace, mode: Mode
) -> None:
    """Finding 13b: the health check must see a real PONG; the tier stays unhealthy (lookups
    miss, jobs fail at once) while another server holds the port, and recovers with Redis."""
    tier = make_tier(pool, namespace, url=server.url(), timeout_s=TIMEOUT_S, health_interval_s=0.1)
    drv = Driver(tier)
    keys = make_keys(4, f"takeover-{mode.value}")
    try:
        assert drv.store(keys) == [True] * 4
        server.kill()
        wait_port_free(server.port)
        with HostileServer(mode, port=server.port):
            wait_for(lambda: not tier.healthy, what="unhealthy on a non-Redis server", deadline_s=5)
            end = time.monotonic() + 1.5  # and it stays so: no probe takes it for Redis
            while time.monotonic() < end:
                assert not tier.healthy
                assert tier.lookup(keys) == [False] * 4
                time.sleep(0.02)
            started = time.monotonic()
            assert drv.load_exact(keys, first_slot=10) == [False] * 4
            assert drv.store(keys) == [False] * 4
            assert time.monotonic() - started < 0.5
        wait_port_free(server.port)
        server.restart()
        wait_for(lambda: tier.healthy, what="recovery with Redis back", deadline_s=10)
        assert drv.store(keys) == [True] * 4
        assert drv.load_exact(keys, first_slot=10) == [True] * 4
    finally:
        tier.close()


def test_non_redis_server_at_start_starts_the_tier_unhealthy(
    pool: HostPool, namespace: Namespace
) -> None:
    """Another server on the port when the engine starts: no exception, the tier waits."""
    with HostileServer(Mode.MEMCACHED) as srv:
        tier = make_tier(pool, namespace, url=srv.url(), timeout_s=TIMEOUT_S)
        try:
            assert not tier.healthy
            assert tier.lookup(make_keys(1)) == [False]
            srv.mode = Mode.HONEST
            wait_for(lambda: tier.healthy, what="an honest server", deadline_s=10)
            assert Driver(tier).store(make_keys(2, "late")) == [True, True]
        finally:
            tier.close()
