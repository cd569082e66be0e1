"""``benchmarks/scheduler_replay_fs.py``: kvtier's fs tier in the scheduler replay, the real
``FsTier`` with its jobs' time emulated. The queue model (reads before writes, block by block,
first come first served within each kind) and the tier's reports and visibility on the emulated
clock; no vLLM needed."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from support.scripts import benchmark_modules

from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import TierJob, TierJobKind
from kvtier.tiers.fs.tier import Options


@pytest.fixture(scope="module")
def rfs() -> Iterator[ModuleType]:
    with benchmark_modules("scheduler_replay_fs") as (module,):
        yield module


def _job(rfs: ModuleType, job_id: int, reading: bool, at: float, blocks: int) -> object:
    return rfs._Job(job_id, reading, at, blocks)


def test_reads_go_before_queued_writes_block_by_block(rfs: ModuleType) -> None:
    """One thread, writes of 10 ms a block, reads of 1 ms: a read submitted while a write's
    block runs waits for that block only, then both its blocks go before the write's rest."""
    model = rfs.FsModel(rfs.FsTiming(read_ms=1.0, write_ms=10.0, threads=1))
    write = _job(rfs, 1, False, 0.0, 3)
    model.submit(write)
    model.advance(0.015)  # the write's second block runs 10-20 ms
    read = _job(rfs, 2, True, 0.015, 2)
    model.submit(read)
    model.advance(1.0)
    done = {job.job_id: job for job in model.take_finished()}
    assert done[2].first == pytest.approx(0.020) and done[2].end == pytest.approx(0.022)
    assert done[1].first == pytest.approx(0.0) and done[1].end == pytest.approx(0.032)
    assert model.read_busy_s == pytest.approx(0.002)
    assert model.busy_s == pytest.approx(0.032)


def test_threads_serve_blocks_in_parallel_and_jobs_in_order(rfs: ModuleType) -> None:
    model = rfs.FsModel(rfs.FsTiming(read_ms=2.0, write_ms=2.0, threads=2, job_ms=1.0))
    first, second = _job(rfs, 1, True, 0.0, 3), _job(rfs, 2, True, 0.0, 1)
    model.submit(first)
    model.submit(second)
    model.advance(0.0025)
    assert model.take_finished() == []  # nothing ended yet: reported only once ended
    model.advance(1.0)
    done = {job.job_id: job for job in model.take_finished()}
    # Job 1's first two blocks on both threads (its first pays job_ms: 0-3 ms, 0-2 ms), its
    # third on the thread free first (2-4 ms), then job 2's (3-6 ms, with its job_ms).
    assert done[1].first == pytest.approx(0.0) and done[1].end == pytest.approx(0.004)
    assert done[2].first == pytest.approx(0.003) and done[2].end == pytest.approx(0.006)


def test_timing_parses_fields(rfs: ModuleType) -> None:
    timing = rfs.parse_timing("read_ms=0.5, threads=8")
    assert (timing.read_ms, timing.write_ms, timing.threads) == (0.5, 8.0, 8)
    for bad in ("speed=1", "read_ms=x", "threads=0", "write_ms=-1"):
        with pytest.raises(ValueError, match="--fs"):
            rfs.parse_timing(bad)


@pytest.fixture
def emulated_tier(
    rfs: ModuleType, make_pool: Callable[..., HostPool], namespace: Namespace, tmp_path: Path
) -> Iterator[tuple[object, SimpleNamespace, HostPool]]:
    pool = make_pool(4, 4096)
    machine = SimpleNamespace(cpu=0.0)
    setup = rfs.FsSetup(rfs.FsTiming(read_ms=1.0, write_ms=4.0, threads=1, engine_ms=0.0), 1.0)
    emulation = rfs.Emulation(machine, setup, tmp_path)
    blocks = 3
    options = Options(
        path=str(tmp_path / "fs"), capacity=blocks * (rfs.replay.BLOCK_BYTES + 64), threads=4
    )
    with rfs.emulated(emulation):
        tier = rfs.ReplayFsTier.create("fs", namespace, pool, options)
    try:
        yield tier, machine, pool
    finally:
        tier.close()


def test_a_job_reports_and_a_write_shows_at_its_emulated_end(
    emulated_tier: tuple[object, SimpleNamespace, HostPool],
) -> None:
    tier, machine, pool = emulated_tier
    key = bytes(range(16))
    pool.view(0)[:] = b"\x07" * 4096
    tier.submit(TierJob(1, TierJobKind.WRITE, [key], [0]))  # type: ignore[attr-defined]
    machine.cpu = 3.9
    assert tier.poll() == [] and tier.lookup([key]) == [False]  # type: ignore[attr-defined]
    machine.cpu = 4.0
    (result,) = tier.poll()  # type: ignore[attr-defined]
    assert (result.job_id, result.ok, result.busy_s) == (1, [True], pytest.approx(0.004))
    assert tier.lookup([key]) == [True]  # type: ignore[attr-defined]
    machine.cpu = 10.0
    tier.submit(TierJob(2, TierJobKind.READ, [key], [1]))  # type: ignore[attr-defined]
    assert tier.poll() == []  # type: ignore[attr-defined]
    machine.cpu = 11.0
    (result,) = tier.poll()  # type: ignore[attr-defined]
    assert (result.job_id, result.ok, result.busy_s) == (2, [True], pytest.approx(0.001))
    assert bytes(pool.view(1)) == b"\x07" * 4096


