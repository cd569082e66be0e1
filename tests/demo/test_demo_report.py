"""The vLLM demo's report and command line, on made-up runs (no vLLM needed; the end-to-end run
is ``tests/e2e/test_demo_e2e.py``)."""

from __future__ import annotations

import json

import pytest

from kvtier.demo import MODELS, build_workload, predict_shares
from kvtier.demo.__main__ import (
    BASELINE,
    BASELINE_AGAIN,
    IDEAL,
    KVTIER,
    Request,
    Run,
    build_parser,
    report,
)

SIZE = MODELS["tiny"]


def make_runs(n: int, outputs_differ: bool = False) -> list[Run]:
    stats = {
        "cache": {
            "lookup_blocks": 100,
            "hit_blocks": 60,
            "loaded_blocks": 60,
            "stored_blocks": 50,
            "pool_evictions": 4,
        },
        "tiers": {"fs": {"read_bytes": 4096, "write_bytes": 1 << 20}},
        "promoted": {"fs": 20},
        "pool_slots": 128,
        "connector": {"hit_tokens": 320, "load_blocks_failed": 0},
    }

    def run(label: str, seconds: float, cached: int, kvtier: int | None = None) -> Run:
        requests = [Request(seconds, [i, 7], cached, kvtier if i % 2 else 0) for i in range(n)]
        return Run(label, requests, stats if kvtier is not None else None, 1.5, 0.25)

    runs = [
        run(BASELINE, 0.2, 10),
        run(KVTIER, 0.1, 30, kvtier=20),
        run(IDEAL, 0.05, 40),
        run(BASELINE_AGAIN, 0.3, 10),
    ]
    if outputs_differ:
        runs[1].requests[0].output = [99]
    return runs


def test_report_prints_and_returns_the_results(capsys: pytest.CaptureFixture[str]) -> None:
    workload = build_workload(requests=8, concurrency=2, max_turns=3, max_context_blocks=8)
    args = build_parser().parse_args(["--pool-blocks", "16", "--no-fs", "--turns", "3"])
    expected = predict_shares(workload.prompts, 20, 16)
    runs = make_runs(len(workload.turns))
    result = report(workload, expected, runs, SIZE, args)
    out = capsys.readouterr().out
    n = len(workload.turns)
    tokens = workload.prompt_tokens
    assert "host pool       40.0%          40     1.9 MiB     1.6 MiB" in out
    assert f"{tokens} prompt tokens: 320 " in out
    assert f"all {n} requests" in out and f"{n // 2} with kvtier hits" in out
    assert "prefill 60% shorter" in out  # 0.1 s per request against a 0.25 s baseline mean
    assert "differ by 40.0%" in out and "note: the baselines differ a lot" in out
    assert "identical in all four runs: True" in out
    assert result["outputs_identical"] is True
    assert result["baseline_mean_s"] == pytest.approx(0.25 * n)
    assert result["saved"] == pytest.approx(0.6)
    assert result["saved_with_vllm_cache_for_all"] == pytest.approx(0.8)
    assert result["caches"] == {
        "vllm_blocks": result["caches"]["vllm_blocks"],
        "vllm_blocks_for_all": result["caches"]["vllm_blocks_for_all"],
        "pool_blocks": 16,
        "eviction": args.eviction,
        "fs_tier": False,
    }
    assert result["tokens"] == {
        "prompt": tokens,
        "loaded_from_kvtier": 320,
        "computed": tokens - 30 * n,
        "vllm_cache": 30 * n - 320,
        "vllm_cache_by_run": {
            BASELINE: 10 * n,
            KVTIER: 30 * n,
            IDEAL: 40 * n,
            BASELINE_AGAIN: 10 * n,
        },
    }
    timing = result["timing"][KVTIER]
    assert timing["engine_start_s"] == 1.5 and timing["warmup_s"] == 0.25
    assert timing["kvtier_hits"]["requests"] == n // 2
    assert timing["all"]["total_s"] == pytest.approx(0.1 * n)
    assert timing["no_kvtier_hits"]["median_ms"] == pytest.approx(100.0)
    assert result["workload"]["max_turns"] == 3 and len(result["workload"]["turns"]) == n
    assert len(result["requests"][IDEAL]) == n
    json.dumps(result)  # JSON-able


def test_report_says_when_outputs_differ(capsys: pytest.CaptureFixture[str]) -> None:
    workload = build_workload(requests=8, concurrency=2, max_turns=3, max_context_blocks=8)
    args = build_parser().parse_args([])
    result = report(
        workload, predict_shares(workload.prompts, 20, 16), make_runs(8, True), SIZE, args
    )
    assert result["outputs_identical"] is False
    assert "identical in all four runs: False" in capsys.readouterr().out


def test_command_line_defaults_and_choices() -> None:
    args = build_parser().parse_args([])
    assert (args.requests, args.concurrency, args.turns, args.context_blocks) == (64, 4, 4, 40)
    assert (args.model, args.pool_blocks, args.no_fs, args.json) == ("demo", 128, False, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--model", "huge"])
