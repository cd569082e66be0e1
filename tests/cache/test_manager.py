from __future__ import annotations

from collections.abc import Container

import pytest
from support.blocks import keys_for
from support.scripted_tier import ScriptedTier

from kvtier.cache.manager import TierBinding, TieredCache
from kvtier.events import EventKind
from kvtier.policies import LRUPolicy
from kvtier.policies.admission import AdmissionFilter
from kvtier.tiers.base import WriteMode


def store(cache: TieredCache, keys: list[bytes], fill: bytes | None = None) -> list[bytes]:
    res = cache.prepare_store(keys)
    for key, slot in zip(res.keys, res.slots, strict=True):
        view = cache._pool.view(slot)
        view[:] = (fill or key) * (len(view) // len(key))
    cache.complete_store(res.keys)
    return res.keys


def test_lookup_counts_leading_run_and_store_skips_present(ns, make_pool):
    pool = make_pool(16)
    cache = TieredCache(pool, LRUPolicy())
    keys = keys_for(ns, 6)
    assert cache.lookup(keys) == (0, True)
    assert store(cache, keys[:4]) == keys[:4]
    assert cache.lookup(keys) == (4, True)
    assert cache.prepare_store(keys[:4]).keys == []
    assert store(cache, keys) == keys[4:]
    assert cache.lookup(keys) == (6, True)
    assert cache.stats().pool_used == 6


def test_in_flight_store_is_invisible_and_not_reserved_twice(ns, make_pool):
    cache = TieredCache(make_pool(8), LRUPolicy())
    keys = keys_for(ns, 3)
    first = cache.prepare_store(keys)
    assert cache.lookup(keys) == (0, True)
    assert cache.prepare_store(keys).keys == []  # dedupe: already in flight
    cache.complete_store(first.keys, ok=[True, False, True])
    assert cache.lookup(keys) == (1, True)
    assert cache.stats().cache.store_failed == 1
    assert cache.stats().pool_used == 2


def test_capacity_and_lru_eviction_order(ns, make_pool):
    cache = TieredCache(make_pool(4), LRUPolicy())
    a, b = keys_for(ns, 2, seed=1), keys_for(ns, 2, seed=2)
    store(cache, a)
    store(cache, b)
    cache.touch(a)
    c = keys_for(ns, 2, seed=3)
    store(cache, c)  # evicts b, the least recently used
    assert cache.lookup(a).hits == 2
    assert cache.lookup(b).hits == 0
    assert cache.stats().pool_used == 4
    evicted = [e.key for e in cache.take_events() if e.kind is EventKind.EVICTED]
    assert evicted == b[::-1]  # a prefix is evicted deepest first


def test_pinned_blocks_are_never_evicted(ns, make_pool):
    cache = TieredCache(make_pool(4), LRUPolicy())
    a = keys_for(ns, 4, seed=1)
    store(cache, a)
    slots = cache.prepare_load(a)
    assert len(slots) == 4
    res = cache.prepare_store(keys_for(ns, 2, seed=2))
    assert res.keys == []  # nothing evictable
    assert cache.stats().cache.store_skipped_full == 2
    cache.complete_load(a)
    assert len(cache.prepare_store(keys_for(ns, 2, seed=2)).keys) == 2


class CountingLRU(LRUPolicy):
    """LRU that records how many victims each ``evict`` call asked for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[int] = []

    def evict(self, n: int, pinned: Container[bytes]) -> list[bytes]:
        self.asked.append(n)
        return super().evict(n, pinned)


def test_policy_is_asked_for_no_more_victims_than_unpinned_blocks(ns, make_pool):
    # A pool pinned full (tier writes in flight) made every store scan the policy's whole order
    # for victims it could not have: it is asked for at most the unpinned visible blocks.
    policy = CountingLRU()
    cache = TieredCache(make_pool(4), policy)
    a = keys_for(ns, 4, seed=1)
    store(cache, a)
    cache.prepare_load(a[:3])
    first = cache.prepare_store(keys_for(ns, 3, seed=2))
    assert first.keys == keys_for(ns, 3, seed=2)[:1]  # the one unpinned block made room
    assert policy.asked == [1]
    assert cache.lookup(a).hits == 3
    cache.complete_store(first.keys)
    cache.prepare_load(first.keys)
    assert cache.prepare_store(keys_for(ns, 2, seed=3)).keys == []  # every block pinned
    assert policy.asked == [1]  # not asked at all
    assert cache.stats().cache.store_skipped_full == 4


def test_concurrent_load_of_same_blocks_answers_pending(ns, make_pool):
    cache = TieredCache(make_pool(8), LRUPolicy())
    keys = keys_for(ns, 3)
    store(cache, keys)
    cache.prepare_load(keys[:3])
    assert cache.lookup(keys) == (3, False)
    cache.complete_load(keys[:3])
    assert cache.lookup(keys) == (3, True)


def test_admission_filter_stores_on_nth_offer(ns, make_pool):
    cache = TieredCache(make_pool(8), LRUPolicy(), admission=AdmissionFilter(2))
    keys = keys_for(ns, 2)
    assert cache.prepare_store(keys).keys == []
    assert store(cache, keys) == keys
    assert cache.stats().cache.store_skipped_admission == 2


class ScriptedAdmitLRU(LRUPolicy):
    """LRU whose ``admit_store`` answers ``answer`` and records what it was asked."""

    def __init__(self, answer: int) -> None:
        super().__init__()
        self.answer = answer
        self.asked: list[tuple[int, int]] = []

    def admit_store(self, n: int, free: int) -> int:
        self.asked.append((n, free))
        return self.answer


def test_policy_admits_only_stores_that_need_more_than_the_free_slots(ns, make_pool):
    policy = ScriptedAdmitLRU(1)
    cache = TieredCache(make_pool(4), policy)
    a = keys_for(ns, 3, seed=1)
    assert store(cache, a) == a  # fits in the free slots: not asked
    assert policy.asked == []
    b = keys_for(ns, 3, seed=2)
    assert cache.prepare_store(b).keys == b[:1]  # needs 3, 1 free: the policy admits 1
    assert policy.asked == [(3, 1)]
    assert cache.stats().cache.store_skipped_admission == 2
    policy.answer = -5  # refusing everything, however it says so
    assert cache.prepare_store(keys_for(ns, 2, seed=3)).keys == []
    assert cache.stats().cache.store_skipped_admission == 4
    policy.answer = 99  # more than asked: all of them, evicting
    c = keys_for(ns, 2, seed=4)
    assert store(cache, c) == c
    assert cache.stats().cache.store_skipped_admission == 4


def test_policy_is_asked_about_what_the_admission_filter_let_through(ns, make_pool):
    policy = ScriptedAdmitLRU(0)
    cache = TieredCache(make_pool(2), policy, admission=AdmissionFilter(2))
    full = keys_for(ns, 2, seed=1)
    cache.prepare_store(full)
    assert store(cache, full) == full  # the second offer fills the pool (1 offer refused)
    keys = keys_for(ns, 3, seed=2)
    assert cache.prepare_store(keys[:1]).keys == []  # first offer: the filter's refusal
    assert cache.prepare_store(keys).keys == []  # 1 of 3 seen twice, 0 free: policy refuses
    assert policy.asked == [(1, 0)]
    assert cache.stats().cache.store_skipped_admission == 2 + 1 + 3
    assert cache.lookup(full).hits == 2


def test_promotion_from_secondary_tier(ns, make_pool):
    pool = make_pool(8)
    tier = ScriptedTier("slow", ns, pool)
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(tier, WriteMode.THROUGH)], copy_share=1.0)
    keys = keys_for(ns, 4)
    store(cache, keys)
    tier.release()
    cache.step()
    assert set(tier.stored) == set(keys)
    # Drop the pool copies by filling the pool with other blocks.
    store(cache, keys_for(ns, 8, seed=9))
    tier.release()
    cache.step()
    assert cache.lookup(keys).hits == 0
    first = cache.lookup(keys)
    assert first == (0, False)
    assert cache.lookup(keys) == (0, False)  # still in flight: no second job
    assert sum(1 for j in tier.submitted if j.kind.value == "read") == 1
    tier.release()
    cache.step()
    assert cache.lookup(keys) == (4, True)
    for key, slot in zip(keys, cache.prepare_load(keys), strict=True):
        assert bytes(pool.view(slot)) == key * (len(pool.view(slot)) // len(key))
    assert cache.stats().promoted == {"slow": 4}


def test_promotion_waits_for_writes_that_pin_the_whole_pool(ns, make_pool):
    """Every slot pinned by write-through jobs in flight: the lookup is pending (those writes
    free their slots when they end), not a final miss; with no write in flight, it is final."""
    pool = make_pool(4)
    tier = ScriptedTier("slow", ns, pool)
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(tier, WriteMode.THROUGH)], copy_share=1.0)
    wanted = keys_for(ns, 2, seed=1)
    tier.stored = {k: k * (pool.slot_bytes // len(k)) for k in wanted}
    store(cache, keys_for(ns, 4, seed=2))  # four writes in flight pin every slot
    assert cache.lookup(wanted) == (0, False)
    tier.release()
    cache.step()  # the writes ended: their slots are evictable again
    assert cache.lookup(wanted) == (0, False)  # the promotion is now in flight
    tier.release()
    cache.step()
    assert cache.lookup(wanted) == (2, True)

    binding = TierBinding(tier, WriteMode.THROUGH)
    other = TieredCache(make_pool(2), LRUPolicy(), [binding], copy_share=1.0)
    other.prepare_load(store(other, keys_for(ns, 2, seed=3)))  # pinned by loads, no write
    tier.release()
    other.step()
    assert other.lookup(wanted) == (0, True)


def test_failed_promotion_is_a_miss_and_not_retried_at_once(ns, make_pool):
    pool = make_pool(8)
    tier = ScriptedTier("slow", ns, pool)
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(tier)])
    keys = keys_for(ns, 2)
    tier.stored = {k: b"x" * 64 for k in keys}
    tier.fail_keys = {keys[0]}
    assert cache.lookup(keys) == (0, False)
    tier.release()
    cache.step()
    assert cache.lookup(keys) == (0, True)
    assert cache.stats().cache.promotion_failures == 1
    assert cache.stats().pool_used == 1  # keys[1] was promoted, keys[0]'s slot freed


def test_unknown_answer_is_pending(ns, make_pool):
    pool = make_pool(8)
    tier = ScriptedTier("remote", ns, pool)
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(tier)])
    keys = keys_for(ns, 2)
    tier.unknown = set(keys)
    assert cache.lookup(keys) == (0, False)
    tier.unknown = set()
    assert cache.lookup(keys) == (0, True)


def test_tier_exceptions_never_reach_the_caller(ns, make_pool):
    pool = make_pool(8)
    tier = ScriptedTier("broken", ns, pool)
    tier.raise_on = {"lookup", "submit", "poll"}
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(tier)], copy_share=1.0)
    keys = keys_for(ns, 3)
    assert cache.lookup(keys) == (0, True)
    store(cache, keys)  # write-through submit raises
    cache.step()
    assert cache.lookup(keys) == (3, True)
    assert tier.counters.errors >= 3
    assert cache.stats().cache.cascade_failures == 3
    assert cache.stats().pool_pinned == 0


def test_write_on_evict_holds_slot_until_written(ns, make_pool):
    pool = make_pool(8)
    tier = ScriptedTier("disk", ns, pool)
    binding = TierBinding(tier, WriteMode.ON_EVICT)
    cache = TieredCache(pool, LRUPolicy(), [binding], copy_share=0.25)
    a = keys_for(ns, 8, seed=1)
    store(cache, a)
    assert tier.submitted == []
    b = keys_for(ns, 2, seed=2)
    assert cache.prepare_store(b).keys == []  # two of a's slots are held by the write job
    assert pool.num_free == 0
    tier.release()
    cache.step()
    assert len(tier.stored) == 2 and set(tier.stored) <= set(a)
    assert pool.num_free == 2
    assert store(cache, b) == b


def test_copies_of_evicted_blocks_hold_at_most_their_share_of_the_pool(ns, make_pool):
    """Before: with a tier slower than the evictions, every evicted block held its slot until
    its copy ended, and the engine's stores found no room (the pool stopped serving)."""
    pool = make_pool(8)
    tier = ScriptedTier("slow disk", ns, pool)
    binding = TierBinding(tier, WriteMode.ON_EVICT)
    cache = TieredCache(pool, LRUPolicy(), [binding], copy_share=0.25)  # 2 blocks
    store(cache, keys_for(ns, 8, seed=1))
    assert store(cache, keys_for(ns, 2, seed=2)) == []  # two copies hold two slots: the most
    later = keys_for(ns, 2, seed=3)
    assert store(cache, later) == later  # evicted uncopied, their slots free at once
    assert cache.stats().cache.cascade_skipped == 2
    assert len(tier.submitted) == 1
    tier.release()
    cache.step()
    assert pool.num_free == 2 and cache.stats().cache.cascade_writes == 2


def test_stuck_promotion_times_out_and_keeps_slots_quarantined(ns, make_pool):
    now = [0.0]
    pool = make_pool(4)
    tier = ScriptedTier("stuck", ns, pool)
    cache = TieredCache(
        pool, LRUPolicy(), [TierBinding(tier)], job_timeout_s=5, clock=lambda: now[0]
    )
    keys = keys_for(ns, 2)
    tier.stored = {k: b"y" * 64 for k in keys}
    assert cache.lookup(keys) == (0, False)
    now[0] = 10.0
    cache.step()
    assert cache.lookup(keys) == (0, True)  # the request goes on without the stuck blocks
    assert pool.num_free == 2  # ... but the stuck job still owns its two slots
    tier.release()  # the job finally ends
    cache.step()
    assert pool.num_free == 4
    assert cache.lookup(keys).hits == 0  # a late result is never published
    assert cache.stats().cache.job_timeouts == 1


@pytest.mark.parametrize("mode", list(WriteMode))
def test_close_settles_running_jobs(ns, make_pool, mode):
    pool = make_pool(2)
    tier = ScriptedTier("disk", ns, pool)
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(tier, mode)])
    store(cache, keys_for(ns, 2, seed=1))
    store(cache, keys_for(ns, 2, seed=2))
    cache.close()
    assert cache.jobs_in_flight == 0
    assert cache.stats().pool_pinned == 0


