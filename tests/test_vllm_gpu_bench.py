"""``benchmarks/vllm_gpu_bench.py --grid`` and its modules: grid points, what runs and what is
skipped, the time budget, the request pairing, the acceptance verdicts, the JSON and the plot
(no vLLM needed), and one tiny grid point in vLLM's CPU build."""

from __future__ import annotations

import gc
import json
import math
import os
import pstats
import re
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from support import require
from support.scripts import benchmark_modules


@pytest.fixture(scope="module")
def modules() -> Iterator[dict[str, ModuleType]]:
    names = (
        "vllm_grid",
        "vllm_grid_report",
        "vllm_bench_engine",
        "vllm_gpu_bench",
        "config_variants",
    )
    with benchmark_modules(*names) as (grid, report, engine, bench, variants):
        yield {
            "grid": grid,
            "report": report,
            "engine": engine,
            "bench": bench,
            "variants": variants,
        }


@pytest.fixture
def grid(modules: dict[str, ModuleType]) -> ModuleType:
    return modules["grid"]


@pytest.fixture
def rep(modules: dict[str, ModuleType]) -> ModuleType:
    return modules["report"]


@pytest.fixture
def eng(modules: dict[str, ModuleType]) -> ModuleType:
    return modules["engine"]


def make_row(
    ttfts: dict[str, float],
    cached: dict[str, int] | None = None,
    *,
    p: tuple[float, float, float] = (100.0, 200.0, 300.0),
    tok_s: float = 100.0,
    **extra: Any,
) -> dict[str, Any]:
    """A configuration row as ``run_config`` writes it, with these requests."""
    cached = cached or {}
    rows = [[rid, ms, 1000, cached.get(rid, 0), "d"] for rid, ms in ttfts.items()]
    row: dict[str, Any] = {
        "requests": len(rows),
        "ttft_ms": {"50": p[0], "90": p[1], "99": p[2]},
        "output_tokens_per_s": tok_s,
        "prompt_tokens": 1000 * len(rows),
        "prompt_tokens_cached": sum(cached.values()),
        "prompt_tokens_computed": 1000 * len(rows) - sum(cached.values()),
        "wall_s": 10.0,
        "elapsed_s": 40.0,
        "per_request": {
            "fields": ["id", "ttft_ms", "prompt_tokens", "cached_tokens", "output_digest"],
            "rows": rows,
        },
    }
    row.update(extra)
    return row


# -- points -------------------------------------------------------------------------------------


def test_points_parse_and_expand_in_run_order(grid: ModuleType) -> None:
    point = grid.parse_point(" 16 x 4 ")
    assert (point.concurrency, point.host_gib, point.key) == (16, 4.0, "16x4")
    assert grid.parse_point("2x0.5").key == "2x0.5"
    keys = [p.key for p in grid.expand([16, 4], [8, 2], None)]
    assert keys == ["4x2", "4x8", "16x2", "16x8"]
    chosen = grid.expand([4, 8], [2], grid.parse_points("32x2,16x4,16x4"))
    assert [p.key for p in chosen] == ["16x4", "32x2"]
    for bad in ("16", "16x", "x4", "0x4", "16x0", "16*4"):
        with pytest.raises(grid.GridError, match="grid point"):
            grid.parse_point(bad)


def test_number_lists_and_requests_per_concurrency(grid: ModuleType) -> None:
    assert grid.parse_numbers("4,8, 16", "--grid-concurrency", int) == [4, 8, 16]
    with pytest.raises(grid.GridError, match="--grid-host-gib"):
        grid.parse_numbers("2,four", "--grid-host-gib", float)
    with pytest.raises(grid.GridError, match="positive"):
        grid.parse_numbers("2,-1", "--grid-host-gib", float)
    table = grid.parse_requests("4:80, 8:160")
    assert table == {4: 80, 8: 160}
    assert grid.requests_for(8, table) == 160
    assert grid.requests_for(12, table) == 120
    with pytest.raises(grid.GridError, match="CONCURRENCY:REQUESTS"):
        grid.parse_requests("4=80")


def test_fs_capacity_leaves_the_larger_reserve(grid: ModuleType) -> None:
    gib = 1 << 30
    # A 64 GiB disk: 15% is 9.6 GiB, more than 8 GiB.
    assert grid.fs_capacity_gib(40 * gib, 64 * gib) == pytest.approx(40 - 9.6)
    # A 20 GiB disk: 15% is 3 GiB, 8 GiB is left.
    assert grid.fs_capacity_gib(15 * gib, 20 * gib) == pytest.approx(7.0)
    assert grid.fs_capacity_gib(5 * gib, 20 * gib) == 0.0
    assert grid.disk_floor_bytes(64 * gib) == int(9.6 * gib / 2)


# -- pairing and verdicts -----------------------------------------------------------------------


def test_hit_requests_pair_with_the_same_requests_in_vllm_alone(rep: ModuleType) -> None:
    ours = make_row(
        {"c0.t1": 50.0, "c0.t2": 10.0, "c1.t2": 30.0, "c2.t2": 70.0, "c9.t9": 5.0},
        {"c0.t2": 64, "c1.t2": 32, "c2.t2": 16, "c9.t9": 16},
    )
    base = make_row({"c0.t1": 55.0, "c0.t2": 40.0, "c1.t2": 20.0, "c2.t2": 90.0})
    pairing = rep.pair_hits(ours, base)
    assert pairing.requests == 3  # c0.t1 had no hit; c9.t9 is not in vLLM alone's records
    assert pairing.unpaired == 1
    assert pairing.mean_ms == pytest.approx((10 + 30 + 70) / 3)
    assert pairing.base_mean_ms == pytest.approx((40 + 20 + 90) / 3)
    # p90 over three values (nearest rank): the largest.
    assert (pairing.p90_ms, pairing.base_p90_ms) == (70.0, 90.0)
    assert rep.pair_hits(make_row({"c0.t1": 1.0}), base) is None
    assert rep.pair_hits(ours, {"ttft_ms": {}}) is None


def test_percentile_is_nearest_rank(rep: ModuleType) -> None:
    values = [float(v) for v in range(1, 101)]
    assert rep.percentile(values, 50) == 51.0  # rank round(0.5 * 99) = 50 (0-based)
    assert rep.percentile(values, 99) == 99.0
    assert rep.percentile([3.0], 90) == 3.0


@pytest.mark.parametrize(
    ("ours", "theirs", "higher", "verdict"),
    [
        (100.0, 100.0, False, "better"),  # at or below counts
        (99.0, 100.0, False, "better"),
        (102.0, 100.0, False, "tie"),
        (103.0, 100.0, False, "tie"),  # the band's edge is inside
        (103.5, 100.0, False, "worse"),
        (101.0, 100.0, True, "better"),
        (97.5, 100.0, True, "tie"),
        (96.0, 100.0, True, "worse"),
    ],
)
def test_compare_with_the_tie_band(
    rep: ModuleType, ours: float, theirs: float, higher: bool, verdict: str
) -> None:
    got, ratio = rep.compare(ours, theirs, higher_is_better=higher)
    assert got.value == verdict
    assert ratio == pytest.approx(ours / theirs)


def checks_named(checks: list[Any], prefix: str) -> list[Any]:
    return [c for c in checks if c.name.startswith(prefix)]


def test_kvtier_fs_is_held_to_the_better_reference_per_figure(rep: ModuleType) -> None:
    ids = {"c0.t1": 100.0}
    configs = {
        # native has the better p50 and tokens/s, native_fs the better p90 and p99.
        "native": make_row(ids, p=(100.0, 400.0, 900.0), tok_s=120.0),
        "native_fs": make_row(ids, p=(150.0, 200.0, 500.0), tok_s=100.0),
        "kvtier_fs": make_row(ids, p=(99.0, 205.0, 520.0), tok_s=119.0),
    }
    checks = checks_named(rep.point_checks({"configs": configs}), "kvtier_fs vs best")
    verdicts = {c.detail.split(":")[0]: c.verdict.value for c in checks}
    assert verdicts == {
        "TTFT p50": "better",  # 99 vs native's 100
        "TTFT p90": "tie",  # 205 vs native_fs's 200: 2.5% worse
        "TTFT p99": "worse",  # 520 vs native_fs's 500: 4% worse
        "output tok/s": "tie",  # 119 vs native's 120
    }
    # A TTFT figure names its reference, with both rows' mean and slowest request.
    details = {c.detail.split(":")[0]: c.detail for c in checks}
    assert "(native's); mean / max TTFT ours 100 / 100, native 100 / 100 ms" in details["TTFT p50"]
    assert "(native_fs's)" in details["TTFT p90"] and "mean" not in details["output tok/s"]
    configs["native_fs"] = {"error": "RuntimeError: no tiering"}
    checks = checks_named(rep.point_checks({"configs": configs}), "kvtier_fs vs best")
    assert all("one reference missing" in c.name for c in checks)
    assert {c.detail.split(":")[0]: c.verdict.value for c in checks}["TTFT p99"] == "better"


