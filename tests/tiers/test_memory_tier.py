from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest
from support.blocks import fill, make_key, make_keys, payload_for, poison
from support.drivers import Driver

from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.tiers import tier_class
from kvtier.tiers.base import JobResult, Tier, TierJob, TierJobKind
from kvtier.tiers.memory import MemoryTier, Options
from kvtier.validation import Section
from tiers.conftest import SLOT_BYTES

MakeTier = Callable[..., MemoryTier]


@pytest.fixture
def make_tier(pool: HostPool, namespace: Namespace) -> Iterator[MakeTier]:
    tiers: list[MemoryTier] = []

    def make(**options: object) -> MemoryTier:
        tier = MemoryTier("mem", namespace, pool, Options(**options))  # type: ignore[arg-type]
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def test_registered_by_kind() -> None:
    assert tier_class("memory") is MemoryTier


def test_round_trip_into_poisoned_slot(
    make_tier: MakeTier, pool: HostPool, run_job: Callable[[Tier, TierJob], JobResult]
) -> None:
    tier = make_tier()
    keys = make_keys(3)
    for slot, key in enumerate(keys):
        fill(pool, slot, key)
    assert tier.lookup(keys) == [False, False, False]
    assert run_job(tier, TierJob(1, TierJobKind.WRITE, keys, [0, 1, 2])).ok == [True] * 3
    assert tier.lookup(keys) == [True, True, True]
    for slot in (10, 11, 12):
        poison(pool, slot)
    assert run_job(tier, TierJob(2, TierJobKind.READ, keys, [12, 10, 11])).ok == [True] * 3
    for slot, key in zip((12, 10, 11), keys, strict=True):
        assert bytes(pool.view(slot)) == payload_for(key, SLOT_BYTES)
    c = tier.counters
    assert (c.write_jobs, c.write_blocks, c.write_bytes) == (1, 3, 3 * SLOT_BYTES)
    assert (c.read_jobs, c.read_blocks, c.read_bytes) == (1, 3, 3 * SLOT_BYTES)
    assert (c.lookups, c.lookup_hits) == (6, 3)


def test_stored_copy_is_independent_of_the_slot(make_tier: MakeTier, pool: HostPool) -> None:
    tier = make_tier()
    drive = Driver(tier)
    key = make_key(0)
    assert drive.store(key, slot=0)
    poison(pool, 0)  # the slot is reused after the write: the tier must have copied it
    assert drive.load_exact(key, slot=1)


def test_missing_key_is_a_plain_miss(make_tier: MakeTier) -> None:
    tier = make_tier()
    assert Driver(tier).read([make_key(9)], [0]) == [False]
    assert tier.counters.errors == tier.counters.corrupt == 0


def test_lru_by_blocks_reads_touch(make_tier: MakeTier) -> None:
    tier = make_tier(capacity_blocks=3)
    drive = Driver(tier)
    a, b, c, d = make_keys(4)
    for key in (a, b, c):
        assert drive.store(key)
    assert drive.load_exact(a)  # a becomes most recent; b is now the oldest
    assert drive.store(d)
    assert tier.lookup([a, b, c, d]) == [True, False, True, True]
    assert tier.take_evicted() == [b]
    assert tier.counters.evictions == 1
    assert len(tier) == 3


def test_capacity_in_bytes(make_tier: MakeTier) -> None:
    tier = make_tier(capacity=2 * SLOT_BYTES + 10)
    drive = Driver(tier)
    keys = make_keys(5)
    for key in keys:
        assert drive.store(key)
        assert tier.used_bytes <= 2 * SLOT_BYTES + 10
    assert tier.lookup(keys) == [False, False, False, True, True]
    assert tier.take_evicted() == keys[:3]


def test_block_larger_than_capacity_is_rejected(make_tier: MakeTier) -> None:
    tier = make_tier(capacity=SLOT_BYTES - 1)
    assert Driver(tier).store(make_key(0)) is False
    assert tier.counters.rejected == 1 and len(tier) == 0


def test_double_write_is_skipped(make_tier: MakeTier) -> None:
    tier = make_tier()
    drive = Driver(tier)
    key = make_key(0)
    assert drive.store(key) and drive.store(key)
    assert tier.counters.write_blocks == 1 and len(tier) == 1


def test_latency_delays_completion_and_visibility(make_tier: MakeTier, pool: HostPool) -> None:
    tier = make_tier(latency_ms=150)
    drive = Driver(tier)
    key = make_key(0)
    fill(pool, 0, key)
    start = time.monotonic()
    job = drive.submit(TierJobKind.WRITE, [key], [0])
    assert tier.poll() == []
    assert tier.lookup([key]) == [False]  # not visible before the write completed
    assert drive.wait(job) == [True]
    assert time.monotonic() - start >= 0.14
    assert tier.lookup([key]) == [True]
    assert drive.load_exact(key)


def test_close_completes_queued_jobs_once(make_tier: MakeTier, pool: HostPool) -> None:
    tier = make_tier(latency_ms=60_000)
    drive = Driver(tier)
    keys = make_keys(3)
    jobs = []
    for slot, key in enumerate(keys):
        fill(pool, slot, key)
        jobs.append(drive.submit(TierJobKind.WRITE, [key], [slot]))
    start = time.monotonic()
    tier.close()
    tier.close()
    assert time.monotonic() - start < 5
    assert sorted(r.job_id for r in tier.poll()) == jobs
    late = drive.submit(TierJobKind.WRITE, [make_key(5)], [0])
    assert drive.wait(late) == [False]
    assert tier.poll() == []


