"""The manager under failing and stuck tiers: events bounded with nobody taking them, promotion
failures remembered per tier, stuck jobs given up without reusing their slots, a bounded
``close()``, and write-back that does not spin on a tier rejecting every copy."""

from __future__ import annotations

import logging
import threading
import time
import tracemalloc
from collections.abc import Sequence

import pytest
from support.blocks import keys_for
from support.scripted_tier import ScriptedTier

from kvtier.cache.manager import MAX_EVENTS, TierBinding, TieredCache
from kvtier.keys import BlockKey, Namespace
from kvtier.policies import LRUPolicy
from kvtier.pool import HostPool
from kvtier.sim.replay import Replayer
from kvtier.sim.trace import bundled_trace_path, read_trace
from kvtier.tiers.base import Tier, TierJob, TierJobKind, WriteMode


def store(cache: TieredCache, keys: Sequence[BlockKey]) -> list[BlockKey]:
    res = cache.prepare_store(keys)
    for key, slot in zip(res.keys, res.slots, strict=True):
        view = cache._pool.view(slot)
        view[:] = (key * (len(view) // len(key) + 1))[: len(view)]
    cache.complete_store(res.keys)
    return res.keys


def numbered_keys(start: int, n: int) -> list[BlockKey]:
    return [i.to_bytes(16, "little") for i in range(start, start + n)]


# -- finding 10: events ---------------------------------------------------------------------------


def test_events_nobody_takes_stay_bounded_and_drops_are_counted(make_pool):
    """Before: every stored and evicted block added an event for good (~210 bytes each: 42 MB
    after 200,000 stores)."""
    pool = make_pool(1000, 16)
    cache = TieredCache(pool, LRUPolicy())
    tracemalloc.start()
    try:
        for start in range(0, 200_000, 500):
            store(cache, numbered_keys(start, 500))
        grown, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    stats = cache.stats().cache
    produced = stats.stored_blocks + stats.pool_evictions  # one event each
    assert produced == 200_000 + 199_000
    assert stats.events_dropped == produced - MAX_EVENTS
    assert grown < MAX_EVENTS * 400  # not ~400,000 events' worth
    events = cache.take_events()
    assert len(events) == MAX_EVENTS
    assert events[-1].key == numbered_keys(199_999, 1)[0]  # the newest are kept
    assert cache.take_events() == []


def test_a_consumer_taking_events_loses_none(make_pool):
    pool = make_pool(8, 16)
    cache = TieredCache(pool, LRUPolicy(), max_events=10)
    seen = 0
    for start in range(0, 100, 4):
        store(cache, numbered_keys(start, 4))
        seen += len(cache.take_events())
    stats = cache.stats().cache
    assert seen == stats.stored_blocks + stats.pool_evictions and stats.events_dropped == 0


# -- finding 11: a faulty fast tier over a good slow one ------------------------------------------


def test_a_failed_promotion_from_one_tier_tries_the_next(ns, make_pool):
    """Before: the failure blocked the key for 30 s in every tier."""
    pool = make_pool(8)
    fast, slow = ScriptedTier("fast", ns, pool), ScriptedTier("slow", ns, pool)
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(fast), TierBinding(slow)])
    keys = keys_for(ns, 3)
    for tier in (fast, slow):
        tier.stored = {k: k * (pool.slot_bytes // len(k)) for k in keys}
    fast.fail_keys = set(keys)  # claims the blocks, cannot deliver them
    assert cache.lookup(keys) == (0, False)
    fast.release()
    cache.step()
    assert cache.lookup(keys) == (0, False)  # now from the slow tier
    assert [j.kind for j in slow.submitted] == [TierJobKind.READ]
    slow.release()
    cache.step()
    assert cache.lookup(keys) == (3, True)
    assert cache.stats().promoted == {"fast": 0, "slow": 3}
    assert cache.stats().cache.promotion_failures == 3


def test_a_key_failing_in_every_tier_is_a_miss_not_retried_at_once(ns, make_pool):
    pool = make_pool(8)
    fast, slow = ScriptedTier("fast", ns, pool), ScriptedTier("slow", ns, pool)
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(fast), TierBinding(slow)])
    keys = keys_for(ns, 2)
    for tier in (fast, slow):
        tier.stored = {k: b"x" * 64 for k in keys}
        tier.fail_keys = set(keys)
    for tier in (fast, slow):
        assert cache.lookup(keys) == (0, False)
        tier.release()
        cache.step()
    assert cache.lookup(keys) == (0, True)
    assert len(fast.submitted) == len(slow.submitted) == 1