def test_hit_requests_must_be_strictly_faster_than_in_vllm_alone(rep: ModuleType) -> None:
    base = make_row({"a": 100.0, "b": 100.0})
    configs = {"none": base, "kvtier_fs": make_row({"a": 50.0, "b": 100.0}, {"a": 16, "b": 16})}
    checks = checks_named(rep.point_checks({"configs": configs}), "kvtier_fs requests with hits")
    assert [c.verdict.value for c in checks] == ["better", "worse"]  # mean 75 < 100; p90 equal


@pytest.mark.parametrize(
    ("promoted", "loaded", "verdict"),
    [(110, 100, "better"), (111, 100, "worse"), (0, 0, "better"), (5, 0, "worse")],
)
def test_promoted_per_loaded_blocks(
    rep: ModuleType, promoted: int, loaded: int, verdict: str
) -> None:
    kv = {"promoted_blocks": promoted, "loaded_blocks": loaded}
    configs = {"kvtier_fs": make_row({"a": 1.0}, kvtier=kv)}
    (check,) = checks_named(rep.point_checks({"configs": configs}), "kvtier_fs promoted")
    assert check.verdict.value == verdict


def test_pool_and_connector_checks_against_native(rep: ModuleType) -> None:
    step = {"p50": 300.0, "p99": 3000.0, "steps": 10}
    configs = {
        "native": make_row({"a": 1.0}, {"a": 10}, connector_step_us=step),
        "kvtier": make_row({"a": 1.0}, {"a": 0}, connector_step_us={**step, "p99": 3050.0}),
        "kvtier_fs": make_row({"a": 1.0}, connector_step_us={**step, "p99": 5000.0}),
    }
    point = {"configs": configs, "workload": {"reusable_prompt_tokens": 1000}}
    checks = rep.point_checks(point)
    p99 = {c.name: c.verdict.value for c in checks if "connector p99" in c.name}
    assert p99 == {
        "kvtier connector p99 per step vs native": "tie",
        "kvtier_fs connector p99 per step vs native": "worse",
    }
    pool = checks_named(checks, "kvtier pool vs native")
    cached = next(c for c in pool if c.detail.startswith("prompt tokens cached"))
    assert cached.verdict.value == "worse"  # 0 against 10
    # native cached 1% of the reusable tokens: the thrash regime is named; without the offline
    # optimum of this sequence it cannot be decided.
    (thrash,) = [c for c in pool if "thrash" in c.name]
    assert "native caches 1.0%" in thrash.detail and thrash.verdict.value == "n/a"


def test_the_pool_in_the_thrash_regime_against_half_of_the_offline_optimum(
    rep: ModuleType,
) -> None:
    def point(kvtier_cached: int, requests: int = 2) -> dict[str, Any]:
        configs = {
            "native": make_row({"a": 1.0, "b": 1.0}, {"a": 10}),
            "kvtier": make_row({"a": 1.0, "b": 1.0}, {"a": kvtier_cached}),
        }
        workload = {"reusable_prompt_tokens": 1000, "requests": requests}
        return {"configs": configs, "workload": workload, "concurrency": 8, "host_gib": 2.0}

    def verdict(p: dict[str, Any], optima: Any) -> str:
        (check,) = [c for c in rep.point_checks(p, optima) if "thrash" in c.name]
        return str(check.verdict.value)

    optima = {(8, 2.0): (2, 0.4)}  # the optimum serves 0.4 of the 2,000 prompt tokens
    assert verdict(point(400), optima) == "better"  # 0.2: half of it
    assert verdict(point(398), optima) == "worse"
    assert verdict(point(400, requests=3), optima) == "n/a"  # another sequence's optimum
    assert verdict(point(400), {}) == "n/a"
    # The recorded optima: the grid's sequence at 8 and 16 in flight with 2 GiB.
    recorded = rep.load_optima()
    assert recorded[(8, 2.0)][0] == 160 and recorded[(16, 2.0)][0] == 240
    assert 0 < recorded[(16, 2.0)][1] < recorded[(8, 2.0)][1] < 1


# -- the JSON and the loop ----------------------------------------------------------------------


def test_json_keeps_each_request_on_one_line_and_round_trips(
    grid: ModuleType, tmp_path: Path
) -> None:
    data = {"points": {"4x2": {"configs": {"none": make_row({"c0.t1": 1.5, "c0.t2": 2.5})}}}}
    data["note"] = "brackets [in a string] stay as they are"
    path = tmp_path / "g.json"
    grid.save(path, data)
    text = path.read_text()
    assert json.loads(text) == data
    assert '["c0.t1", 1.5, 1000, 0, "d"]' in text
    assert not (tmp_path / "g.json.tmp").exists()


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeRunner:
    """The grid's engine side without an engine: each run takes ``seconds`` of a fake clock
    and returns a row; records what ran and what the JSON held when it ran."""

    model = "fake model"

    def __init__(self, workdir: Path, out: Path, clock: FakeClock, digest: str = "w1") -> None:
        self.machine = {"gpu": "fake gpu"}
        self.workdir = workdir
        self.out = out
        self.clock = clock
        self.digest = digest
        self.seconds = 60.0
        self.ran: list[tuple[str, str]] = []
        self.seen_on_disk: list[set[str]] = []
        self.rounds: list[list[tuple[str, str, int]]] = []
        self.fs_gib: set[float] = set()
        self.clears = 0

    def workload(self, point: Any) -> Any:
        import vllm_grid

        summary = {"digest": self.digest, "prompt_tokens": 2000, "concurrency": point.concurrency}
        return vllm_grid.PointWorkload(summary)

    def clear_fs(self) -> None:
        self.clears += 1

    def run(self, jobs: list[Any]) -> list[dict[str, Any]]:
        """The jobs at once: ``seconds`` of the clock for all of them."""
        self.rounds.append([(j.point.key, j.config, j.lane) for j in jobs])
        rows = []
        for job in jobs:
            assert job.fs_gib >= 0
            self.fs_gib.add(job.fs_gib)
            on_disk = json.loads(self.out.read_text()) if self.out.exists() else {}
            configs = on_disk.get("points", {}).get(job.point.key, {}).get("configs", {})
            self.seen_on_disk.append(set(configs))
            self.ran.append((job.point.key, job.config))
            rows.append(make_row({"c0.t1": 10.0}, wall_s=20.0, elapsed_s=self.seconds))
        self.clock.now += self.seconds
        return rows


def options(grid: ModuleType, configs: str, commit: str = "abc", **kw: Any) -> Any:
    selection = grid.Selection(
        commit,
        kw.pop("skip_done", False),
        kw.pop("reuse_baselines", False),
        kw.pop("rerun", frozenset()),
        run_id=grid.new_run_id(),  # each call stands for its own invocation
    )
    return grid.GridOptions(configs.split(","), selection, **kw)


