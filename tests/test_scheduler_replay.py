"""``benchmarks/scheduler_replay.py``: the grid's requests through vLLM's real scheduler on a
simulated clock. Its parsing, cost model and verdicts (no vLLM needed), and one tiny point in the
installed vLLM (the CPU build) whose figures follow from the workload exactly."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from support import require
from support.scripts import benchmark_modules


@pytest.fixture(scope="module")
def sr() -> Iterator[ModuleType]:
    with benchmark_modules("scheduler_replay") as (module,):
        yield module


@pytest.fixture(scope="module")
def engine_mod(sr: ModuleType) -> ModuleType:
    import scheduler_replay_engine

    return scheduler_replay_engine


def _row(p50: float, p90: float, p99: float, tok_s: float, cached: int) -> dict[str, Any]:
    return {
        "ttft_ms": {"50": p50, "90": p90, "99": p99},
        "output_tokens_per_s": tok_s,
        "prompt_tokens_cached": cached,
    }


def test_configs_parse_into_a_connector_and_kvtier_keys(sr: ModuleType) -> None:
    spec = sr.parse_config("kvtier+vllm.load_mode=async+eviction=lru+pool.x=3")
    assert (spec.kind, spec.measured_as) == ("kvtier", "kvtier")
    assert spec.overrides == {"vllm.load_mode": "async", "eviction": "lru", "pool.x": 3}
    extra = sr.kvtier_extra(1 << 20, spec.overrides)
    assert extra["pool"] == {"size": 1 << 20, "x": 3}
    assert extra["vllm"] == {"load_mode": "async"}
    assert extra["eviction"] == "lru" and extra["tiers"] == []
    assert sr.parse_config("native").overrides == {}
    for bad in ("lmcache", "native+x=1", "kvtier+novalue"):
        with pytest.raises(ValueError, match="config"):
            sr.parse_config(bad)


def test_cost_model_and_its_overrides(engine_mod: ModuleType) -> None:
    cost = engine_mod.parse_cost("base_ms=5,load_gate=0")
    assert cost.base_ms == 5.0 and cost.load_gate is False
    assert engine_mod.parse_cost("").load_gate is True
    # A 2 MiB block at 45 GB/s: 46.6 us.
    assert cost.block_ms(45.0) == pytest.approx(2 * 2**20 / 45e9 * 1e3)
    alone = cost.forward_ms([], 0)
    assert alone == 5.0
    # The same tokens cost more behind a longer context.
    assert cost.forward_ms([(1000, 4000)], 0) > cost.forward_ms([(1000, 0)], 0) > alone
    with pytest.raises(ValueError, match="FIELD=NUMBER"):
        engine_mod.parse_cost("warp=9")


def test_machine_waits_for_synchronous_loads_behind_the_gpu(engine_mod: ModuleType) -> None:
    m = engine_mod.Machine(engine_mod.Cost())
    m.gpu_free = 50.0  # a forward pass queued before the load
    end = m.load(1, 100, None, gated=True)
    assert end == pytest.approx(50.0 + 100 * m.cost.block_ms(m.cost.h2d_gbps))
    m.wait_until(end)
    assert m.cpu == end and m.sync_wait_ms == end
    ungated = engine_mod.Machine(engine_mod.Cost())
    ungated.gpu_free = 50.0
    assert ungated.load(1, 100, "r", gated=False) < 50.0
    ungated.cpu = 10.0
    assert [j.request_id for j in ungated.ended()] == ["r"] and not ungated.jobs


def test_a_warm_up_vllm_will_not_reset_after_stops_the_replay(
    engine_mod: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The timed run must start from an empty vLLM prefix cache, as on the GPU."""

    class Scheduler:
        def __init__(self) -> None:
            self.added: list[str] = []

        def add_request(self, request: str) -> None:
            self.added.append(request)

        def reset_prefix_cache(self) -> bool:
            return False  # requests still hold blocks

    loop = SimpleNamespace(
        engine=SimpleNamespace(scheduler=Scheduler()),
        m=engine_mod.Machine(engine_mod.Cost()),
        busy=False,
        request_waits={"warmup-a0": {}},
    )
    monkeypatch.setattr(engine_mod.rv, "sampling_params", lambda tokens: tokens)
    monkeypatch.setattr(engine_mod.rv, "make_request", lambda _e, req_id, *_a: req_id)
    with pytest.raises(RuntimeError, match="refused to reset its prefix cache"):
        engine_mod.warm_up(loop, [[1, 2], [3]], [1, 2, 9], 4)
    assert loop.engine.scheduler.added == ["warmup-a0", "warmup-a1"]