def test_a_replay_tier_outside_an_emulation_is_refused(
    rfs: ModuleType, make_pool: Callable[..., HostPool], namespace: Namespace, tmp_path: Path
) -> None:
    """Built without ``emulated`` (no clock to hold its reports on), the tier refuses to start."""
    assert rfs.CURRENT is None
    options = Options(path=str(tmp_path / "fs"), capacity=4 * (rfs.replay.BLOCK_BYTES + 64))
    with pytest.raises(RuntimeError, match="outside an emulation"):
        rfs.ReplayFsTier.create("fs", namespace, make_pool(4, 4096), options)


def test_capacity_is_the_grids_blocks_scaled(
    emulated_tier: tuple[object, SimpleNamespace, HostPool],
) -> None:
    """Three grid blocks of capacity hold three of the replay's blocks: a fourth evicts one."""
    tier, machine, _pool = emulated_tier
    for i in range(4):
        key = bytes([i]) * 16
        tier.submit(TierJob(i, TierJobKind.WRITE, [key], [i]))  # type: ignore[attr-defined]
    machine.cpu = 100.0
    assert len(tier.poll()) == 4  # type: ignore[attr-defined]
    keys = [bytes([i]) * 16 for i in range(4)]
    assert tier.lookup(keys).count(True) == 3  # type: ignore[attr-defined]


def test_a_write_of_blocks_the_tier_holds_costs_little(
    emulated_tier: tuple[object, SimpleNamespace, HostPool],
) -> None:
    """A block written again is kept (no file written): ``kept_ms``, not ``write_ms``."""
    tier, machine, _pool = emulated_tier
    key = bytes(range(16))
    tier.submit(TierJob(1, TierJobKind.WRITE, [key], [0]))  # type: ignore[attr-defined]
    machine.cpu = 4.0
    assert [r.job_id for r in tier.poll()] == [1]  # type: ignore[attr-defined]
    tier.submit(TierJob(2, TierJobKind.WRITE, [key], [0]))  # type: ignore[attr-defined]
    machine.cpu = 4.03  # 4 ms + kept_ms (0.02 ms), and a rounding margin
    (result,) = tier.poll()  # type: ignore[attr-defined]
    assert (result.job_id, result.ok, result.busy_s) == (2, [True], pytest.approx(2e-5))


def test_a_wait_reaches_a_job_end_that_rounds_below_in_milliseconds(
    rfs: ModuleType, tmp_path: Path
) -> None:
    """``TieredCache.wait`` on the emulated clock moves it to the next block's end; an end whose
    milliseconds read back below it (11.608806403150728 s) must still be reached, not waited
    for forever (an 8x4 replay with write_ms 12 hung so)."""
    end = 11.608806403150728
    assert (end * 1e3) / 1e3 < end  # the rounding this test is about
    machine = SimpleNamespace(cpu=end * 1e3 - 1.0)
    emulation = rfs.Emulation(machine, rfs.FsSetup(), tmp_path)
    emulation.tiers.append(SimpleNamespace(model=SimpleNamespace(next_end=lambda: end)))
    steps: list[float] = []

    class Cache:
        def step(self) -> int:
            steps.append(emulation.clock())
            if len(steps) > 100:
                raise RuntimeError("the wait does not advance")
            return 1 if emulation.clock() >= end else 0

    assert emulation.wait(Cache(), 0.01) is True
    assert emulation.clock() >= end and len(steps) == 2


def test_engine_ms_charges_the_engine_thread_per_file_block(
    rfs: ModuleType, make_pool: Callable[..., HostPool], namespace: Namespace, tmp_path: Path
) -> None:
    pool = make_pool(4, 4096)
    machine = SimpleNamespace(cpu=0.0)
    timing = rfs.FsTiming(read_ms=1.0, write_ms=4.0, threads=1, engine_ms=0.5)
    emulation = rfs.Emulation(machine, rfs.FsSetup(timing, 1.0), tmp_path)
    options = Options(path=str(tmp_path / "fs"), capacity=4 * (rfs.replay.BLOCK_BYTES + 64))
    with rfs.emulated(emulation):
        tier = rfs.ReplayFsTier.create("fs", namespace, pool, options)
    try:
        keys = [bytes([1]) * 16, bytes([2]) * 16]
        tier.submit(TierJob(1, TierJobKind.WRITE, keys, [0, 1]))
        assert machine.cpu == pytest.approx(1.0)  # two blocks written
        machine.cpu = 10.0
        assert len(tier.poll()) == 1
        tier.submit(TierJob(2, TierJobKind.WRITE, keys[:1], [0]))  # kept: no file, no charge
        assert machine.cpu == pytest.approx(10.0)
    finally:
        tier.close()


def test_kvtier_fs_configs_get_the_replays_fs_tier(rfs: ModuleType, tmp_path: Path) -> None:
    with benchmark_modules("scheduler_replay") as (sr,):
        spec = sr.parse_config("kvtier_fs+pool.promotion_budget=0.25")
    assert (spec.kind, spec.measured_as) == ("kvtier_fs", "kvtier_fs")
    emulation = rfs.Emulation(SimpleNamespace(cpu=0.0), rfs.FsSetup(gib=2.0), tmp_path)
    (tier,) = emulation.tier_configs()
    assert tier["kind"] == rfs.TIER_KIND and tier["name"] == "fs" and tier["capacity"] == 2 << 30
    extra = sr.kvtier_extra(1 << 20, spec.overrides, [tier])
    assert extra["tiers"] == [tier] and extra["pool"] == {"size": 1 << 20, "promotion_budget": 0.25}
    with benchmark_modules("scheduler_replay") as (sr,):
        spec = sr.parse_config("kvtier_fs+tiers.0.write=on_evict")
    extra = sr.kvtier_extra(1 << 20, spec.overrides, [dict(tier)])
    assert extra["tiers"] == [{**tier, "write": "on_evict"}]  # a number picks a list's item