def test_rows_are_merged_into_the_file_as_each_configuration_finishes(
    grid: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "grid.json"
    runner = FakeRunner(tmp_path, out, FakeClock())
    points = grid.parse_points("4x2")
    data = grid.run_grid(points, options(grid, "none,kvtier,kvtier_fs"), runner, out, runner.clock)
    assert runner.seen_on_disk == [set(), {"none"}, {"none", "kvtier"}]
    row = data["points"]["4x2"]["configs"]["kvtier"]
    assert row["commit"] == "abc" and row["machine"] == {"gpu": "fake gpu"}
    assert row["workload_digest"] == "w1" and row["date"].startswith("20")
    assert json.loads(out.read_text()) == data
    assert runner.clears == 2  # before and after the point


def test_skip_done_reruns_only_what_the_commit_or_workload_moved(
    grid: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "grid.json"
    clock = FakeClock()
    first = FakeRunner(tmp_path, out, clock)
    configs = "none,native,kvtier"
    grid.run_grid(grid.parse_points("8x4"), options(grid, configs), first, out, clock)

    same = FakeRunner(tmp_path, out, clock)
    grid.run_grid(
        grid.parse_points("8x4,16x4"),
        options(grid, configs, skip_done=True),
        same,
        out,
        clock,
    )
    assert same.ran == [("16x4", c) for c in configs.split(",")]

    new_commit = FakeRunner(tmp_path, out, clock)
    grid.run_grid(
        grid.parse_points("8x4"),
        options(grid, configs, "def", skip_done=True, reuse_baselines=True),
        new_commit,
        out,
        clock,
    )
    assert new_commit.ran == [("8x4", "kvtier")]  # vLLM's own rows kept from commit abc

    forced = FakeRunner(tmp_path, out, clock)
    grid.run_grid(
        grid.parse_points("8x4"),
        options(grid, configs, "def", skip_done=True, rerun=frozenset({"8x4"})),
        forced,
        out,
        clock,
    )
    assert forced.ran == [("8x4", c) for c in configs.split(",")]

    other_workload = FakeRunner(tmp_path, out, clock, digest="w2")
    data = grid.run_grid(
        grid.parse_points("8x4"),
        options(grid, "none", "def", skip_done=True),
        other_workload,
        out,
        clock,
    )
    assert other_workload.ran == [("8x4", "none")]
    # Rows of the old request sequence are dropped: they would not pair with the new ones.
    assert set(data["points"]["8x4"]["configs"]) == {"none"}


def test_dirty_or_unknown_commits_are_trusted_only_within_their_run(grid: ModuleType) -> None:
    row = {"commit": "unknown", "workload_digest": "w", "run_id": "earlier"}
    for commit in ("unknown", "abc+dirty"):
        sel = grid.Selection(commit, skip_done=True, run_id="now")
        assert not sel.trusts({**row, "commit": commit}, "w", "kvtier", "4x2")
        assert sel.trusts({**row, "commit": commit, "run_id": "now"}, "w", "kvtier", "4x2")
        assert not sel.trusts({**row, "run_id": "now"}, "other digest", "kvtier", "4x2")
    sel = grid.Selection("abc", skip_done=True, run_id="now")
    assert sel.trusts({**row, "commit": "abc"}, "w", "kvtier", "4x2")
    assert not sel.trusts({**row, "commit": "abc", "error": "x"}, "w", "kvtier", "4x2")


def test_vllm_alone_runs_once_per_concurrency(grid: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    runner = FakeRunner(tmp_path, out, FakeClock())
    points = grid.expand([4], [2, 8], None)
    # An unknown commit: the copy comes from this same invocation.
    opts = options(grid, "none,kvtier", "unknown")
    data = grid.run_grid(points, opts, runner, out, runner.clock)
    assert runner.ran == [("4x2", "none"), ("4x2", "kvtier"), ("4x8", "kvtier")]
    copied = data["points"]["4x8"]["configs"]["none"]
    assert copied["copied_from"] == "4x2"
    assert copied["per_request"] == data["points"]["4x2"]["configs"]["none"]["per_request"]


def slow_runner(tmp_path: Path) -> FakeRunner:
    """A fake engine side whose configurations take 100 s of its clock."""
    runner = FakeRunner(tmp_path, tmp_path / "grid.json", FakeClock())
    runner.seconds = 100.0
    return runner


def test_max_minutes_stops_before_a_point_that_would_not_finish(
    grid: ModuleType, tmp_path: Path
) -> None:
    runner = slow_runner(tmp_path)
    points = grid.parse_points("4x2,8x2,16x2")
    # No history: the tiny prior (20 s + 200 us per prompt token, 2000 tokens) = 20.4 s per
    # configuration. After the first point its rows say 80 s start-up (elapsed 100 s less wall
    # 20 s) + 20 ms per token (20 s over a row's 1000 tokens) = 120 s per configuration.
    opts = options(grid, "none,kvtier", max_minutes=8.0)
    data = grid.run_grid(points, opts, runner, runner.out, runner.clock)
    # 4x2 (est. 41 s) ran until 200 s; 8x2 (est. 240 s) fits in 480 s and ran until 400 s;
    # 16x2 would end at 640 s.
    assert [k for k, _ in runner.ran] == ["4x2", "4x2", "8x2", "8x2"]
    assert set(data["points"]) == {"4x2", "8x2"}


def test_max_minutes_stops_before_a_configuration_that_would_not_finish(
    grid: ModuleType, tmp_path: Path
) -> None:
    runner = slow_runner(tmp_path)
    # The prior's 20.4 s a configuration lets the point start (61 s of 240); after none's row
    # the estimate is 120 s: kvtier ends at 200 s, kvtier_fs would at 320 s.
    opts = options(grid, "none,kvtier,kvtier_fs", max_minutes=4.0)
    data = grid.run_grid(grid.parse_points("4x2"), opts, runner, runner.out, runner.clock)
    assert runner.ran == [("4x2", "none"), ("4x2", "kvtier")]
    assert set(data["points"]["4x2"]["configs"]) == {"none", "kvtier"}
    assert runner.clears == 2  # the point's fs directories go when it stops too


def test_lanes_run_each_configuration_at_a_round_of_points_together(
    grid: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gib = 1 << 30
    usage = shutil._ntuple_diskusage(100 * gib, 40 * gib, 60 * gib)  # type: ignore[attr-defined]
    monkeypatch.setattr(grid.shutil, "disk_usage", lambda _path: usage)
    out = tmp_path / "grid.json"
    runner = FakeRunner(tmp_path, out, FakeClock())
    points = grid.parse_points("4x2,8x2,16x2")
    data = grid.run_grid(points, options(grid, "none,kvtier", lanes=2), runner, out, runner.clock)
    assert runner.rounds == [
        [("4x2", "none", 0), ("8x2", "none", 1)],
        [("4x2", "kvtier", 0), ("8x2", "kvtier", 1)],
        [("16x2", "none", 0)],
        [("16x2", "kvtier", 0)],
    ]
    assert runner.clock.now == 4 * runner.seconds  # a round takes one configuration's time
    rows = {k: p["configs"] for k, p in data["points"].items()}
    assert rows["4x2"]["kvtier"]["alongside"] == ["8x2"]
    assert rows["8x2"]["none"]["alongside"] == ["4x2"]
    assert "alongside" not in rows["16x2"]["kvtier"]
    # 60 GiB free of 100 leaves 45 GiB for fs tiers: half of it to each lane.
    assert runner.fs_gib == {22.5}


def test_lanes_take_turns_at_configurations_with_an_fs_tier(
    grid: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "grid.json"
    runner = FakeRunner(tmp_path, out, FakeClock())
    opts = options(grid, "kvtier,kvtier_fs", lanes=2, disk_configs=frozenset({"kvtier_fs"}))
    data = grid.run_grid(grid.parse_points("4x2,8x2"), opts, runner, out, runner.clock)
    # Two engines' fs tiers on one disk slow each other: one point at a time.
    assert runner.rounds == [
        [("4x2", "kvtier", 0), ("8x2", "kvtier", 1)],
        [("4x2", "kvtier_fs", 0)],
        [("8x2", "kvtier_fs", 1)],
    ]
    rows = {k: p["configs"] for k, p in data["points"].items()}
    assert rows["4x2"]["kvtier"]["alongside"] == ["8x2"]
    assert "alongside" not in rows["4x2"]["kvtier_fs"]
    assert "alongside" not in rows["8x2"]["kvtier_fs"]

    # The estimate counts the turns: the first round took 300 s; after its rows (120 s a
    # configuration, as in the tests above) the next two points need 3 x 120 s, which does not
    # fit in the 300 s left (2 x 120 s, side by side, would).
    slow = slow_runner(tmp_path / "slow")
    (tmp_path / "slow").mkdir()
    opts = options(
        grid, "kvtier,kvtier_fs", max_minutes=10.0, lanes=2, disk_configs=frozenset({"kvtier_fs"})
    )
    grid.run_grid(grid.parse_points("4x2,8x2,16x2,4x4"), opts, slow, slow.out, slow.clock)
    assert [k for k, _ in slow.ran] == ["4x2", "8x2", "4x2", "8x2"]


def test_lanes_skip_what_is_done_and_stop_on_the_slowest_lane(
    grid: ModuleType, tmp_path: Path
) -> None:
    out = tmp_path / "grid.json"
    first = FakeRunner(tmp_path, out, FakeClock())
    grid.run_grid(grid.parse_points("4x2"), options(grid, "none,kvtier"), first, out, first.clock)
    again = FakeRunner(tmp_path, out, FakeClock())
    opts = options(grid, "none,kvtier", skip_done=True, lanes=2)
    grid.run_grid(grid.parse_points("4x2,8x2"), opts, again, out, again.clock)
    assert again.rounds == [[("8x2", "none", 0)], [("8x2", "kvtier", 0)]]

    slow = slow_runner(tmp_path / "slow")
    (tmp_path / "slow").mkdir()
    # After the first round the estimate is 120 s a configuration: the second round's two
    # configurations (240 s) do not fit in what is left of 6 minutes (360 - 200 s).
    opts = options(grid, "none,kvtier", max_minutes=6.0, lanes=2)
    grid.run_grid(grid.parse_points("4x2,8x2,16x2"), opts, slow, slow.out, slow.clock)
    assert [len(r) for r in slow.rounds] == [2, 2]


def test_estimates_use_the_rows_of_the_same_gpu(grid: ModuleType) -> None:
    est = grid.estimator_from(
        {
            "model": "m 8B",
            "points": {
                "4x2": {
                    "configs": {
                        "none": {
                            "prompt_tokens": 1000,
                            "wall_s": 10,
                            "elapsed_s": 70,
                            "machine": {"gpu": "H100"},
                        },
                        "kvtier": {
                            "prompt_tokens": 1000,
                            "wall_s": 1,
                            "elapsed_s": 2,
                            "machine": {"gpu": "H200"},
                        },
                    }
                }
            },
        },
        "m 8B",
        "H100",
    )
    assert est.seconds("none", 2000) == pytest.approx(60 + 0.01 * 2000)
    assert est.seconds("kvtier", 2000) == pytest.approx(80.0)  # falls back on none's samples
    # A child's whole process time, where recorded, is what a configuration costs.
    est.add("kvtier", {"prompt_tokens": 1000, "wall_s": 10, "elapsed_s": 40, "process_s": 70})
    assert est.seconds("kvtier", 2000) == pytest.approx(60 + 0.01 * 2000)
    assert grid.Estimator(grid.PRIORS["llama8b"]).seconds("x", 0) == grid.PRIORS["llama8b"][0]


# -- the engine side without an engine ----------------------------------------------------------


def test_hook_timer_counts_nested_hooks_once_and_ends_a_step_at_build_meta(
    eng: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Connector:
        def request_finished_all_groups(self) -> None:
            self.request_finished()

        def request_finished(self) -> None:
            pass

        def build_connector_meta(self) -> None:
            pass

    conn = Connector()
    timer = eng.HookTimer(conn)
    timer.enabled = True
    ticks = iter([0.0, 1.0, 3.0, 6.0, 10.0, 11.0, 20.0, 21.0, 25.0])
    monkeypatch.setattr(eng.time, "perf_counter", lambda: next(ticks))
    conn.request_finished_all_groups()  # 0..3, the inner call (from 1) not added again
    conn.build_connector_meta()  # 6..10: the step took 3 + 4
    conn.build_connector_meta()  # 11..20
    assert timer.steps == [7.0, 9.0]
    timer.enabled = False
    conn.build_connector_meta()  # 21..25, not recorded
    assert timer.steps == [7.0, 9.0]


def test_hook_timer_keeps_gc_pauses_inside_hooks_and_each_hooks_share_of_the_slowest_steps(
    eng: ModuleType,
) -> None:
    class Connector:
        def get_num_new_matched_tokens(self, collect: bool) -> None:
            if collect:
                gc.collect()

        def build_connector_meta(self) -> None:
            pass

    conn = Connector()
    timer = eng.HookTimer(conn, enabled=True)
    enabled = gc.isenabled()
    gc.disable()  # only the collections the test asks for
    try:
        for step in range(150):
            conn.get_num_new_matched_tokens(collect=step == 7)
            conn.build_connector_meta()
            if step == 9:
                gc.collect()  # between hooks: not the connector's time
    finally:
        if enabled:
            gc.enable()
        timer.close()
    assert timer._on_gc not in gc.callbacks
    assert [i for i, g in enumerate(timer.gc_steps) if g > 0] == [7]
    assert timer.gc_steps[7] <= timer.steps[7]
    figures = eng.connector_figures(timer)
    slowest = figures["connector_slowest_steps"]
    assert figures["steps_with_gc"] == 1 and slowest["steps"] == 1
    # the slowest step is the one that collected, and its time is in the hook that did
    assert slowest["with_gc"] == 1 and slowest["gc_us"] > 0
    assert slowest["wall_us"] == round(timer.steps[7] * 1e6, 1)
    assert slowest["by_hook_us"]["get_num_new_matched_tokens"] >= slowest["gc_us"]
    assert set(slowest["by_hook_us"]) == {"get_num_new_matched_tokens", "build_connector_meta"}


def test_cost_sampler_records_the_rules_rates_once_a_second_outside_the_timed_hooks(
    eng: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Connector:
        def __init__(self) -> None:
            self.snapshots = 0

        def stats_snapshot(self) -> dict[str, Any]:
            self.snapshots += 1
            slow_lookup(time.perf_counter() + 0.01)  # not the connector's step time
            return {
                "prefill_tokens_per_s": 48961.8 if self.snapshots > 1 else None,
                "read_tokens_per_s": {"fs": 17600.4},
                "cache": {"promotions_declined": 10 * self.snapshots, "promoted_blocks": 3},
                "connector": {"deferred_lookups": 2, "lookups_held_in_order": 1},
            }

        def build_connector_meta(self) -> None:
            pass

    conn = Connector()
    sampler = eng.CostSampler(conn)
    timer = eng.HookTimer(conn, after_step=sampler)
    clock = iter([100.0, 100.5, 101.0, 101.2, 103.0])
    monkeypatch.setattr(eng.time, "monotonic", lambda: next(clock))
    conn.build_connector_meta()  # not enabled: no sample
    timer.enabled = True
    for _ in range(5):
        conn.build_connector_meta()
    assert conn.snapshots == 3  # at 100, 101 and 103 s
    assert sampler.figures()["cost_samples"] == {
        "fields": ["t_s", "prefill", "reads", "declined", "promoted", "deferred", "held"],
        "rows": [
            [0.0, 0, {"fs": 17600}, 10, 3, 2, 1],
            [1.0, 48962, {"fs": 17600}, 20, 3, 2, 1],
            [3.0, 48962, {"fs": 17600}, 30, 3, 2, 1],
        ],
    }
    assert max(timer.steps) < 0.005  # the snapshots' 10 ms are outside the steps
    assert eng.CostSampler(object()).figures() == {}


def slow_lookup(until: float) -> None:
    """Busy until ``until`` (``time.perf_counter``): a hook's slow work, seen by the profiler."""
    while time.perf_counter() < until:
        pass


def test_hook_timer_profiles_only_the_slow_steps(
    eng: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Connector:
        def get_num_new_matched_tokens(self, slow: bool) -> None:
            if slow:
                slow_lookup(time.perf_counter() + 0.005)

        def build_connector_meta(self) -> None:
            pass

    monkeypatch.setenv(eng.PROFILE_ENV, f"{tmp_path},3")
    where, threshold = eng.profile_setting()
    assert (where, threshold) == (tmp_path, 0.003)
    conn = Connector()
    timer = eng.HookTimer(conn, enabled=True, profile_s=threshold)
    for step in range(10):
        conn.get_num_new_matched_tokens(slow=step in (2, 7))
        conn.build_connector_meta()
    assert timer.profiled_steps == 2
    profile = timer.slow_profile
    assert profile is not None
    functions = {name for _file, _line, name in profile.stats}  # type: ignore[attr-defined]
    assert {"slow_lookup", "get_num_new_matched_tokens", "build_connector_meta"} <= functions
    calls = {name: stat[1] for (_f, _l, name), stat in profile.stats.items()}  # type: ignore[attr-defined]
    assert calls["slow_lookup"] == 2 and calls["build_connector_meta"] == 2  # the slow steps only
    eng.save_slow_profile(timer, tmp_path / "prof", "kvtier-4x2.prof")
    saved = pstats.Stats(str(tmp_path / "prof" / "kvtier-4x2.prof"))
    assert saved.total_calls == profile.total_calls  # type: ignore[attr-defined]
    monkeypatch.setenv(eng.PROFILE_ENV, f"{tmp_path},fast")
    with pytest.raises(ValueError, match="expected DIR or DIR,MS"):
        eng.profile_setting()
    monkeypatch.delenv(eng.PROFILE_ENV)
    assert eng.profile_setting() is None


def test_conversations_keep_stable_ids_and_drop_what_does_not_fit(eng: ModuleType) -> None:
    from kvtier.demo import build_workload

    workload = build_workload(24, 4, 3, 8, vocab=512)
    full = eng.conversations(workload, 2, 512, 10**6)
    assert full.dropped == 0
    ids = [c.next_request()[0] for c in full.conversations()]
    assert ids == [f"c{i}.t1" for i, _ in full.by_conversation]
    longest = max(len(p) for p in full.all())
    cut = eng.conversations(workload, 2, 512, longest - 1)
    assert cut.dropped >= 1
    assert all(len(p) < longest for p in cut.all())


def test_reusable_tokens_count_full_blocks_seen_before(eng: ModuleType) -> None:
    a = list(range(10, 26))  # 16 tokens: 4 blocks of 4
    assert eng.reusable_tokens([a, [*a, 1, 2, 3, 4], a[:8] + [0] * 8], 4) == 16 + 8
    # Equal blocks after different prefixes are different blocks.
    assert eng.reusable_tokens([[1] * 4 + [2] * 4, [3] * 4 + [2] * 4], 4) == 0


def test_native_fs_is_vllm_tiering_with_an_fs_tier(
    eng: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = eng.ModelSpec("m", tmp_path, 100, 8, True)
    spec = eng.RunSpec("native_fs", 8, 2.5, 10.0, 1 << 30, 4096, tmp_path)
    monkeypatch.setattr(eng, "fs_tier_type", lambda: "fs")
    kwargs = eng.engine_kwargs(spec, model)
    extra = kwargs["kv_transfer_config"]["kv_connector_extra_config"]
    assert kwargs["kv_transfer_config"]["kv_connector"] == "OffloadingConnector"
    assert extra["spec_name"] == "TieringOffloadingSpec"
    assert extra["cpu_bytes_to_use"] == int(2.5 * (1 << 30))
    (tier,) = extra["secondary_tiers"]
    assert tier["type"] == "fs" and Path(tier["root_dir"]).is_relative_to(tmp_path / "native_fs")
    eng.clear_fs(tmp_path)
    assert not (tmp_path / "native_fs").exists()


def test_kvtier_variants_from_the_environment(
    eng: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = eng.RunSpec("kvtier_fs", 8, 2.5, 10.0, 1 << 30, 4096, tmp_path)
    monkeypatch.delenv(eng.EVICTION_ENV, raising=False)
    monkeypatch.delenv(eng.ASYNC_LOADS_ENV, raising=False)
    plain = eng.kvtier_extra(spec)
    assert "eviction" not in plain and plain["vllm"]["async_loads"] is False
    assert plain["tiers"][0]["kind"] == "fs" and plain["pool"]["size"] == "2.5GiB"
    monkeypatch.setenv(eng.EVICTION_ENV, "lru")
    monkeypatch.setenv(eng.ASYNC_LOADS_ENV, "1")
    varied = eng.kvtier_extra(spec)
    assert varied["eviction"] == "lru" and varied["vllm"]["async_loads"] is True
    monkeypatch.setenv(eng.ASYNC_LOADS_ENV, "auto")
    assert eng.kvtier_extra(spec)["vllm"]["async_loads"] == "auto"


def test_the_pool_alone_runs_and_records_kvtiers_default_loads(
    eng: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unset, the variable leaves the default to kvtier: "auto" without tiers (as the row says)."""
    monkeypatch.delenv(eng.ASYNC_LOADS_ENV, raising=False)
    spec = eng.RunSpec("kvtier", 8, 2.5, 10.0, 1 << 30, 4096, tmp_path)
    assert eng.kvtier_extra(spec)["vllm"]["async_loads"] == "auto"
    assert eng.async_loads(tiered=False) == "auto" and eng.async_loads(tiered=True) is False


@require.unless("vllm", require.vllm_missing())
def test_native_fs_names_what_this_vllm_lacks(
    eng: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert eng.fs_tier_type() == "fs"  # the CPU build has the tiering module
    real = eng.importlib.import_module

    def without_tiering(name: str, *args: Any) -> Any:
        if name.startswith("vllm.v1.kv_offload.tiering"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(eng.importlib, "import_module", without_tiering)
    with pytest.raises(RuntimeError, match="has no multi-tier offloading"):
        eng.fs_tier_type()


def test_disk_guard_stops_below_its_floor(eng: ModuleType, tmp_path: Path) -> None:
    free = shutil.disk_usage(tmp_path).free
    eng.DiskGuard(tmp_path, floor=free // 2).check()
    with pytest.raises(eng.DiskFloorReached, match="no capacity limit"):
        eng.DiskGuard(tmp_path, floor=free * 2).check()


# -- report and plot ----------------------------------------------------------------------------


def synthetic_grid() -> dict[str, Any]:
    points: dict[str, Any] = {}
    for c in (4, 8, 16, 32):
        for h in (2.0, 4.0, 8.0):
            configs = {}
            for i, config in enumerate(("none", "native", "native_fs", "kvtier", "kvtier_fs")):
                base = 100.0 * c / h + 10 * i
                configs[config] = make_row(
                    {"c0.t1": base, "c0.t2": base / 2},
                    {"c0.t2": 32} if config != "none" else {},
                    p=(base, 2 * base, 3 * base),
                    tok_s=1000.0 / (1 + i) + c,
                    commit="abc1234",
                    date="2026-11-26T10:00:00+00:00",
                )
            points[f"{c}x{h:g}"] = {"concurrency": c, "host_gib": h, "configs": configs}
    return {"model": "synthetic", "points": points}


def test_report_only_prints_the_table_and_checks(
    modules: dict[str, ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "grid.json"
    modules["grid"].save(path, synthetic_grid())
    assert modules["bench"].main(["--report-only", "--grid", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith(("4x2 ", "32x8 "))]
    assert len(lines) == 10  # two points, five configurations
    assert "16x4: " in out and "checks pass" in out
    assert "abc1234" in out


def test_plot_is_written_from_a_synthetic_grid(rep: ModuleType, tmp_path: Path) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        require.missing("extras", f"matplotlib is not importable: {exc}")
    path = rep.write_plot(synthetic_grid(), tmp_path / "grid.png")
    assert path == tmp_path / "grid.png"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 10_000


def test_unknown_configs_and_bad_points_are_one_line_errors(
    modules: dict[str, ModuleType], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    bench = modules["bench"]
    with pytest.raises(SystemExit) as stop:
        bench.main(["--configs", "none,nope", "--workdir", str(tmp_path)])
    assert stop.value.code == 2
    assert "unknown configs ['nope']" in capsys.readouterr().err


CHILD = """
import json, os, sys, time
config, row_path, digest = sys.argv[1:4]
began = time.time()
if config == "native":
    time.sleep(60)  # hangs
if config == "kvtier_fs":
    sys.exit(3)  # dies before it writes its row
if config == "native_fs":  # an offloading region left behind
    open("/dev/shm/vllm_offload_" + str(os.getpid()) + ".mmap", "w").close()
time.sleep(0.5)
row = {
    "gpu": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "cache": os.environ.get("VLLM_CACHE_ROOT"),
    "began": began,
    "ended": time.time(),
    "workload_digest": "another" if config == "none" else digest,
}
open(row_path, "w").write(json.dumps(row))
"""


def scripted_children(
    modules: dict[str, ModuleType], tmp_path: Path, lanes: int, timeout_s: float
) -> tuple[Any, Any]:
    """A ChildPointRunner whose children are ``CHILD`` (its behaviour chosen by the config's
    name), and the workload of point 2x0.05."""
    bench, eng, grid = modules["bench"], modules["engine"], modules["grid"]

    class Scripted(bench.ChildPointRunner):  # type: ignore[name-defined,misc]
        def command(self, job: Any, row_path: Path) -> list[str]:
            return [sys.executable, "-c", CHILD, job.config, str(row_path), job.workload.digest]

    settings = eng.Settings(3, 8, 1, 4, 2048, 0.004, tmp_path)
    model = eng.make_model("tiny", tmp_path)
    argv = ["--grid", "--model", "tiny"]
    runner = Scripted(settings, model, {2: 8}, argv, timeout_s, lanes)
    return runner, runner.workload(grid.parse_point("2x0.05"))


def test_each_configuration_runs_in_a_child_and_a_dead_child_is_an_error_row(
    modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    bench, grid = modules["bench"], modules["grid"]
    runner, workload = scripted_children(modules, tmp_path, 1, timeout_s=3)
    point = grid.parse_point("2x0.05")

    def run(config: str) -> dict[str, Any]:
        [row] = runner.run([grid.Job(point, workload, config, 1.5)])
        return dict(row)

    row = run("kvtier")
    assert row.pop("process_s") >= 0.5  # the child's whole life, for the grid's estimates
    assert set(row) == {"gpu", "cache", "began", "ended"}
    assert run("kvtier_fs") == {
        "error": "the configuration's process exited with 3 and wrote no row"
    }
    assert "another request sequence" in run("none")["error"]
    assert run("native") == {"error": "the configuration's process ran past 3 s: killed"}
    # The real command: the parent's arguments, then the one point and configuration
    # (argparse keeps the last).
    job = grid.Job(point, workload, "kvtier", 1.5)
    command = bench.ChildPointRunner.command(runner, job, tmp_path / "row.json")
    assert command[2:5] == ["--grid", "--model", "tiny"]
    assert command[5:11] == ["--grid-points", "2x0.05", "--configs", "kvtier", "--fs-gib", "1.5"]
    assert "--shares-host" not in command and "--workdir" not in command


def test_lanes_run_their_children_at_once_each_on_its_gpu(
    modules: dict[str, ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench, grid = modules["bench"], modules["grid"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    runner, workload = scripted_children(modules, tmp_path, 2, timeout_s=4)
    a, b = grid.parse_point("2x0.05"), grid.parse_point("2x0.1")
    shm_before = bench.eng.offload_shm_files()
    first, second = runner.run(
        [grid.Job(a, workload, "kvtier", 1.5, 0), grid.Job(b, workload, "native_fs", 1.5, 1)]
    )
    assert (first["gpu"], second["gpu"]) == ("3", "5")
    assert first["cache"] == str(tmp_path / "cache" / "lane0")
    assert second["cache"] == str(tmp_path / "cache" / "lane1")
    assert first["began"] < second["ended"] and second["began"] < first["ended"]  # at once
    assert bench.eng.offload_shm_files() == shm_before  # the region left is removed
    lane1 = grid.Job(b, workload, "kvtier", 2.0, 1)
    command = bench.ChildPointRunner.command(runner, lane1, Path("r"))
    assert command[-5:] == [
        "--workdir",
        str(tmp_path / "lane1"),
        "--shares-host",
        "--child-row",
        "r",
    ]
    # A lane that hangs is killed at its timeout; the other's row is kept.
    hung, done = runner.run(
        [grid.Job(a, workload, "native", 1.5, 0), grid.Job(b, workload, "kvtier", 1.5, 1)]
    )
    assert "killed" in hung["error"] and done["gpu"] == "5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(grid.GridError, match="--gpus 2 needs 2 GPUs; 1 visible"):
        bench.lane_gpus(2)


@require.unless("vllm", require.vllm_missing())  # the failure path resets vLLM's connector
def test_an_engine_sharing_the_host_leaves_new_offloading_regions_to_the_grid(
    modules: dict[str, ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bench, eng = modules["bench"], modules["engine"]
    region = Path(f"/dev/shm/vllm_offload_test{os.getpid()}.mmap")

    def failing_engine(*_args: Any) -> dict[str, Any]:
        region.touch()  # another engine's region, made while this one ran
        raise RuntimeError("engine failed")

    monkeypatch.setattr(bench, "run_config", failing_engine)
    spec = eng.RunSpec("kvtier", 2, 0.05, 0.0, 1 << 20, 2048, tmp_path)
    try:
        for shares_host, kept in ((True, True), (False, False)):
            region.unlink(missing_ok=True)
            row = bench.run_safely(spec, None, None, 4, shares_host)
            assert row["error"] == "RuntimeError: engine failed"
            assert region.exists() is kept
    finally:
        region.unlink(missing_ok=True)


def test_a_child_run_needs_one_point_and_its_fs_capacity(
    modules: dict[str, ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--grid", "--model", "tiny", "--workdir", str(tmp_path), "--configs", "kvtier"]
    for extra in (["--grid-points", "2x0.05,4x1", "--fs-gib", "1"], ["--grid-points", "2x0.05"]):
        with pytest.raises(SystemExit) as exit_info:
            modules["bench"].main([*base, *extra, "--child-row", str(tmp_path / "row.json")])
        assert exit_info.value.code == 2
        assert "--child-row needs one --grid-points point and --fs-gib" in capsys.readouterr().err
    assert not (tmp_path / "row.json").exists()


# -- one tiny point in vLLM's CPU build ---------------------------------------------------------


BESIDE_SMOKE = (
    "beside.write_mbps=50+beside.write_source_mib=8+beside.write_checksum=true"
    "+beside.switch_interval_ms=20"
)


@require.unless("vllm", require.vllm_missing())
def test_tiny_grid_point_in_vllm_cpu(modules: dict[str, ModuleType], tmp_path: Path) -> None:
    out = tmp_path / "grid.json"
    argv = [
        "--grid", "--model", "tiny", "--configs", f"none,kvtier,kvtier+{BESIDE_SMOKE}",
        "--grid-points", "2x0.05",
        "--grid-requests", "2:8", "--turns", "3", "--max-tokens", "4", "--widen", "1",
        "--context-blocks", "8", "--max-model-len", "2048", "--gpu-kv-gib", "0.004",
        "--fs-gib", "0.1", "--workdir", str(tmp_path / "work"), "--json", str(out),
        "--commit", "test",
    ]  # fmt: skip
    assert modules["bench"].main(argv) == 0
    point = json.loads(out.read_text())["points"]["2x0.05"]
    none, kvtier = point["configs"]["none"], point["configs"]["kvtier"]
    assert "error" not in none and "error" not in kvtier
    ids = [r[0] for r in none["per_request"]["rows"]]
    assert ids == [r[0] for r in kvtier["per_request"]["rows"]]
    assert len(ids) == point["workload"]["requests"] == 8
    assert kvtier["kvtier"]["loaded_blocks"] >= 0 and kvtier["connector_step_us"]["steps"] > 0
    assert not (tmp_path / "work" / "fs").exists()
    beside = point["configs"][f"kvtier+{BESIDE_SMOKE}"]
    assert beside["beside_write"]["mbps_asked"] == 50 and beside["beside_write"]["bytes"] > 0
    assert (beside["beside_write"]["source_mib"], beside["beside_write"]["checksum"]) == (8, True)
    assert [r[0] for r in beside["per_request"]["rows"]] == ids
    assert "beside_write" not in kvtier and not (tmp_path / "work" / "beside").exists()
    # The engine ran in this process: its thread's CPU and context switches over the timed run.
    threads = kvtier["engine_threads"]
    assert 0 < threads["main_cpu_s"] <= kvtier["wall_s"] + 1
    assert threads["main_voluntary_switches"] >= 0 and threads["main_involuntary_switches"] >= 0
    assert sum(threads["others_cpu_s"].values()) >= 0


def test_hybrid_models_and_their_bytes_per_cached_token(
    eng: ModuleType, modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    gemma = eng.make_model("gemma3", tmp_path)
    config = json.loads((gemma.path / "config.json").read_text())
    assert config["sliding_window"] == 1024 and config["num_hidden_layers"] == 48
    nemotron = json.loads((eng.make_model("nemotronh", tmp_path).path / "config.json").read_text())
    pattern = nemotron["hybrid_override_pattern"]
    assert len(pattern) == 52 and pattern.count("*") == 4
    assert eng.make_model("llama8b", tmp_path).kv_bytes_per_token == 32 * 2 * 8 * 128 * 2

    bench = modules["bench"]
    stats = {
        "block_tokens": 16,
        "groups": {
            "0": {"kind": "window", "stored_bytes": 1000},
            "1": {"kind": "window", "stored_bytes": 600},
            "2": {"kind": "full", "stored_blocks": 10, "stored_bytes": 3200},
        },
    }
    assert bench.group_bytes_per_token(stats) == {"window": 10.0, "full": 20.0}


def test_hybrid_gpu_kv_is_sized_in_the_blocks_vllm_allocates(
    eng: ModuleType, tmp_path: Path
) -> None:
    gemma, nemotron = eng.make_model("gemma3", tmp_path), eng.make_model("nemotronh", tmp_path)
    # Gemma-3-12B: 8 full + 40 sliding layers -> 6 groups of 8 layers, 16-token blocks of 1 MiB.
    assert (gemma.pool.groups, gemma.pool.group_layers, gemma.block_tokens) == (6, 8, 16)
    assert gemma.pool.block_bytes == 1 << 20
    # Nemotron-H-8B: 4 attention + 24 Mamba-2 layers -> 7 groups of 4; a Mamba-2 state (4,255,744
    # bytes) takes 1,152 attention tokens (a multiple of its 128-token chunk), as vLLM logged.
    assert (nemotron.pool.groups, nemotron.pool.group_layers, nemotron.block_tokens) == (7, 4, 1152)
    need_16k = nemotron.pool.request_bytes(16384, eng.VLLM_BATCHED_TOKENS)
    assert round(need_16k / (1 << 30), 2) == 1.85  # vLLM 0.25.1's start-up error on the H100

    settings = eng.Settings(4, 40, 4, 32, 16384, None, tmp_path)
    _prompts, summary = eng.build_point(settings, gemma, 16, 160)
    longest = summary["prompt_tokens_max"] + 32
    assert summary["max_model_len"] == -(-longest // 16) * 16  # lowered to the workload
    # 2.5 requests at vLLM's peak for one (not 38.7 GiB: all 48 layers counted as full).
    assert summary["gpu_kv_blocks"] == math.ceil(2.5 * summary["request_peak_blocks"])
    assert summary["gpu_kv_gib"] < 7
    _prompts, summary = eng.build_point(settings, nemotron, 16, 160)
    assert summary["max_model_len"] == 6912 and summary["block_tokens"] == 1152
    assert summary["request_peak_blocks"] == 7 * 6
    assert summary["gpu_kv_blocks"] * nemotron.pool.block_bytes == summary["gpu_kv_bytes"]
    # Reusable tokens count whole 1,152-token blocks.
    assert summary["reusable_prompt_tokens"] % 1152 == 0
    # A size vLLM would refuse at start is refused before the engine starts.
    small = eng.Settings(4, 40, 4, 32, 16384, 0.5, tmp_path)
    with pytest.raises(ValueError, match="vLLM needs 42"):
        eng.build_point(small, nemotron, 16, 160)
    # One full-attention group: sized as before.
    llama = eng.make_model("llama8b", tmp_path)
    _prompts, summary = eng.build_point(settings, llama, 16, 160)
    assert summary["max_model_len"] == 16384 and "block_tokens" not in summary
    assert summary["gpu_kv_bytes"] == 16 * longest * llama.kv_bytes_per_token


def test_merge_copies_the_newer_rows_of_another_grid_file(
    modules: dict[str, ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A lent GPU runs the grid on a copy of the file: its rows come back with ``--merge``,
    newer ones replacing older, failed ones and another workload's left out."""
    grid = modules["grid"]

    def row(date: str, **extra: Any) -> dict[str, Any]:
        return make_row({"c0.t1": 10.0}, date=date, commit="c1", **extra)

    def point(digest: str, **configs: dict[str, Any]) -> dict[str, Any]:
        return {
            "concurrency": 8,
            "host_gib": 4.0,
            "workload": {"digest": digest},
            "configs": configs,
        }

    ours = {
        "points": {
            "8x4": point("w1", native=row("2026-11-26"), kvtier=row("2026-11-27T10")),
            "16x2": point("w2", native=row("2026-11-26")),
        }
    }
    lent = {
        "points": {
            "8x4": point(
                "w1",
                native=row("2026-11-25"),  # older than ours: stays ours
                kvtier=row("2026-11-27T20"),
                kvtier_fs=row("2026-11-27T21"),
                native_fs=row("2026-11-27T21", error="disk guard"),
            ),
            "16x2": point("w3", kvtier=row("2026-11-27T22")),  # another workload
            "32x2": point("w4", none=row("2026-11-27T23")),
        }
    }
    path, other = tmp_path / "grid.json", tmp_path / "lent.json"
    grid.save(path, ours)
    grid.save(other, lent)
    assert modules["bench"].main(["--grid", "--json", str(path), "--merge", str(other)]) == 0
    out = capsys.readouterr().out
    assert "left out 16x2: another workload than the file's" in out
    merged = json.loads(path.read_text())["points"]
    assert merged["8x4"]["configs"]["native"]["date"] == "2026-11-26"
    assert merged["8x4"]["configs"]["kvtier"]["date"] == "2026-11-27T20"
    assert set(merged["8x4"]["configs"]) == {"native", "kvtier", "kvtier_fs"}
    assert merged["16x2"] == ours["points"]["16x2"]
    assert merged["32x2"]["configs"]["none"]["date"] == "2026-11-27T23"
    assert grid.merge_files(json.loads(path.read_text()), [lent]) == [
        "left out 16x2: another workload than the file's"
    ]  # merged once: nothing newer left


# -- variants: a kvtier base with settings on top -----------------------------------------------

VARIANT = "kvtier_fs+tiers.0.write=on_evict"


def test_labels_with_kvtier_settings_parse_the_same_in_the_replay_and_the_bench(
    modules: dict[str, ModuleType],
) -> None:
    variants, eng, bench = modules["variants"], modules["engine"], modules["bench"]
    spec = variants.parse_config(f"{VARIANT}+pool.writeback_window=0.5", eng.CONFIGS)
    assert (spec.label, spec.kind) == (f"{VARIANT}+pool.writeback_window=0.5", "kvtier_fs")
    assert spec.overrides == {"tiers.0.write": "on_evict", "pool.writeback_window": 0.5}
    assert variants.parse_config("kvtier+vllm.async_loads=true", eng.CONFIGS).overrides == {
        "vllm.async_loads": True
    }  # JSON where it is JSON
    assert variants.parse_config("native_fs", eng.CONFIGS).overrides == {}
    p = bench.parser()
    labels = bench.parse_configs(p, f" kvtier_fs , {VARIANT},kvtier+eviction=lru")
    assert labels == ["kvtier_fs", VARIANT, "kvtier+eviction=lru"]
    with benchmark_modules("scheduler_replay") as (sr,):
        replayed = sr.parse_config(VARIANT)
        assert isinstance(replayed, variants.ConfigSpec)  # one class, one parser
        assert replayed == variants.parse_config(VARIANT, eng.CONFIGS)
        with pytest.raises(ValueError, match="none, native, kvtier or kvtier_fs"):
            sr.parse_config("native_fs")  # the replay does not emulate vLLM's fs tiering


@pytest.mark.parametrize(
    ("configs", "message"),
    [
        ("kvtier,native+x=1", "config 'native+x=1': only kvtier takes key=value settings"),
        ("none+kv_offloading_size=4", "only kvtier takes key=value settings"),
        ("kvtier+novalue", "config 'kvtier+novalue': 'novalue' is not key=value"),
        ("nope+x=1,kvtier", "unknown configs ['nope']; choose from none, native, native_fs,"),
    ],
)
def test_settings_only_on_kvtier_bases_and_unknown_bases_list_the_choices(
    modules: dict[str, ModuleType],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    configs: str,
    message: str,
) -> None:
    with pytest.raises(SystemExit) as stop:
        modules["bench"].main(["--configs", configs, "--workdir", str(tmp_path)])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before anything was set up


def test_a_variants_engine_is_its_bases_with_its_keys_set(
    eng: ModuleType, modules: dict[str, ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(eng.EVICTION_ENV, raising=False)
    monkeypatch.delenv(eng.ASYNC_LOADS_ENV, raising=False)
    model = eng.ModelSpec("m", tmp_path, 100, 8, True)

    def spec(label: str) -> Any:
        return eng.RunSpec(label, 8, 2.5, 10.0, 1 << 30, 4096, tmp_path)

    base, variant = eng.kvtier_extra(spec("kvtier_fs")), eng.kvtier_extra(spec(VARIANT))
    fs_tier = {"kind": "fs", "path": str(tmp_path / "fs"), "capacity": "10GiB"}
    assert base["tiers"] == [fs_tier]
    assert variant["tiers"] == [{**fs_tier, "write": "on_evict"}]
    assert {k: v for k, v in variant.items() if k != "tiers"} == {
        **{k: v for k, v in base.items() if k != "tiers"},
        "vllm": {**base["vllm"], "stats_path": str(tmp_path / f"stats-{VARIANT}.json")},
    }
    assert (spec(VARIANT).base, spec(VARIANT).has_fs) == ("kvtier_fs", True)
    kwargs = eng.engine_kwargs(spec(VARIANT), model)
    assert kwargs["kv_transfer_config"]["kv_connector"] == "KVTierConnector"
    assert kwargs["kv_transfer_config"]["kv_connector_extra_config"] == variant
    # The row says what ran: a variant's load mode and its settings.
    settings = modules["bench"].kvtier_settings(spec("kvtier+vllm.async_loads=true"))
    assert settings == {
        "async_loads": True,
        "eviction": "default",
        "overrides": {"vllm.async_loads": True},
    }
    assert modules["bench"].kvtier_settings(spec("kvtier")) == {
        "async_loads": "auto",
        "eviction": "default",
    }
    # A value may be a path: the label still makes one file name in the work directory.
    odd = spec("kvtier+vllm.note=a/b c")
    assert odd.stats_path.parent == tmp_path
    assert odd.stats_path != spec("kvtier+vllm.note=a_b_c").stats_path


def test_variants_are_configurations_of_their_own_in_the_grid(
    modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    grid, bench = modules["grid"], modules["bench"]
    out = tmp_path / "grid.json"
    labels = ["kvtier", "kvtier_fs", VARIANT]
    disk = bench.disk_configs([*labels, "native_fs", "kvtier+eviction=lru"])
    assert disk == {"kvtier_fs", VARIANT, "native_fs"}  # a variant of an fs base: its disk rule
    first = FakeRunner(tmp_path, out, FakeClock())
    opts = options(grid, ",".join(labels), lanes=2, disk_configs=disk)
    data = grid.run_grid(grid.parse_points("4x2,8x2"), opts, first, out, first.clock)
    assert first.rounds[1:] == [
        [("4x2", "kvtier_fs", 0)],
        [("8x2", "kvtier_fs", 1)],
        [("4x2", VARIANT, 0)],
        [("8x2", VARIANT, 1)],
    ]
    assert set(data["points"]["4x2"]["configs"]) == set(labels)  # the full label is the key
    # --skip-done: each label stands for itself; a new variant runs, the rest is done.
    again = FakeRunner(tmp_path, out, FakeClock())
    more = [*labels, "kvtier_fs+tiers.0.write=through"]
    grid.run_grid(
        grid.parse_points("4x2"), options(grid, ",".join(more), skip_done=True), again, out
    )
    assert again.ran == [("4x2", "kvtier_fs+tiers.0.write=through")]
    # A variant without rows is estimated from its base's.
    est = grid.Estimator((1000.0, 1.0))
    est.add("kvtier", {"prompt_tokens": 1000, "wall_s": 10, "elapsed_s": 40})
    est.add("none", {"prompt_tokens": 1000, "wall_s": 1, "elapsed_s": 2})
    assert est.seconds("kvtier+eviction=lru", 1000) == est.seconds("kvtier", 1000)


def test_a_variants_child_gets_its_label_whole(
    modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    bench, grid = modules["bench"], modules["grid"]
    runner, workload = scripted_children(modules, tmp_path, 1, timeout_s=3)
    label = f"{VARIANT}+pool.writeback_window=0.5"
    job = grid.Job(grid.parse_point("2x0.05"), workload, label, 1.5)
    command = bench.ChildPointRunner.command(runner, job, tmp_path / "row.json")
    at = command.index("--configs")
    assert command[at + 1] == label  # one argument: no shell, nothing to quote
    assert bench.parse_configs(bench.parser(), command[at + 1]) == [label]


BESIDE = "beside.write_mbps=1000"


@pytest.mark.parametrize("base", ["none", "native", "native_fs", "kvtier", "kvtier_fs"])
def test_a_writer_beside_the_engine_is_the_benchs_setting_on_any_base(
    modules: dict[str, ModuleType], base: str
) -> None:
    variants, eng = modules["variants"], modules["engine"]
    spec = variants.parse_config(f"{base}+{BESIDE}+beside.write_fsync=true", eng.CONFIGS)
    assert (spec.kind, spec.overrides) == (base, {})
    assert spec.beside == {"beside.write_mbps": 1000, "beside.write_fsync": True}
    assert variants.is_variant(spec.label) and variants.base_of(spec.label) == base
    # Another key stays kvtier's: refused beside it on vLLM's own configurations.
    mixed = f"{base}+{BESIDE}+pool.writeback_window=0.5"
    if base.startswith("kvtier"):
        assert variants.parse_config(mixed, eng.CONFIGS).overrides == {"pool.writeback_window": 0.5}
    else:
        with pytest.raises(ValueError, match="only kvtier takes key=value settings"):
            variants.parse_config(mixed, eng.CONFIGS)


def test_kvtier_never_sees_a_beside_key(
    modules: dict[str, ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    variants, eng, bench = modules["variants"], modules["engine"], modules["bench"]
    monkeypatch.delenv(eng.EVICTION_ENV, raising=False)
    monkeypatch.delenv(eng.ASYNC_LOADS_ENV, raising=False)

    def extra(label: str) -> dict[str, Any]:
        got = eng.kvtier_extra(eng.RunSpec(label, 8, 2.5, 10.0, 1 << 30, 4096, tmp_path))
        got["vllm"].pop("stats_path")  # a file per label
        return dict(got)

    assert extra(f"kvtier+{BESIDE}") == extra("kvtier")
    assert extra(f"kvtier_fs+tiers.0.write=on_evict+{BESIDE}") == extra(VARIANT)
    # Nor through apply_overrides given the keys whole.
    given = variants.apply_overrides({"pool": {}}, {"beside.write_mbps": 5, "pool.x": 1})
    assert given == {"pool": {"x": 1}}
    spec = eng.RunSpec(f"kvtier+{BESIDE}", 8, 2.5, 10.0, 1 << 30, 4096, tmp_path)
    assert "overrides" not in bench.kvtier_settings(spec)  # no kvtier key set


@pytest.mark.parametrize(
    ("label", "message"),
    [
        ("none+beside.write_mbps=0", "beside.write_mbps=0; beside settings: beside.write_mbps"),
        ("kvtier+beside.write_mbps=true", "beside.write_mbps=true;"),
        ("kvtier+beside.write_mbps=Infinity", "beside.write_mbps=Infinity;"),
        ("native+beside.write_fsync=true", "beside.write_fsync=true;"),  # fsync of no writer
        ("kvtier+beside.write_fsync=1+beside.write_mbps=5", "beside.write_fsync=1;"),
        ("none+beside.read_mbps=5", "beside.read_mbps=5;"),
        ("kvtier+beside.switch_interval_ms=0", "beside.switch_interval_ms=0;"),
        ("kvtier+beside.write_source_mib=64", "beside.write_source_mib=64;"),  # no writer
        ("kvtier+beside.write_mbps=5+beside.write_source_mib=1", "beside.write_source_mib=1;"),
        ("kvtier+beside.write_mbps=5+beside.write_source_mib=2.5", "beside.write_source_mib=2.5;"),
        ("none+beside.write_mbps=5+beside.write_checksum=1", "beside.write_checksum=1;"),
        ("kvtier_fs+beside.switch_interval_ms=fast", 'beside.switch_interval_ms="fast";'),
    ],
)
def test_beside_settings_are_checked(
    modules: dict[str, ModuleType], label: str, message: str
) -> None:
    variants, eng = modules["variants"], modules["engine"]
    with pytest.raises(ValueError, match=re.escape(f"config {label!r}: {message}")):
        variants.parse_config(label, eng.CONFIGS)


def test_a_switch_interval_holds_for_the_timed_run_only(
    modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    bench, eng = modules["bench"], modules["engine"]
    default = sys.getswitchinterval()
    spec = eng.RunSpec("kvtier_fs+beside.switch_interval_ms=50", 8, 2.5, 10.0, 1 << 30, 4, tmp_path)
    assert spec.variant.beside == {"beside.switch_interval_ms": 50}
    with pytest.raises(RuntimeError, match="run failed"), bench.switch_interval(spec):
        assert sys.getswitchinterval() == pytest.approx(0.05)
        raise RuntimeError("run failed")
    assert sys.getswitchinterval() == default
    with bench.switch_interval(eng.RunSpec("kvtier_fs", 8, 2.5, 10.0, 1 << 30, 4, tmp_path)):
        assert sys.getswitchinterval() == default


def test_the_replay_refuses_what_runs_beside_the_engine(modules: dict[str, ModuleType]) -> None:
    with benchmark_modules("scheduler_replay") as (sr,):
        with pytest.raises(ValueError, match=r"beside\.write_mbps run beside vLLM's engine"):
            sr.parse_config(f"kvtier+{BESIDE}")
        assert sr.parse_config("kvtier+pool.x=1").beside == {}


def test_a_beside_writer_runs_with_its_label_on_the_fs_tiers_disk_clear_of_the_guard(
    modules: dict[str, ModuleType], tmp_path: Path
) -> None:
    bench, eng, grid = modules["bench"], modules["engine"], modules["grid"]

    def writer(label: str) -> Any:
        return bench.beside_writer(eng.RunSpec(label, 8, 2.5, 10.0, 1 << 30, 4096, tmp_path))

    assert writer("kvtier") is None and writer(VARIANT) is None
    plain, synced = writer(f"kvtier+{BESIDE}"), writer(f"none+{BESIDE}+beside.write_fsync=true")
    assert (plain.directory, plain.mbps, plain.fsync) == (tmp_path / "beside", 1000.0, False)
    assert (synced.mbps, synced.fsync) == (1000.0, True)
    assert (plain.source_mib, plain.checksum) == (0, False)
    like_the_tier = writer(
        f"kvtier+{BESIDE}+beside.write_source_mib=2048+beside.write_checksum=true"
    )
    assert (like_the_tier.source_mib, like_the_tier.checksum) == (2048, True)
    # The writer's files beside a full fs tier (the reserve left free) stay above the floor.
    for total in (64 << 30, 4 << 40):
        reserve = max(grid.RESERVE_GIB * (1 << 30), grid.RESERVE_SHARE * total)
        assert reserve - plain.keep_mib * (1 << 20) > grid.disk_floor_bytes(total)
    # It loads the disk and the host: one point at a time, as the fs configurations run.
    labels = ["kvtier", f"kvtier+{BESIDE}", f"none+{BESIDE}", "kvtier_fs"]
    assert bench.disk_configs(labels) == {f"kvtier+{BESIDE}", f"none+{BESIDE}", "kvtier_fs"}
    assert bench.parse_configs(bench.parser(), ",".join(labels)) == labels


def with_variants(data: dict[str, Any]) -> dict[str, Any]:
    """``synthetic_grid`` with variants at 4x2: one of kvtier_fs, 10% more tokens/s, half its
    p99 and twice its connector p99; a failed one of kvtier; one whose base failed."""
    data = json.loads(json.dumps(data))
    configs = data["points"]["4x2"]["configs"]
    base = configs["kvtier_fs"]
    base["connector_step_us"] = {"p50": 100.0, "p99": 400.0}
    configs[VARIANT] = make_row(
        {"c0.t1": 1.0, "c0.t2": 0.5},
        {"c0.t2": 32},
        p=(1.0, 2.0, base["ttft_ms"]["99"] / 2),
        tok_s=base["output_tokens_per_s"] * 1.1,
        connector_step_us={"p50": 100.0, "p99": 800.0},
    )
    configs["kvtier+eviction=lru"] = {"error": "RuntimeError: boom"}
    configs["native"] = {"error": "no CUDA"}
    data["points"]["8x2"]["configs"]["kvtier"] = {"error": "engine failed"}
    data["points"]["8x2"]["configs"]["kvtier+vllm.async_loads=true"] = make_row({"c0.t1": 1.0})
    return data


def test_report_prints_each_variant_against_its_base_and_checks_only_the_bases(
    modules: dict[str, ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench, rep = modules["bench"], modules["report"]
    plain = with_variants(synthetic_grid())
    for configs in (plain["points"]["4x2"]["configs"], plain["points"]["8x2"]["configs"]):
        for label in [c for c in configs if "+" in c]:
            del configs[label]
    data = with_variants(synthetic_grid())
    path = tmp_path / "grid.json"
    modules["grid"].save(path, data)
    assert bench.main(["--report-only", "--grid", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    table = [line.split()[:2] for line in out.splitlines() if line.startswith("4x2 ")]
    assert [config for _point, config in table] == [
        "none",
        "native",
        "native_fs",
        "kvtier",
        "kvtier+eviction=lru",
        "kvtier_fs",
        VARIANT,
    ]  # each variant after its base
    assert (
        f"  4x2 {VARIANT} vs kvtier_fs: tok/s 1.100x better, TTFT p99 0.500x better, "
        "connector p99 2.000x worse"
    ) in out.splitlines()
    assert "  4x2 kvtier+eviction=lru vs kvtier: failed" in out.splitlines()
    assert "  8x2 kvtier+vllm.async_loads=true vs kvtier: no usable kvtier row" in out
    # The checks are the bases': the same as without the variants, line for line.
    checks = out[out.index("acceptance") : out.index("plot  ")].splitlines()
    assert "+" not in "".join(checks)
    expected = rep.grid_lines(plain)
    assert checks == expected[expected.index(checks[0]) :]
    for key in ("4x2", "8x2"):
        assert rep.point_checks(data["points"][key]) == rep.point_checks(plain["points"][key])
    # One invocation's report (no grid): the same rows and line.
    single = {"model": "m", "configs": data["points"]["4x2"]["configs"]}
    modules["grid"].save(path, single)
    assert bench.main(["--report-only", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert any(line.startswith(f"-       {VARIANT} ") for line in out.splitlines())
    assert f"  {VARIANT} vs kvtier_fs: tok/s 1.100x better" in out


def test_plot_draws_variants_in_styles_of_their_own(rep: ModuleType, tmp_path: Path) -> None:
    data = with_variants(synthetic_grid())
    styles = rep.plot_styles(rep.sorted_points(data))
    assert styles["kvtier_fs"] == ("-", "o", "C4")  # the bases keep theirs
    assert styles[VARIANT][:2] == ("-.", "s")
    assert len({styles[c][2] for c in styles}) == len(styles)  # a colour each
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        require.missing("extras", f"matplotlib is not importable: {exc}")
    assert rep.write_plot(data, tmp_path / "grid.png") == tmp_path / "grid.png"
