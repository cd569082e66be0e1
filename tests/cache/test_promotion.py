"""Promotions for waiting requests under pressure (``kvtier.cache.promotion``): blocks promoted
for a request stay until it loads them, a budget caps what promotions hold, a tier slower than
the engine is not waited for, a wait ends at its deadline, and an empty tier is not asked."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from support.blocks import keys_for
from support.scripted_tier import ScriptedTier

from kvtier import series
from kvtier.cache.manager import TierBinding, TieredCache
from kvtier.cache.promotion import (
    Claim,
    ComputeRate,
    PromotionRules,
    PromotionSettings,
    ReadCost,
)
from kvtier.keys import BlockKey, Namespace
from kvtier.policies import LRUPolicy
from kvtier.pool import HostPool
from kvtier.tiers.base import TierJobKind


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def payload(key: BlockKey, size: int) -> bytes:
    return (key * (size // len(key) + 1))[:size]


def store(cache: TieredCache, pool: HostPool, keys: Sequence[BlockKey]) -> list[BlockKey]:
    res = cache.prepare_store(keys)
    for key, slot in zip(res.keys, res.slots, strict=True):
        pool.view(slot)[:] = payload(key, pool.slot_bytes)
    cache.complete_store(res.keys)
    return res.keys


def check_settled(cache: TieredCache, tier: ScriptedTier) -> None:
    tier.release()  # the cascade's writes
    cache.step()
    cache.check_invariants(settled=True)


def reads(tier: ScriptedTier) -> int:
    return sum(job.kind is TierJobKind.READ for job in tier.submitted)


def tier_with(ns: Namespace, pool: HostPool, keys: Sequence[BlockKey]) -> ScriptedTier:
    tier = ScriptedTier("fs", ns, pool)
    tier.stored = {k: payload(k, pool.slot_bytes) for k in keys}
    return tier


# -- the rules alone ------------------------------------------------------------------------------


def test_read_cost_counts_service_time_not_queueing():
    cost = ReadCost()
    cost.started(10)
    cost.started(10)
    cost.ended(10, submitted=0.0, now=1.0)  # 0.1 s per block
    cost.ended(10, submitted=0.0, now=2.0)  # queued behind the first: served from 1.0 to 2.0
    assert cost.seconds_per_block == pytest.approx(0.1)
    assert cost.outstanding == 0
    cost.started(5)
    assert cost.expected_s(3, now=2.5) == pytest.approx((5 + 3) * 0.1)


def test_read_cost_takes_the_tiers_own_busy_time():
    """Before: the time until the engine's next step collected the result counted as reading
    (the CPU demo's fs tier measured 3.4 ms per 32 KiB block, so every promotion was declined)."""
    cost = ReadCost()
    cost.started(10)
    cost.ended(10, submitted=0.0, now=5.0, busy_s=0.01)
    assert cost.seconds_per_block == pytest.approx(0.001)


def test_an_idle_tier_measured_long_ago_is_read_again():
    """Before: one slow first read declined every later promotion for good (a declined one
    measures nothing), and the CPU demo loaded 0 tokens from its fs tier instead of 65%."""
    cost = ReadCost()
    cost.ended(10, submitted=0.0, now=1.0)
    assert cost.expected_s(4, now=1.5) == pytest.approx(0.4)
    assert cost.expected_s(4, now=2.5) is None  # probe: claimed as if unmeasured
    cost.started(10)
    assert cost.expected_s(4, now=2.5) == pytest.approx(1.4)  # reads running: still known
    cost.ended(10, submitted=2.5, now=3.5)
    cost.declined = 16  # declined again and again within a second
    assert cost.expected_s(4, now=3.6) is None


def test_compute_rate_is_a_requests_share_of_the_step():
    rate = ComputeRate()
    rate.step(4000, now=0.0, requests=4)
    rate.step(0, now=1.0)
    assert rate.tokens_per_s == pytest.approx(1000.0)  # each of the 4 got a quarter


def test_compute_rate_ignores_decode_steps():
    rate = ComputeRate()
    rate.step(1000, now=0.0)
    rate.step(8, now=0.5)  # the 1000-token step took 0.5 s
    rate.step(1000, now=10.0)  # an 8-token step says nothing about prefill
    assert rate.tokens_per_s == pytest.approx(2000.0)
    assert rate.seconds(4000) == pytest.approx(2.0)


def test_compute_rate_shrugs_off_a_step_timed_with_the_wrong_interval():
    rate = ComputeRate()
    for i in range(10):
        rate.step(1000, now=float(i))
    rate.step(1000, now=10.0)
    rate.step(1000, now=10.001)  # an engine back from idle schedules two steps 1 ms apart
    for i in range(3):
        rate.step(1000, now=11.0 + i)
    assert rate.tokens_per_s == pytest.approx(1000.0)


def test_claim_is_capped_by_the_budget_and_what_promotions_hold():
    rules = PromotionRules(1, PromotionSettings(1.0, block_tokens=16), 10, 30.0)
    assert rules.claim([0] * 8, in_flight=0, now=0.0).blocks == 8  # nothing measured: claim
    assert rules.claim([0] * 12, in_flight=0, now=0.0).blocks == 10  # alone: the part that fits
    assert rules.claim([0] * 4, in_flight=6, now=0.0).blocks == 4
    rules.promised_pins = 4
    assert rules.claim([0] * 8, in_flight=6, now=0.0).blocks == 0


@pytest.mark.parametrize("in_flight, pinned", [(6, 0), (0, 6), (3, 3)])
def test_a_run_that_does_not_fit_beside_other_promotions_is_not_claimed_in_part(
    in_flight: int, pinned: int
) -> None:
    # A part now and the rest in later rounds made the request wait a scheduling pass per round.
    rules = PromotionRules(1, PromotionSettings(1.0, block_tokens=16), 10, 30.0)
    rules.promised_pins = pinned
    assert rules.claim([0] * 5, in_flight=in_flight, now=0.0).blocks == 0
    assert rules.claim([0] * 4, in_flight=in_flight, now=0.0).blocks == 4


def test_claim_stops_where_reading_would_take_longer_than_computing():
    rules = PromotionRules(2, PromotionSettings(1.0, block_tokens=100), 1000, 30.0)
    rules.compute.tokens_per_s = 1000.0  # a block computes in 0.1 s
    rules.reads[0].seconds_per_block = 0.01
    rules.reads[1].seconds_per_block = 0.5  # slower than computing
    rules.reads[0].measured_at = rules.reads[1].measured_at = 5.0
    claim = rules.claim([0, 0, 0, 1, 1], in_flight=0, now=5.0)
    assert claim.blocks == 3
    assert claim.deadline == pytest.approx(5.0 + 0.3)  # computing those 3 blocks would take 0.3 s


def test_a_backlog_makes_a_short_run_not_worth_reading():
    rules = PromotionRules(1, PromotionSettings(1.0, block_tokens=100), 1000, 30.0)
    rules.compute.tokens_per_s = 1000.0  # 0.1 s per block
    rules.reads[0].seconds_per_block = 0.05
    rules.reads[0].measured_at = 0.0
    assert rules.claim([0] * 4, in_flight=0, now=0.0).blocks == 4
    rules.reads[0].outstanding = 20  # 1 s of reads queued ahead
    assert rules.claim([0] * 4, in_flight=0, now=0.0).blocks == 0
    assert rules.claim([0] * 30, in_flight=0, now=0.0).blocks == 30  # long enough to pay off


def reference_claim(
    rules: PromotionRules, run_tiers: list[int], in_flight: int, now: float
) -> Claim:
    """``PromotionRules.claim`` as it was, trying every prefix from the shortest."""
    room = rules.budget - in_flight - rules.promised_pins
    n = max(0, min(len(run_tiers), room))
    if n < len(run_tiers) and (in_flight or rules.promised_pins):
        n = 0
    if not rules.weigh:
        return Claim(n, now + rules.max_wait_s)
    best, wait = 0, 0.0
    per_tier: dict[int, int] = {}
    for i in range(n):
        per_tier[run_tiers[i]] = per_tier.get(run_tiers[i], 0) + 1
        expected = [rules.reads[t].expected_s(b, now) for t, b in per_tier.items()]
        read = None if None in expected else max([0.0, *expected])
        compute = rules.compute.seconds((i + 1) * rules.block_tokens)
        if read is None or compute is None or read <= compute:
            best, wait = i + 1, compute if compute is not None else rules.max_wait_s
    for tier in set(run_tiers[best:n]):
        rules.reads[tier].declined += 1
    wait = max(wait, 2 * rules.compute.step_s)
    return Claim(best, now + min(rules.max_wait_s, wait))


def test_claim_tried_from_the_longest_run_decides_as_trying_every_prefix():
    """The claim tries the whole run first (a waiting request asks again every step; trying
    each prefix cost a tier read estimate per block): same blocks, deadline and declines as
    trying every prefix, over random rates, backlogs, tiers and ties."""
    rng = random.Random(7)
    for case in range(3000):
        tiers = rng.choice([1, 1, 2, 3])
        block_tokens = rng.choice([1, 16, 100])
        pair = [PromotionRules(tiers, PromotionSettings(1.0, block_tokens=block_tokens), 400, 30.0)]
        pair.append(
            PromotionRules(tiers, PromotionSettings(1.0, block_tokens=block_tokens), 400, 30.0)
        )
        rate = rng.choice([None, 1000.0, rng.uniform(10, 1e5)])
        step_s = rng.uniform(0, 0.05)
        costs = []
        for _ in range(tiers):
            spb = rng.choice([None, 0.001, rng.uniform(1e-5, 0.5)])
            if case % 5 == 0 and rate is not None:
                spb = block_tokens / rate  # reading a block takes exactly as long as computing it
            costs.append((spb, rng.choice([0, 0, 3, rng.randrange(200)]), rng.choice([5.0, 3.0])))
        for rules in pair:
            rules.compute.tokens_per_s = rate
            rules.compute.step_s = step_s
            for cost, (spb, outstanding, measured_at) in zip(rules.reads, costs, strict=True):
                cost.seconds_per_block, cost.outstanding, cost.measured_at = (
                    spb,
                    outstanding,
                    measured_at,
                )
        if tiers == 1:
            run = [0] * rng.randrange(60)
        else:
            run = [rng.randrange(tiers) for _ in range(rng.randrange(60))]
        in_flight = rng.choice([0, 50, 390])
        got = pair[0].claim(run, in_flight, now=5.0)
        want = reference_claim(pair[1], run, in_flight, now=5.0)
        assert (got.blocks, got.deadline) == (want.blocks, want.deadline), case
        assert [c.declined for c in pair[0].reads] == [c.declined for c in pair[1].reads], case


# -- the manager --------------------------------------------------------------------------------


def tiered(
    ns: Namespace, pool: HostPool, keys: Sequence[BlockKey]
) -> tuple[ScriptedTier, TieredCache]:
    """A cache over ``pool`` with one write-through tier holding ``keys``."""
    tier = tier_with(ns, pool, keys)
    # Every block written through at once (the tests settle the copies in one step).
    return tier, TieredCache(pool, LRUPolicy(), [TierBinding(tier)], copy_share=1.0)


def clocked(
    ns: Namespace, pool: HostPool, keys: Sequence[BlockKey]
) -> tuple[ScriptedTier, TieredCache, Clock]:
    """``tiered`` on a test clock, with blocks of 4 tokens."""
    clock = Clock()
    tier = tier_with(ns, pool, keys)
    settings = PromotionSettings(block_tokens=4)
    # Every block written through may stay pinned (the tests fill the pool with such writes).
    cache = TieredCache(
        pool, LRUPolicy(), [TierBinding(tier)], clock=clock, promotion=settings, copy_share=1.0
    )
    return tier, cache, clock


def measure_engine(cache: TieredCache, clock: Clock) -> None:
    """30 engine steps of 10 ms, 400 tokens each: 40,000 tokens/s, a block computed in 0.1 ms, so
    a claim's wait is its floor of two steps (20 ms: an engine asks again once a step)."""
    for _ in range(30):
        cache.engine_step(400)
        clock.now += 0.01


def promote_for(cache: TieredCache, tier: ScriptedTier, keys: list[BlockKey], owner: str) -> None:
    assert cache.lookup(keys, owner) == (0, False)
    tier.release()
    cache.step()


def test_blocks_promoted_for_a_request_are_not_evicted_before_it_loads_them(ns, make_pool):
    """Before: stores of other requests evicted them, and the request promoted them again."""
    pool = make_pool(8)
    wanted = keys_for(ns, 4, seed=1)
    tier, cache = tiered(ns, pool, wanted)
    promote_for(cache, tier, wanted, "a")
    assert store(cache, pool, keys_for(ns, 8, seed=2)) != []  # room only for the free 4 slots
    assert cache.lookup(wanted, "a") == (4, True)
    slots = cache.prepare_load(wanted, "a")
    assert [bytes(pool.view(s)) for s in slots] == [payload(k, pool.slot_bytes) for k in wanted]
    cache.complete_load(wanted)
    assert reads(tier) == 1  # read once
    stats = cache.stats().cache
    assert (stats.promoted_blocks, stats.loaded_blocks) == (4, 4)
    check_settled(cache, tier)


def test_a_promotion_does_not_evict_the_pool_hits_of_its_own_request(ns, make_pool):
    """The request's hits are the least recently used blocks of a full pool: the promotion of
    its tail takes its slots from other blocks, so the request then hits all of it."""
    pool = make_pool(8)
    head, tail = keys_for(ns, 2, seed=1), keys_for(ns, 2, seed=2)
    tier, cache = tiered(ns, pool, tail)
    store(cache, pool, head)
    store(cache, pool, keys_for(ns, 6, seed=3))  # newer: the pool is full
    check_settled(cache, tier)  # the write-through copies end, their pins with them
    request = [*head, *tail]
    assert cache.lookup(request, "a") == (2, False)
    assert [job.keys for job in tier.submitted if job.kind is TierJobKind.READ] == [tail]
    tier.release()
    cache.step()
    assert cache.lookup(request, "a") == (4, True)
    assert cache.stats().cache.pool_evictions == 2
    cache.forget("a")
    check_settled(cache, tier)


def test_a_request_that_leaves_releases_its_promoted_blocks(ns, make_pool):
    pool = make_pool(8)
    wanted = keys_for(ns, 4, seed=1)
    tier, cache = tiered(ns, pool, wanted)
    promote_for(cache, tier, wanted, "a")
    assert cache.stats().pool_pinned == 4
    cache.forget("a")
    assert cache.stats().pool_pinned == 0
    assert len(store(cache, pool, keys_for(ns, 8, seed=2))) == 8  # evictable again
    check_settled(cache, tier)


def test_promoted_blocks_of_a_request_that_never_returns_are_released_after_the_lease(
    ns, make_pool
):
    pool = make_pool(8)
    clock = Clock()
    wanted = keys_for(ns, 4, seed=1)
    tier = tier_with(ns, pool, wanted)
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(tier)], clock=clock)
    promote_for(cache, tier, wanted, "a")
    clock.now += 31.0
    cache.step()
    check_settled(cache, tier)