def test_close_drops_the_blocks_waiting_to_be_written_through(ns, make_pool):
    pool = make_pool(8)
    tier = ScriptedTier("slow disk", ns, pool)
    binding = TierBinding(tier, WriteMode.THROUGH)
    cache = TieredCache(pool, LRUPolicy(), [binding], copy_share=0.25)  # 2 blocks
    store(cache, keys_for(ns, 2, seed=1))
    store(cache, keys_for(ns, 6, seed=2))  # their copies wait for room
    cache.close()
    assert len(tier.submitted) == 1  # no copy starts on a closed tier
    assert cache.stats().cache.cascade_skipped == 6
    assert cache.jobs_in_flight == 0


def test_write_back_copies_coldest_blocks_ahead_so_eviction_frees_at_once(ns, make_pool):
    now = [0.0]
    pool = make_pool(4)
    tier = ScriptedTier("disk", ns, pool)
    cache = TieredCache(
        pool,
        LRUPolicy(),
        [TierBinding(tier, WriteMode.ON_EVICT)],
        writeback_window=2,
        clock=lambda: now[0],
    )
    a = keys_for(ns, 4, seed=1)
    store(cache, a)
    tail, head = a[:1:-1], a[1::-1]  # a prefix is evicted deepest first
    cache.step()
    assert [job.keys for job in tier.submitted] == [tail]  # only the two coldest
    assert cache.stats().pool_pinned == 2  # pinned while being copied
    tier.release()
    cache.step()
    assert set(tier.stored) == set(tail)
    b = keys_for(ns, 2, seed=2)
    assert store(cache, b) == b  # the clean victims freed their slots at once
    assert cache.lookup(a[:2]).hits == 2
    tier.fail_keys = set(head)
    cache.step()  # write-back of a's head submitted (they are now the coldest)
    tier.release()
    cache.step()  # the copies failed: still dirty, retried after a pause (not every step)
    assert len(tier.submitted) == 2
    now[0] += 0.05
    cache.step()
    assert [job.keys for job in tier.submitted][-1] == head
    assert len(tier.submitted) == 3
    tier.release()  # fails again: the pause doubles
    cache.step()
    now[0] += 0.05
    cache.step()
    assert len(tier.submitted) == 3
    now[0] += 0.05
    tier.fail_keys = set()
    cache.step()
    assert len(tier.submitted) == 4
    tier.release()  # a copy that works ends the pause
    cache.step()
    assert set(head) <= set(tier.stored)


