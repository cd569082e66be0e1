"""A waiting request's tier answers kept while no tier changed (``promotion.KeptAnswers``): an
engine asks again for each waiting request at every step, and the tiers are not asked again
while their ``generation()`` stays the same; a block written, deleted or evicted between two asks
changes the answer, exactly as asking again would."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from itertools import takewhile
from pathlib import Path

import pytest
from support.blocks import fill, keys_for
from support.drivers import run_job
from support.scripted_tier import ScriptedTier

from kvtier.cache import promotion
from kvtier.cache.manager import TierBinding, TieredCache
from kvtier.cache.promotion import PromotionSettings
from kvtier.keys import BlockKey, Namespace
from kvtier.policies import LRUPolicy
from kvtier.pool import HostPool
from kvtier.tiers.base import TierJob, TierJobKind
from kvtier.tiers.fs.tier import FsTier, Options
from kvtier.tiers.payload import HEADER_BYTES

JOB_IDS = itertools.count(1_000_000)
"""The test's own jobs on the tier (the cache submits none here: its promotions are declined)."""


class Asked:
    """Counts the keys ``exists`` of a tier is asked for."""

    def __init__(self, tier: FsTier) -> None:
        self.keys = 0
        exists = tier.exists

        def counting(keys: Sequence[BlockKey]) -> list[bool | None]:
            self.keys += len(keys)
            return exists(keys)

        tier.exists = counting  # type: ignore[method-assign]


@pytest.fixture
def fs(tmp_path: Path, ns: Namespace, make_pool) -> Iterator[tuple[HostPool, FsTier]]:
    pool = make_pool(16)
    capacity = 4 * (HEADER_BYTES + pool.slot_bytes)
    tier = FsTier("fs", ns, pool, Options(path=str(tmp_path / "kv"), capacity=capacity))
    yield pool, tier
    tier.close()


def write(pool: HostPool, tier: FsTier, keys: Sequence[BlockKey]) -> None:
    (slot,) = pool.alloc(1)
    try:
        for key in keys:
            fill(pool, slot, key)
            job = TierJob(next(JOB_IDS), TierJobKind.WRITE, [key], [slot])
            assert run_job(tier, job).ok == [True]
    finally:
        pool.free([slot])


def declining(pool: HostPool, tier: FsTier) -> TieredCache:
    """A cache whose promotions are all declined (no budget): each lookup of a request whose
    next blocks a tier holds is final, and counts the blocks of the run it found declined."""
    settings = PromotionSettings(budget=0.0)
    return TieredCache(pool, LRUPolicy(), [TierBinding(tier)], promotion=settings)


def run_found(cache: TieredCache, keys: list[BlockKey], owner: str | None = "a") -> int:
    before = cache.stats().cache.promotions_declined
    assert cache.lookup(keys, owner) == (0, True)
    return cache.stats().cache.promotions_declined - before


def held_run(tier: FsTier, keys: list[BlockKey]) -> int:
    """The run a fresh ask finds: the leading keys the tier holds."""
    return len(list(takewhile(bool, FsTier.exists(tier, keys))))


def test_an_unchanged_tier_is_not_asked_again_and_counts_as_asked(fs, ns):
    pool, tier = fs
    keys = keys_for(ns, 6, seed=1)
    write(pool, tier, keys[:2])
    cache = declining(pool, tier)
    asked = Asked(tier)
    assert run_found(cache, keys) == 2
    first = (asked.keys, tier.counters.lookups, tier.counters.lookup_hits)
    assert first == (7, 7, 3)  # the first key alone, then all 6
    assert run_found(cache, keys) == 2
    assert asked.keys == 7  # kept
    assert (tier.counters.lookups, tier.counters.lookup_hits) == (14, 6)  # as if asked
    assert run_found(cache, keys, owner=None) == 2  # no owner: nothing kept
    assert asked.keys == 14
    assert run_found(cache, keys[:5]) == 2  # other blocks: asked
    assert asked.keys == 20


def test_answers_are_kept_across_asks_that_pin_the_hits(fs, ns):
    """vLLM asks through ``lookup_and_pin``, whose final answer ends the request's promotion
    (``prepare_load``): its kept answers stay until the request is forgotten."""
    pool, tier = fs
    keys = keys_for(ns, 4, seed=1)
    write(pool, tier, keys[:2])
    cache = declining(pool, tier)
    asked = Asked(tier)
    for _ in range(3):
        result, slots = cache.lookup_and_pin(keys, "a")
        assert (result, slots) == ((0, True), [])
    assert asked.keys == 5  # the first key alone, then all 4: once
    cache.forget("a")
    cache.lookup_and_pin(keys, "a")
    assert asked.keys == 10