def test_the_budget_serves_requests_in_order_and_the_next_one_does_not_wait(ns, make_pool):
    pool = make_pool(16)  # budget 0.5: 8 slots
    first, second, third = (keys_for(ns, n, seed=i) for i, n in ((1, 6), (2, 6), (3, 2)))
    tier, cache = tiered(ns, pool, [*first, *second, *third])
    assert cache.lookup(first, "a") == (0, False)
    assert cache.lookup(second, "b") == (0, True)  # 2 slots left: no part of it, no wait
    assert cache.lookup(third, "c") == (0, False)  # fits the 2 slots left
    assert [len(job.keys) for job in tier.submitted] == [6, 2]
    tier.release()
    cache.step()
    assert cache.lookup(first, "a") == (6, True)
    assert cache.lookup(third, "c") == (2, True)
    assert cache.stats().cache.promotions_declined == 6  # b's run
    assert cache.lookup(second, "b") == (0, True)  # budget spent on pins: no wait at all
    cache.prepare_load(first, "a")
    cache.complete_load(first)
    cache.prepare_load(third, "c")
    cache.complete_load(third)
    assert cache.lookup(second, "b") == (0, False)  # room again


def test_a_run_goes_on_past_blocks_a_tier_could_not_tell_yet(ns, make_pool):
    """Before: the first round's blocks were the final answer, so a Redis tier whose presence
    cache knew only part of a prompt served 11 or 19 of its 27 blocks to a second engine."""
    pool = make_pool(16)
    keys = keys_for(ns, 4, seed=1)
    tier = tier_with(ns, pool, keys)
    tier.unknown = set(keys[2:])
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(tier)])
    assert cache.lookup(keys, "a") == (0, False)
    tier.unknown.clear()
    tier.release()
    assert cache.lookup(keys, "a") == (2, False)  # a second round for the rest
    tier.release()
    assert cache.lookup(keys, "a") == (4, True)
    assert cache.stats().pool_pinned == 4  # both rounds held for the request
    cache.prepare_load(keys, "a")
    cache.complete_load(keys)
    check_settled(cache, tier)