def test_hold_parses_every_and_milliseconds(sr: ModuleType) -> None:
    assert sr.parse_hold("12:9000") == (12, 9000.0)
    assert sr.parse_hold("") is None
    for bad in ("12", "0:100", "x:1", "3:-1"):
        with pytest.raises(ValueError, match="EVERY:MS"):
            sr.parse_hold(bad)


def test_against_native_ties_within_three_percent(sr: ModuleType) -> None:
    native = _row(200, 600, 1000, 300.0, 100_000)
    ok, cells = sr.against_native(_row(205, 590, 1000, 295.0, 98_000), native)
    assert ok and cells[0] == "TTFT p50 1.025x tie" and cells[1].endswith("better")
    ok, cells = sr.against_native(_row(210, 600, 1000, 300.0, 100_000), native)
    assert not ok and cells[0] == "TTFT p50 1.050x worse"
    ok, _ = sr.against_native(_row(200, 600, 1000, 300.0, 96_000), native)
    assert not ok  # 4% fewer cached tokens


def test_hook_timer_sums_a_steps_hooks_once_each_wall_and_cpu(sr: ModuleType) -> None:
    class Connector:
        def get_num_new_matched_tokens(self) -> int:
            return self.update_state_after_alloc()  # nested: counted in the outer call

        def update_state_after_alloc(self) -> int:
            sum(range(20_000))
            return 1

        def build_connector_meta(self) -> str:
            return "meta"

    connector = Connector()
    clock = sr.eng.HookTimer(connector, enabled=True)
    assert sr.eng.connector_figures(clock) == {}
    for _ in range(3):
        assert connector.get_num_new_matched_tokens() == 1
        assert connector.build_connector_meta() == "meta"
    connector.update_state_after_alloc()  # a step not yet ended is not counted
    assert len(clock.cpu_steps) == len(clock.steps) == 3
    assert all(
        0 < cpu <= wall * 1.5 for cpu, wall in zip(clock.cpu_steps, clock.steps, strict=True)
    )
    figures = sr.eng.connector_figures(clock)
    assert figures["connector_step_us"]["steps"] == 3
    assert set(figures["connector_step_cpu_us"]) == {"p50", "p90", "p99", "mean", "steps"}
    rows = {"native": figures, "kvtier": {"connector_step_cpu_us": {"p50": 1.0, "p99": 2.0}}}
    rows["native"]["connector_step_cpu_us"].update(p50=2.0, p99=2.0)
    assert sr.connector_lines(rows)[1].endswith("(0.50x / 1.00x native)")


def test_correlation_pairs_requests_by_id(sr: ModuleType) -> None:
    def rows(ttfts: dict[str, float]) -> dict[str, Any]:
        fields = ["id", "ttft_ms", "prompt_tokens", "cached_tokens", "output_digest"]
        return {
            "per_request": {"fields": fields, "rows": [[k, v, 1, 0, ""] for k, v in ttfts.items()]}
        }

    ours = rows({"a": 1.0, "b": 2.0, "c": 3.0, "d": 9.0})
    assert sr.correlation(ours, rows({"c": 30.0, "a": 10.0, "b": 20.0})) == pytest.approx(1.0)
    assert sr.correlation(ours, rows({"a": 3.0, "b": 2.0, "c": 1.0})) == pytest.approx(-1.0)
    assert sr.correlation(ours, rows({"a": 1.0, "b": 2.0})) is None
    assert sr.correlation(ours, None) is None


# -- one tiny point in the installed vLLM ---------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(sr: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Any:
    reason = require.vllm_missing()
    if reason is not None:
        require.missing("vllm", reason)
    import scheduler_replay_vllm as rv
    import vllm_bench_engine as eng
    from scheduler_replay_engine import Cost

    rv.use_vllm(None)
    workdir = tmp_path_factory.mktemp("replay")

    def run(
        config: str,
        gpu_kv_gib: float,
        host_gib: float = 1.0,
        hold: Any = None,
        warmup: bool = False,
    ) -> tuple[Any, Any]:
        settings = eng.Settings(
            turns=3,
            context_blocks=6,
            widen=2,
            max_tokens=4,
            max_model_len=4096,
            gpu_kv_gib=gpu_kv_gib,
            workdir=workdir,
        )
        point = sr.Point(f"2x{host_gib:g}", 2, host_gib, 8)
        spec = sr.parse_config(config)
        return sr.run_config(point, spec, settings, Cost(), workdir, hold, warmup=warmup)

    run.workdir = workdir  # type: ignore[attr-defined]
    return run