def test_worker_survives_an_infinite_latency(make_tier: MakeTier, pool: HostPool) -> None:
    # Options built in code skip the config check: the worker must neither die on a wait it
    # cannot make (OverflowError) nor hang close().
    tier = make_tier(latency_ms=float("inf"))
    drive = Driver(tier)
    key = make_key(0)
    fill(pool, 0, key)
    job = drive.submit(TierJobKind.WRITE, [key], [0])
    time.sleep(0.05)
    start = time.monotonic()
    tier.close()
    assert time.monotonic() - start < 2
    assert [r.job_id for r in tier.poll()] == [job]


def test_worker_does_not_spin_on_a_nan_latency(make_tier: MakeTier, pool: HostPool) -> None:
    tier = make_tier(latency_ms=float("nan"))
    drive = Driver(tier)
    key = make_key(0)
    fill(pool, 0, key)
    assert drive.wait(drive.submit(TierJobKind.WRITE, [key], [0]), deadline_s=2) == [True]


def test_failure_injection_is_seeded_and_counted(make_tier: MakeTier) -> None:
    def pattern(seed: int) -> tuple[list[bool], MemoryTier]:
        tier = make_tier(failure_rate=0.5, seed=seed)
        drive = Driver(tier)
        return [drive.store(key) for key in make_keys(60)], tier

    first, tier = pattern(7)
    again, _ = pattern(7)
    other, _ = pattern(8)
    assert first == again
    assert first != other
    assert 10 < first.count(False) < 50
    assert tier.counters.errors == first.count(False)
    # A failed write stores nothing.
    assert tier.lookup(make_keys(60)) == first


def test_failed_read_is_a_miss_and_keeps_the_block(make_tier: MakeTier) -> None:
    tier = make_tier(failure_rate=0.5, seed=1)
    drive = Driver(tier)
    key = next(k for k in make_keys(50) if drive.store(k))
    errors = tier.counters.errors
    outcomes = [drive.load_exact(key) for _ in range(40)]
    assert True in outcomes and False in outcomes
    assert tier.counters.errors - errors == outcomes.count(False)
    assert tier.lookup([key]) == [True]
    assert tier.counters.corrupt == 0


def test_corrupt_read_is_a_counted_miss_and_drops_the_block(
    make_tier: MakeTier, pool: HostPool
) -> None:
    tier = make_tier(corrupt_rate=1.0)
    drive = Driver(tier)
    key = make_key(0)
    assert drive.store(key)  # writes are never corrupted
    poison(pool, 5)
    assert drive.read([key], [5]) == [False]
    assert bytes(pool.view(5)) != payload_for(key, SLOT_BYTES)
    assert tier.counters.corrupt == 1
    assert tier.lookup([key]) == [False]
    assert tier.take_evicted() == [key]


def test_bad_jobs_fail_without_raising(make_tier: MakeTier) -> None:
    tier = make_tier()
    drive = Driver(tier)
    assert drive.write([b"short"], [0]) == [False]
    assert drive.write([make_key(0)], [10_000]) == [False]
    assert drive.write([make_key(0), make_key(1)], [0]) == [False, False]
    assert drive.read([b"short"], [0]) == [False]
    assert drive.write([], []) == []
    assert tier.counters.errors == 5
    assert drive.store(make_key(0))


def test_options_parse() -> None:
    options = Options.parse(
        Section(
            {
                "capacity": "1MiB",
                "capacity_blocks": 8,
                "latency_ms": 2.5,
                "failure_rate": 0.1,
                "corrupt_rate": 0.01,
                "seed": 3,
            },
            "tiers[0]",
        )
    )
    assert options == Options(1024**2, 8, 2.5, 0.1, 0.01, 3)
    assert Options.parse(Section({}, "tiers[0]")) == Options()


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"capacity": "lots"}, "tiers[0].capacity"),
        ({"capacity_blocks": 0}, "tiers[0].capacity_blocks"),
        ({"latency_ms": -1}, "tiers[0].latency_ms"),
        ({"failure_rate": 1.5}, "tiers[0].failure_rate"),
        ({"corrupt_rate": "often"}, "tiers[0].corrupt_rate"),
        ({"seed": 1.5}, "tiers[0].seed"),
        ({"capacty": "1MiB"}, "tiers[0].capacty"),
    ],
)
def test_bad_options_name_the_field(data: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        Options.parse(Section(data, "tiers[0]"))
    assert err.value.field == field


def test_a_job_result_says_how_long_the_tier_worked_on_it(
    make_tier: MakeTier, pool: HostPool, run_job: Callable[[Tier, TierJob], JobResult]
) -> None:
    """The manager learns a tier's read speed from ``busy_s``: the time the step that collected
    the result came later is not the tier's."""
    tier = make_tier()
    keys = make_keys(4)
    for slot, key in enumerate(keys):
        fill(pool, slot, key)
    result = run_job(tier, TierJob(1, TierJobKind.WRITE, keys, [0, 1, 2, 3]))
    assert result.busy_s is not None and 0.0 <= result.busy_s < 5.0