def test_stats_report_the_prefill_rate_the_rules_measured(ns, make_pool):
    tier, cache, clock = clocked(ns, make_pool(16), keys_for(ns, 4, seed=1))
    assert cache.stats().prefill_tokens_per_s is None
    assert series.pool_gauges(cache.stats())["kvtier_prefill_tokens_per_second"] == {"": 0}
    cache.engine_step(4000, requests=2)
    clock.now += 1.0
    cache.engine_step(0)
    stats = cache.stats()
    assert stats.prefill_tokens_per_s == pytest.approx(2000.0)  # each prefill's share
    assert stats.to_dict()["prefill_tokens_per_s"] == pytest.approx(2000.0)
    assert series.pool_gauges(stats)["kvtier_prefill_tokens_per_second"] == {"": 2000}
    check_settled(cache, tier)


def test_stats_report_each_tiers_read_rate_the_rules_measured(ns, make_pool):
    keys = keys_for(ns, 4, seed=1)
    tier, cache, clock = clocked(ns, make_pool(16), keys)
    assert cache.stats().read_tokens_per_s == {}
    assert series.pool_gauges(cache.stats())["kvtier_tier_read_tokens_per_second"] == {"fs": 0}
    assert cache.lookup(keys, "a") == (0, False)
    clock.now += 2.0  # 4 blocks of 4 tokens in 2 s
    tier.release()
    cache.step()
    stats = cache.stats()
    assert stats.read_tokens_per_s == {"fs": pytest.approx(8.0)}
    assert stats.to_dict()["read_tokens_per_s"] == {"fs": pytest.approx(8.0)}
    assert series.pool_gauges(stats)["kvtier_tier_read_tokens_per_second"] == {"fs": 8}
    cache.prepare_load(keys, "a")
    cache.complete_load(keys)
    check_settled(cache, tier)