class NewestFirstPolicy(LRUPolicy):
    """Coldest blocks the newest: like ``hinted`` under pressure, whose first victims are the
    newest unproven blocks, its coldest blocks change with every store."""

    def coldest(self, n: int) -> list[bytes]:
        return list(reversed(super().coldest(len(self))))[:n]


def test_early_copies_in_flight_never_pin_more_than_the_window(ns, make_pool):
    pool = make_pool(32)  # no evictions: every copy is an early one
    tier = ScriptedTier("disk", ns, pool)  # its jobs end only when released
    cache = TieredCache(
        pool, NewestFirstPolicy(), [TierBinding(tier, WriteMode.ON_EVICT)], writeback_window=4
    )
    for seed in range(6):
        store(cache, keys_for(ns, 3, seed=seed))
        cache.step()
        assert cache.stats().pool_pinned <= 4
    assert sum(len(job.keys) for job in tier.submitted) == 4
    tier.release()
    cache.step()  # the copies ended: the window has room again
    assert cache.stats().pool_pinned == 4
    assert sum(len(job.keys) for job in tier.submitted) == 8


class RefusingPolicy(LRUPolicy):
    """Refuses every store that needs an eviction (as ``hinted`` does under pressure)."""

    def admit_store(self, n: int, free: int) -> int:
        return min(n, free)