class InstantTier(Tier):
    """Finishes every job inside ``submit`` (a tier on the same thread); ``faulty``: writes are
    kept, every read fails (the tier claims blocks it cannot deliver)."""

    def __init__(self, name: str, namespace: Namespace, pool: HostPool, faulty: bool) -> None:
        super().__init__(name, namespace, pool)
        self.faulty = faulty
        self.stored: dict[BlockKey, bytes] = {}

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        return [k in self.stored for k in keys]

    def submit(self, job: TierJob) -> None:
        ok = []
        for key, slot in zip(job.keys, job.slots, strict=True):
            if job.kind is TierJobKind.WRITE:
                self.stored[key] = bytes(self.pool.view(slot))
                ok.append(True)
            elif key in self.stored and not self.faulty:
                self.pool.view(slot)[:] = self.stored[key]
                ok.append(True)
            else:
                ok.append(False)
        self._finish(job.job_id, ok)

    def close(self) -> None:
        pass


def _replay_hit_ratio(pool: HostPool, tiers: list[Tier], ns: Namespace) -> tuple[float, int]:
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(t) for t in tiers], copy_share=2.0)
    replayer = Replayer(cache, pool, ns, pending_timeout_s=5)
    result = replayer.run(read_trace(bundled_trace_path(), 400))
    cache.close()
    return result.hit_ratio, result.mismatched_blocks


def test_a_faulty_fast_tier_does_not_hide_a_good_slow_one(ns, make_pool):
    """Before: 0.21 -> 0.02 with a faulty memory tier in front of fs; here the ratio with the
    faulty tier in front equals the ratio of the good tier alone."""
    solo = make_pool(64, 64)
    alone, bad_alone = _replay_hit_ratio(solo, [InstantTier("slow", ns, solo, False)], ns)
    pool = make_pool(64, 64)
    tiers: list[Tier] = [InstantTier("fast", ns, pool, True), InstantTier("slow", ns, pool, False)]
    behind, bad_behind = _replay_hit_ratio(pool, tiers, ns)
    assert alone > 0.04  # the slow tier really serves hits in this trace
    assert behind == pytest.approx(alone)
    assert bad_alone == bad_behind == 0


# -- bounded I/O: stuck jobs and close ------------------------------------------------------------


def test_a_stuck_write_is_given_up_but_its_pinned_slots_are_never_reused(ns, make_pool, caplog):
    now = [0.0]
    pool = make_pool(4)
    tier = ScriptedTier("stuck", ns, pool)
    cache = TieredCache(
        pool,
        LRUPolicy(),
        [TierBinding(tier)],
        job_timeout_s=5,
        copy_share=1.0,
        clock=lambda: now[0],
    )
    a = keys_for(ns, 2, seed=1)
    store(cache, a)  # the write-through job never returns (until released below)
    now[0] = 10.0
    with caplog.at_level(logging.WARNING, logger="kvtier.cache.manager"):
        cache.step()
    assert "tier stuck: a write job of 2 blocks did not end within job_timeout_s=5" in caplog.text
    assert cache.stats().cache.job_timeouts == 1 and cache.jobs_waiting() == {}
    assert cache.jobs_in_flight == 1  # abandoned, not forgotten: its slots stay pinned
    for seed in range(2, 6):  # fill the pool over and over: only the two free slots turn over
        assert len(store(cache, keys_for(ns, 4, seed=seed))) == 2
        stuck, tier.pending = tier.pending[:1], tier.pending[1:]
        tier.release()  # the other writes end; the first one stays stuck
        tier.pending = stuck
        cache.step()
    assert cache.stats().pool_pinned == 2
    assert cache.lookup(a) == (2, True)
    for key, slot in zip(a, cache.prepare_load(a), strict=True):
        assert bytes(pool.view(slot))[: len(key)] == key  # the stuck job's bytes untouched
    cache.complete_load(a)
    tier.release()  # the tier finally returns
    cache.step()
    assert cache.stats().pool_pinned == 0 and cache.jobs_in_flight == 0