def test_a_tier_slower_than_computing_is_not_waited_for(ns, make_pool):
    pool = make_pool(16)
    first, later = keys_for(ns, 4, seed=1), keys_for(ns, 4, seed=2)
    tier, cache, clock = clocked(ns, pool, [*first, *later])
    cache.engine_step(4000)
    clock.now += 1.0
    cache.engine_step(0)  # 4,000 tokens/s: a block of 4 tokens computes in 1 ms
    assert cache.lookup(first, "a") == (0, False)
    clock.now += 2.0  # the read took 0.5 s per block
    tier.release()
    cache.step()
    assert cache.lookup(later, "b") == (0, True)
    assert cache.stats().cache.promotions_declined == 4
    assert reads(tier) == 1


def test_while_others_share_the_engine_a_read_may_take_twice_the_requests_compute(ns, make_pool):
    first, later = keys_for(ns, 4, seed=1), keys_for(ns, 4, seed=2)
    tier, cache, clock = clocked(ns, make_pool(16), [*first, *later])
    cache.engine_step(4000)
    clock.now += 1.0
    cache.engine_step(0)  # 4,000 tokens/s, the engine running one request: 1 ms a block
    assert cache.lookup(first, "a") == (0, False)
    clock.now += 0.006  # read at 1.5 ms a block
    tier.release()
    cache.step()
    assert cache.lookup(later, "b") == (0, True)  # 6 ms to read, 4 to compute: declined
    assert cache.stats().cache.promotions_declined == 4
    cache.engine_step(0, running=3)  # others share the steps: computing costs them too
    assert cache.lookup(later, "c") == (0, False)  # 6 ms is within twice 4: read
    clock.now += 0.006
    tier.release()
    cache.step()
    assert cache.lookup(later, "c") == (4, True)
    cache.prepare_load(later, "c")
    cache.complete_load(later)
    cache.prepare_load(first, "a")
    cache.complete_load(first)
    check_settled(cache, tier)