BLOCK_GIB = 16 * 128 * 1024 / (1 << 30)
"""A block of 16 tokens of Llama-3.1-8B (128 KiB a token)."""
GPU_ROOMY = 256 * BLOCK_GIB
"""The whole tiny workload (166 blocks) fits."""
GPU_TIGHT = 64 * BLOCK_GIB
"""Holds the two requests in flight (51 blocks at most each) and little more: a conversation's
earlier turns are evicted from the GPU before its next turn. The 1 GiB host pool (512 blocks
at the replay's scale) holds them all."""


@require.unless("vllm", require.vllm_missing())
def test_vllm_alone_caches_exactly_what_the_workload_reuses(tiny: Any) -> None:
    row, summary = tiny("none", GPU_ROOMY)
    assert summary["reusable_prompt_tokens"] > 0
    assert row["prompt_tokens_cached"] == summary["reusable_prompt_tokens"]
    assert row["requests"] == summary["requests"] == 8
    assert row["external_tokens"] == 0 and row["sync_load_wait_ms"] == 0
    tight, _ = tiny("none", GPU_TIGHT)
    assert tight["prompt_tokens_cached"] < summary["reusable_prompt_tokens"]


@require.unless("vllm", require.vllm_missing())
def test_the_warm_up_runs_first_and_only_its_blocks_stay(tiny: Any) -> None:
    """``--warmup``: the GPU benchmark's warm-up before the timed run. vLLM's prefix cache is
    reset after it (the timed run's figures are as without), kvtier's pool keeps its blocks."""
    plain, summary = tiny("none", GPU_ROOMY)
    warmed, _ = tiny("none", GPU_ROOMY, warmup=True)
    assert warmed["requests"] == plain["requests"] == 8
    assert warmed["prompt_tokens_cached"] == summary["reusable_prompt_tokens"]
    assert warmed["wall_s"] == plain["wall_s"] and warmed["steps"] == plain["steps"]
    cold, _ = tiny("kvtier", GPU_TIGHT)
    warm, _ = tiny("kvtier", GPU_TIGHT, warmup=True)
    # Three prompts of 4 to 6 blocks and one sent again: at least 12 blocks more stored.
    assert warm["kvtier"]["stored_blocks"] >= cold["kvtier"]["stored_blocks"] + 12
    assert warm["requests"] == 8


@require.unless("vllm", require.vllm_missing())
@pytest.mark.parametrize("mode", ["", "+vllm.async_loads=true", "+vllm.async_loads=auto"])
def test_kvtier_loads_what_the_gpu_lost(tiny: Any, mode: str) -> None:
    _, summary = tiny("none", GPU_ROOMY)
    row, _ = tiny("kvtier" + mode, GPU_TIGHT)
    kv = row["kvtier"]
    # The pool holds every block: with the GPU's cache it serves all the workload reuses.
    assert row["prompt_tokens_cached"] == summary["reusable_prompt_tokens"]
    assert row["external_tokens"] > 0
    # kvtier's hits are what vLLM counted as external, and each was loaded.
    assert kv["hit_tokens"] == row["external_tokens"]
    assert kv["loaded_blocks"] * 16 >= kv["hit_tokens"] and kv["load_failed"] == 0
    if mode == "":
        assert row["sync_load_wait_ms"] > 0
    elif mode.endswith("true"):
        assert row["sync_load_wait_ms"] == 0


@require.unless("vllm", require.vllm_missing())
def test_waits_by_cause_and_held_requests(tiny: Any, engine_mod: ModuleType) -> None:
    row, _ = tiny("none", GPU_TIGHT)
    waits = row["queue_wait_ms"]
    assert set(waits) == set(engine_mod.WAIT_KINDS) and row["held_requests"] == 0
    # Two requests in flight that the GPU cache holds one at a time: one waits first in line.
    assert waits["first_waiting"] > 0
    ttfts = [r[1] for r in row["per_request"]["rows"]]
    assert max(ttfts) < 500
    held, _ = tiny("none", GPU_ROOMY, hold=(2, 500.0))
    # Every second request sent, if a later turn, reaches vLLM 500 ms late (TTFT from sending).
    n = held["held_requests"]
    assert n > 0 and sum(r[1] >= 500 for r in held["per_request"]["rows"]) == n
    assert all(r[0].rsplit(".t", 1)[1] != "1" for r in held["per_request"]["rows"] if r[1] >= 500)


@require.unless("vllm", require.vllm_missing())
def test_a_kvtier_fs_run_leaves_no_tier_files_behind(tiny: Any) -> None:
    row, _ = tiny("kvtier_fs", GPU_TIGHT)
    assert row["kvtier"]["tier_write_blocks"] > 0  # the fs tier was written to
    assert not list(tiny.workdir.glob("fs-*"))