def test_a_stuck_write_on_evict_holds_its_slots_until_the_tier_returns(ns, make_pool):
    now = [0.0]
    pool = make_pool(8)
    tier = ScriptedTier("stuck", ns, pool)
    cache = TieredCache(
        pool,
        LRUPolicy(),
        [TierBinding(tier, WriteMode.ON_EVICT)],
        job_timeout_s=5,
        clock=lambda: now[0],
        copy_share=0.25,  # 2 blocks
    )
    store(cache, keys_for(ns, 8, seed=1))
    assert store(cache, keys_for(ns, 2, seed=2)) == []  # evicted: copies in flight hold the slots
    now[0] = 10.0
    cache.step()
    assert cache.stats().cache.job_timeouts == 1
    third = keys_for(ns, 2, seed=3)
    # Still held, and as many as copies may hold: the next blocks evicted go uncopied.
    assert store(cache, third) == third and pool.num_free == 0
    assert cache.stats().cache.cascade_skipped == 2
    tier.release()
    cache.step()
    assert pool.num_free == 2 and cache.jobs_in_flight == 0


class HangingCloseTier(ScriptedTier):
    """``close()`` blocks until ``gate`` is set (a tier whose threads are stuck in I/O)."""

    def __init__(self, name: str, namespace: Namespace, pool: HostPool) -> None:
        super().__init__(name, namespace, pool)
        self.gate = threading.Event()

    def close(self) -> None:
        self.gate.wait()
        super().close()


def test_close_returns_within_its_bound_whatever_the_tiers_do(ns, make_pool, caplog):
    """Before: a tier whose close() hangs hung close() for good."""
    pool = make_pool(4)
    hanging = [HangingCloseTier(f"nfs{i}", ns, pool) for i in range(2)]
    cache = TieredCache(
        pool, LRUPolicy(), [TierBinding(t) for t in hanging], job_timeout_s=0.5, copy_share=2.0
    )
    store(cache, keys_for(ns, 2))
    closer = threading.Thread(target=cache.close, daemon=True)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvtier.cache.manager"):
        closer.start()
        closer.join(10)
    elapsed = time.monotonic() - t0
    try:
        assert not closer.is_alive()
        assert 0.4 < elapsed < 1.5  # both tiers closed at once: one bound, not one per tier
        assert "tier nfs0 did not close within 0.5 s" in caplog.text
        assert "tier nfs1 did not close within 0.5 s" in caplog.text
        assert cache.stats().pool_pinned == 2  # the unreported writes keep their pins
    finally:
        for tier in hanging:
            tier.gate.set()


# -- finding 14: a write-on-evict tier that rejects every copy ------------------------------------


class RejectingTier(ScriptedTier):
    """Unreachable: every job fails at once (reported on the next poll)."""

    def submit(self, job: TierJob) -> None:
        self.submitted.append(job)
        self._finish(job.job_id, [False] * len(job.keys))


def test_write_back_to_a_tier_rejecting_every_copy_does_not_spin(ns, make_pool, caplog):
    """Before: each step resubmitted the failed copies, so stepping until jobs end (simulate's
    drain) spun a core at 100% for 2 x job_timeout_s."""
    pool = make_pool(16)
    tier = RejectingTier("redis", ns, pool)
    cache = TieredCache(
        pool,
        LRUPolicy(),
        [TierBinding(tier, WriteMode.ON_EVICT)],
        job_timeout_s=1.0,
        writeback_window=8,
    )
    with caplog.at_level(logging.WARNING, logger="kvtier.cache.manager"):
        store(cache, keys_for(ns, 16))
        cpu0, t0 = time.process_time(), time.monotonic()
        while time.monotonic() - t0 < 1.0:  # a drain: wait while jobs run
            if not cache.wait(0.05):
                time.sleep(0.01)
        cpu = time.process_time() - cpu0
    assert len(tier.submitted) <= 8  # retried after 0.05, 0.1, 0.2, 0.4, ... s
    assert cpu < 0.3
    assert caplog.text.count("tier redis: 8 of 8 block copies failed; write-back paused") == 1