def test_a_wait_ends_at_its_deadline_with_what_landed(ns, make_pool):
    keys = keys_for(ns, 4, seed=1)
    tier, cache, clock = clocked(ns, make_pool(16), keys)
    measure_engine(cache, clock)  # computing the 4 blocks takes 0.4 ms: the wait is 20 ms
    assert cache.lookup(keys, "a") == (0, False)
    clock.now += 0.015
    assert cache.lookup(keys, "a") == (0, False)
    clock.now += 0.01  # past the deadline, the read still running
    assert cache.lookup(keys, "a") == (0, True)
    tier.release()
    cache.step()
    assert cache.lookup(keys, "a") == (4, True)  # landed later: a hit, but no second promotion
    assert reads(tier) == 1
    cache.forget("a")
    check_settled(cache, tier)


def test_a_wait_for_room_in_a_pool_pinned_by_writes_ends_at_the_claims_deadline(ns, make_pool):
    """Before: a request whose blocks found no slot waited as long as any tier write ran, and
    under a steady stream of stores one always does."""
    pool = make_pool(8)
    wanted = keys_for(ns, 4, seed=1)
    tier, cache, clock = clocked(ns, pool, wanted)
    measure_engine(cache, clock)
    stored = store(cache, pool, keys_for(ns, 8, seed=2))
    assert cache.stats().pool_pinned == 8  # every slot pinned by its write-through copy
    asked: list[int] = []
    ask = tier.lookup
    tier.lookup = lambda keys: asked.append(len(keys)) or ask(keys)  # type: ignore[method-assign]
    for _ in range(2):
        assert cache.lookup(wanted, "a") == (0, False)  # a write may end and free a slot
        clock.now += 0.01
    assert asked == [1, 4]  # asked again, it waits on without looking the tier up again
    assert cache.lookup(wanted, "a") == (0, True)  # past the deadline: computed instead
    assert cache.lookup(wanted, "b") == (0, False)  # another request's wait is its own
    assert reads(tier) == 0 and len(stored) == 8
    tier.release()  # the writes end: room again, and an engine that asks again gets a promotion
    cache.step()
    assert cache.lookup(wanted, "a") == (0, False)
    assert reads(tier) == 1
    cache.forget("a")
    clock.now += 31.0  # "b" never came back: its wait is dropped after the lease
    cache.step()
    assert not cache._rules.room_waits
    check_settled(cache, tier)