def test_a_block_written_deleted_or_evicted_between_two_asks_changes_the_answer(fs, ns):
    """Each step's answer is what a fresh ask finds: a kept answer reused after any of these
    would count the run the tier held before."""
    pool, tier = fs
    keys = keys_for(ns, 6, seed=1)
    write(pool, tier, keys[:2])
    cache = declining(pool, tier)
    assert run_found(cache, keys) == 2
    write(pool, tier, keys[2:3])
    assert run_found(cache, keys) == held_run(tier, keys) == 3
    assert tier.delete(keys[1])
    assert run_found(cache, keys) == held_run(tier, keys) == 1
    write(pool, tier, [keys[1], keys[3]])  # the tier is full (4 blocks)
    assert run_found(cache, keys) == held_run(tier, keys) == 4
    write(pool, tier, keys_for(ns, 1, seed=2))  # evicts its least recently used block
    assert tier.counters.evictions == 1
    assert run_found(cache, keys) == held_run(tier, keys) < 4


def test_a_block_whose_file_went_missing_changes_the_answer(fs, ns):
    """A read that finds the file gone drops the block from the tier's index (a failed read)."""
    pool, tier = fs
    keys = keys_for(ns, 3, seed=1)
    write(pool, tier, keys)
    cache = declining(pool, tier)
    assert run_found(cache, keys) == 3
    key = keys[1].hex()
    (Path(tier.root) / key[:2] / f"{key}.kvb").unlink()
    (slot,) = pool.alloc(1)
    assert run_job(tier, TierJob(next(JOB_IDS), TierJobKind.READ, [keys[1]], [slot])).ok == [False]
    pool.free([slot])
    assert run_found(cache, keys) == held_run(tier, keys) == 1


def test_a_request_that_stopped_waiting_keeps_nothing(fs, ns, monkeypatch):
    pool, tier = fs
    write(pool, tier, keys_for(ns, 1, seed=1))
    cache = declining(pool, tier)
    kept = cache._answers._kept
    monkeypatch.setattr(promotion, "MAX_KEPT_ANSWERS", 2)
    for owner in "abc":
        run_found(cache, keys_for(ns, 2, seed=1), owner)
    assert list(kept) == ["b", "c"]  # the one asked least recently went
    cache.forget("c")
    assert list(kept) == ["b"]


def test_a_tier_without_a_generation_is_asked_every_time(ns, make_pool):
    pool = make_pool(8)
    keys = keys_for(ns, 3, seed=1)
    tier = ScriptedTier("plugin", ns, pool)
    tier.stored = {key: bytes(pool.slot_bytes) for key in keys[:2]}
    cache = TieredCache(
        pool, LRUPolicy(), [TierBinding(tier)], promotion=PromotionSettings(budget=0.0)
    )
    assert run_found(cache, keys) == 2
    tier.stored[keys[2]] = bytes(pool.slot_bytes)  # no generation tells of it: asked anyway
    assert run_found(cache, keys) == 3


def test_a_block_evicted_by_a_write_that_failed_changes_the_answer(fs, ns, monkeypatch):
    """The eviction alone (no block added after it) changes the answer."""
    pool, tier = fs
    keys = keys_for(ns, 4, seed=1)
    write(pool, tier, keys)  # full
    cache = declining(pool, tier)
    assert run_found(cache, keys) == 4

    def fail(*args: object) -> None:
        raise OSError(5, "the disk failed")

    monkeypatch.setattr(tier._files, "write", fail)
    (slot,) = pool.alloc(1)
    other = keys_for(ns, 1, seed=2)
    assert run_job(tier, TierJob(next(JOB_IDS), TierJobKind.WRITE, other, [slot])).ok == [False]
    pool.free([slot])
    assert tier.counters.evictions == 1
    assert run_found(cache, keys) == held_run(tier, keys) < 4


class FixedGeneration(ScriptedTier):
    """Claims that nothing ever changes (a generation of 0), or fails to say (``broken``): an
    answer kept for it would be reused whatever it holds later."""

    broken = False

    def generation(self) -> int | None:
        if self.broken:
            raise RuntimeError("scripted generation failure")
        return 0


def fixed_generation_cache(ns: Namespace, make_pool) -> tuple[TieredCache, FixedGeneration]:
    pool = make_pool(8)
    tier = FixedGeneration("plugin", ns, pool)
    settings = PromotionSettings(budget=0.0)
    return TieredCache(pool, LRUPolicy(), [TierBinding(tier)], promotion=settings), tier


def test_a_tier_whose_generation_raises_is_asked_every_time(ns, make_pool):
    cache, tier = fixed_generation_cache(ns, make_pool)
    tier.broken = True
    keys = keys_for(ns, 3, seed=1)
    tier.stored = {key: b"" for key in keys[:2]}
    assert run_found(cache, keys) == 2
    tier.stored[keys[2]] = b""
    assert run_found(cache, keys) == 3


def test_an_answer_a_tier_cannot_give_yet_is_not_kept(ns, make_pool):
    cache, tier = fixed_generation_cache(ns, make_pool)
    keys = keys_for(ns, 3, seed=1)
    tier.stored = {key: b"" for key in keys[:2]}
    tier.unknown = {keys[2]}
    assert run_found(cache, keys) == 2
    assert "a" not in cache._answers._kept
    tier.unknown.clear()
    tier.stored[keys[2]] = b""
    assert run_found(cache, keys) == 3