def test_the_policy_decides_stores_while_copies_to_the_tier_have_no_room(ns, make_pool):
    """Before: with a tier below, the pool took every store whether or not the tier could take
    what it evicted, and with a tier slower than the stores it kept less than with no tier."""
    pool = make_pool(8)
    tier = ScriptedTier("slow disk", ns, pool)
    binding = TierBinding(tier, WriteMode.THROUGH)
    cache = TieredCache(pool, RefusingPolicy(), [binding], copy_share=0.25)  # 2 blocks
    first, waiting = keys_for(ns, 2, seed=1), keys_for(ns, 6, seed=2)
    store(cache, first)  # two copies in flight: no room for more
    store(cache, waiting)  # fits in the free slots; its copies wait for room
    assert store(cache, keys_for(ns, 2, seed=3)) == []  # would evict blocks the tier lacks
    assert cache.stats().cache.store_skipped_admission == 2
    written = []
    for _ in range(4):  # two copies at a time, in the order stored
        tier.release()
        cache.step()
        written.append(list(tier.stored))
    assert written == [first, first + waiting[:2], first + waiting[:4], first + waiting]
    later = keys_for(ns, 2, seed=4)
    assert store(cache, later) == later  # the tier has what the pool evicts
    assert cache.stats().cache.store_skipped_admission == 2
    assert cache.stats().cache.cascade_skipped == 0