def test_a_wait_for_room_is_spent_once_for_a_request_the_engine_asks_again(ns, make_pool):
    """Before: the load its final answer prepared ended the wait, so an engine that had no room
    for the request asked again and it waited anew, each ask till a fresh deadline, while the
    requests behind it were scheduled first (the 32x2 replay's slowest request waited 2.4 s)."""
    pool = make_pool(8)
    wanted = keys_for(ns, 4, seed=1)
    tier, cache, clock = clocked(ns, pool, wanted)
    measure_engine(cache, clock)
    store(cache, pool, keys_for(ns, 8, seed=2))  # every slot pinned by its write-through copy
    result, slots = cache.lookup_and_pin(wanted, "a")
    assert (result, slots) == ((0, False), [])
    clock.now += 0.03  # past the deadline
    assert cache.lookup_and_pin(wanted, "a") == ((0, True), [])  # the engine has no room yet
    for _ in range(3):
        clock.now += 0.01
        assert cache.lookup_and_pin(wanted, "a") == ((0, True), [])  # no wait again
    cache.forget("a")  # it left: a later request of the same id may wait again
    assert cache.lookup_and_pin(wanted, "a") == ((0, False), [])
    cache.forget("a")
    check_settled(cache, tier)


def test_a_waiting_lookup_sees_what_landed_since_the_last_step(ns, make_pool):
    """Before: a block that landed during the engine's step was seen only at the next step's
    housekeeping, after the lookup that asked again."""
    pool = make_pool(16)
    keys = keys_for(ns, 4, seed=1)
    tier, cache = tiered(ns, pool, keys)
    assert cache.lookup(keys, "a") == (0, False)
    tier.release()  # no step() in between
    assert cache.lookup(keys, "a") == (4, True)
    cache.prepare_load(keys, "a")
    cache.complete_load(keys)
    check_settled(cache, tier)


