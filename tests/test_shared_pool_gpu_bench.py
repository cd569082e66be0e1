"""``benchmarks/shared_pool_gpu_bench.py``: its summary (no vLLM needed) and its CPU smoke run
(``--model tiny``: two engines of vLLM's CPU build in their own processes share a pool, then
vLLM alone)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from support import require
from support.scripts import REPO, benchmark_modules

BENCH = REPO / "benchmarks" / "shared_pool_gpu_bench.py"


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with benchmark_modules("shared_pool_gpu_bench") as (module,):
        yield module


def test_summary_compares_b_hit_with_a_reload_and_checks_first_tokens(bench: ModuleType) -> None:
    M = bench.Measure
    rows = [
        M("a_compute", 0, 900.0, 0, 0, 7),
        M("b_hit", 0, 150.0, 8176, 511, 7),
        M("a_reload", 0, 120.0, 8176, 0, 7),
        M("b_recompute", 0, 880.0, 0, 0, 9),
        M("alone", 0, 800.0, None, None, 9),
        M("a_compute", 1, 910.0, 0, 0, 5),
        M("b_hit", 1, 170.0, 8176, 511, 5),
        M("a_reload", 1, 100.0, 8176, 0, 5),
    ]
    s = bench.summarize(rows)
    assert s["kinds"]["b_hit"]["ttft_ms_median"] == 160.0
    assert s["b_hit_over_a_reload"] == round(160 / 110, 3) and s["within_1_5x"] is True
    assert s["alone_over_b_hit"] == 5.0 and s["b_recompute_over_b_hit"] == 5.5
    assert s["first_tokens_agree"] is True
    assert "b_hit" in bench.table(s) and "b_hit_over_a_reload: 1.455" in bench.table(s)
    rows.append(M("b_hit", 1, 400.0, 8176, 511, 6))  # another first token than A computed
    s = bench.summarize(rows)
    assert s["first_tokens_agree"] is False and s["within_1_5x"] is False


@require.unless("vllm", require.vllm_missing())
@pytest.mark.timeout(420)
def test_tiny_smoke_run_in_vllm_cpu(tmp_path: Path) -> None:
    shm, out = tmp_path / "shm", tmp_path / "x.json"
    shm.mkdir()
    cmd = [sys.executable, str(BENCH), "--model", "tiny", "--prefix-tokens", "256"]
    cmd += ["--repeat", "1", "--shm-dir", str(shm), "--json", str(out)]
    cmd += ["--workdir", str(tmp_path / "work")]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "b_hit_over_a_reload" in proc.stdout
    data = json.loads(out.read_text())
    kinds = data["summary"]["kinds"]
    assert set(kinds) == {"a_compute", "b_hit", "a_reload", "b_recompute", "alone"}
    blocks = 256 // 32 - 1  # vLLM computes the last block's last token: 7 whole blocks load
    assert kinds["a_compute"]["loaded_tokens"] == [0]
    assert kinds["b_hit"]["loaded_tokens"] == [blocks * 32]
    assert kinds["b_hit"]["hits_others"] == [blocks]  # every loaded block was A's
    assert kinds["a_reload"]["loaded_tokens"] == [blocks * 32]
    assert kinds["a_reload"]["hits_others"] == [0]
    assert kinds["b_recompute"]["loaded_tokens"] == [0]
    assert data["summary"]["first_tokens_agree"] is True
    assert data["shares"]["b"]["hits_others"] >= blocks and data["shares"]["a"]["stored"] > 0
    assert len(data["pool_file"]) == 1 and data["pool_files_left"] == []
    assert list(shm.iterdir()) == []