def test_a_block_waiting_to_be_written_through_is_dropped_when_evicted(ns, make_pool):
    pool = make_pool(8)
    tier = ScriptedTier("slow disk", ns, pool)
    binding = TierBinding(tier, WriteMode.THROUGH)
    cache = TieredCache(pool, LRUPolicy(), [binding], copy_share=0.25)  # 2 blocks
    store(cache, keys_for(ns, 2, seed=1))  # being copied: pinned
    waiting = keys_for(ns, 6, seed=2)
    store(cache, waiting)
    store(cache, keys_for(ns, 2, seed=3))  # evicts two blocks that wait (the rest are pinned)
    assert cache.stats().cache.cascade_skipped == 2
    for _ in range(4):
        tier.release()
        cache.step()
    assert len(tier.stored) == 2 + 4 + 2  # the evicted two were never written
    assert cache.stats().cache.cascade_writes == 8


@pytest.mark.parametrize("tiered", [False, True])
def test_the_policy_refuses_stores_only_without_a_tier_below(ns, make_pool, tiered):
    pool = make_pool(4)
    tier = ScriptedTier("disk", ns, pool)
    tiers = [TierBinding(tier, WriteMode.THROUGH)] if tiered else []
    cache = TieredCache(pool, RefusingPolicy(), tiers, copy_share=1.0)
    store(cache, keys_for(ns, 4, seed=1))
    tier.release()  # the tier has them: evicting them frees their slots at once
    cache.step()
    stored = store(cache, keys_for(ns, 2, seed=2))
    # With a tier below, the evicted blocks are kept there; a refused block is lost to both.
    assert len(stored) == (2 if tiered else 0)
    assert cache.stats().cache.store_skipped_admission == (0 if tiered else 2)