class CountingTier(ScriptedTier):
    def __init__(self, name: str, namespace: Namespace, pool: HostPool) -> None:
        super().__init__(name, namespace, pool)
        self.asked = 0
        self.generations_read = 0

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        self.asked += len(keys)
        return super().lookup(keys)

    def is_empty(self) -> bool:
        return not self.stored

    def generation(self) -> int:
        self.generations_read += 1
        return len(self.stored)


def test_an_empty_tier_is_not_asked_and_a_miss_asks_one_key(ns, make_pool):
    """Before: every lookup asked every tier for the request's whole tail, and (the tiers all
    empty, as an fs tier on a full disk) read their generations to keep an empty answer."""
    pool = make_pool(8)
    tier = CountingTier("fs", ns, pool)
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(tier)])
    keys = keys_for(ns, 50, seed=1)
    assert cache.lookup(keys, "a") == (0, True)
    assert tier.asked == 0 and tier.generations_read == 0
    tier.stored = {b"x" * 16: b""}
    assert cache.lookup(keys, "a") == (0, True)
    assert tier.asked == 1


class FullTier(ScriptedTier):
    """A tier without room: every write is rejected (counted as the fs tier counts a full disk)."""

    def __init__(self, name: str, namespace: Namespace, pool: HostPool) -> None:
        super().__init__(name, namespace, pool)
        self.full = True

    def release(self, count: int | None = None) -> None:
        for job in self.pending if self.full else ():
            if job.kind is TierJobKind.WRITE:
                self.fail_keys.update(job.keys)
                self.counters.rejected += len(job.keys)
        super().release(count)
        self.fail_keys.clear()


def test_writes_to_a_tier_without_room_pause_until_it_stores_again(ns, make_pool):
    """Before: every store sent a write job to a full disk (1.59 M blocks in the benchmark)."""
    pool = make_pool(64)
    clock = Clock()
    tier = FullTier("fs", ns, pool)
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(tier)], clock=clock)
    store(cache, pool, keys_for(ns, 2, seed=1))
    tier.release()
    cache.step()
    assert len(tier.submitted) == 1
    for seed in range(2, 6):
        store(cache, pool, keys_for(ns, 2, seed=seed))
    assert len(tier.submitted) == 1
    assert cache.stats().cache.cascade_skipped == 8
    clock.now += 0.6  # the first pause ended
    tier.full = False
    store(cache, pool, keys_for(ns, 2, seed=7))
    assert len(tier.submitted) == 2
    tier.release()
    cache.step()
    store(cache, pool, keys_for(ns, 2, seed=8))
    assert len(tier.submitted) == 3  # stored again: no pause
    check_settled(cache, tier)


class RaisingEmptiness(ScriptedTier):
    def is_empty(self) -> bool:
        raise RuntimeError("a plugin's is_empty fails")


def test_a_tier_whose_emptiness_check_raises_is_asked(ns, make_pool):
    pool = make_pool(8)
    keys = keys_for(ns, 2, seed=1)
    tier = RaisingEmptiness("plugin", ns, pool)
    tier.stored = {k: payload(k, pool.slot_bytes) for k in keys}
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(tier)])
    assert cache.lookup(keys, "a") == (0, False)  # promoting: asked, not skipped
    tier.release()
    assert cache.lookup(keys, "a") == (2, True)
