"""Smoke test of the README's main command: ``python -m kvtier.demo`` end to end, small.

The real demo (three vLLM engines in one fresh Python process) with the tiny model and 12
requests; about half a minute on 2 cores, most of it vLLM's start-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import require

from kvtier.demo import MODELS, build_workload, engine_blocks_for, predict_shares

pytestmark = [
    pytest.mark.e2e,
    require.unless("vllm", require.vllm_missing()),
    pytest.mark.timeout(300),
]

# 3 conversations open, a pool of 96 blocks: by the LRU model, about 13% of the prompt tokens
# come from the host pool and 52% from the fs tier, none from vLLM's own cache.
ARGS = ["--model", "tiny", "--requests", "12", "--concurrency", "3", "--pool-blocks", "96"]


def test_demo_end_to_end(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier.demo", *ARGS, "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=280,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in ("hit ratio", "host pool", "fs", "loaded from kvtier", "prefill", "identical"):
        assert line in proc.stdout, proc.stdout
    result = json.loads((workdir / "results.json").read_text())

    assert result["outputs_identical"] is True
    requests = result["requests"]
    assert list(requests) == [
        "without kvtier",
        "with kvtier",
        "vLLM cache for all",
        "without kvtier, again",
    ]
    outputs = [[r["output"] for r in run] for run in requests.values()]
    assert len(outputs[0]) == 12 and all(len(o) == 1 for o in outputs[0])
    assert all(o == outputs[0] for o in outputs)

    kv = result["kvtier"]
    assert kv["hit_tokens"] > 0 and kv["load_blocks_failed"] == 0
    assert kv["tiers"]["host pool"]["hit_blocks"] > 0
    assert kv["tiers"]["fs"]["hit_blocks"] > 0 and kv["tiers"]["fs"]["read_bytes"] > 0
    assert kv["pool_slots"] == 96
    # Per request: the tokens loaded from kvtier add up to the connector's total.
    assert sum(r["kvtier_tokens"] for r in requests["with kvtier"]) == kv["hit_tokens"]

    # The LRU model the demo prints bounds what kvtier can load (same workload, same caches).
    # With this tiny model requests are faster than the fs tier's writes, so a promotion can
    # find the pool full of blocks pinned by those writes and give up (kvtier never waits):
    # the measured share may fall short of the model, here by a few blocks, not by half.
    workload = build_workload(12, 3, vocab=MODELS["tiny"].vocab_size)
    expected = predict_shares(workload.prompts, engine_blocks_for(workload), 96)
    tokens = result["tokens"]
    assert tokens["prompt"] == workload.prompt_tokens
    share = tokens["loaded_from_kvtier"] / tokens["prompt"]
    assert 0.5 * expected.reusable <= share <= expected.reusable + 0.01
    assert tokens["vllm_cache"] == 0
    # Without kvtier, vLLM's own cache serves nothing of the reuse either: it is all computed.
    assert all(r["engine_cached"] == 0 for r in requests["without kvtier"])
    assert all(r["engine_cached"] == 0 for r in requests["without kvtier, again"])
    # A vLLM cache that keeps everything serves all the reuse the model predicts.
    by_run = tokens["vllm_cache_by_run"]
    assert by_run["vLLM cache for all"] / tokens["prompt"] == pytest.approx(expected.reusable)
