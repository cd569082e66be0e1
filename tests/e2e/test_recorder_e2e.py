"""The recorder round trip on the demo workload: vLLM (CPU build) with kvtier records its traffic
to ``vllm.trace_path``; ``kvtier simulate --trace`` replays it with the engine's cache (same pool
slots, an fs tier) and predicts the hit ratio the engine reported, within 2 points."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import require

from kvtier.demo import (
    BLOCK_TOKENS,
    MODELS,
    build_workload,
    engine_blocks_for,
    kvtier_config,
    write_model,
)

pytestmark = [
    pytest.mark.e2e,
    require.unless("vllm", require.vllm_missing()),
    pytest.mark.timeout(400),
]

REQUESTS = 32
CONCURRENCY = 3
POOL_BLOCKS = 96


def test_recorded_trace_replays_to_the_engine_hit_ratio(tmp_path: Path) -> None:
    from e2e import vllm_harness as h
    from e2e.vllm_jobs import settle_tier_writes

    size = MODELS["tiny"]
    workload = build_workload(REQUESTS, CONCURRENCY, vocab=size.vocab_size)
    engine_blocks = engine_blocks_for(workload)
    model = write_model(tmp_path / "model", size)
    trace = tmp_path / "traffic.jsonl"
    stats_path = tmp_path / "stats.json"
    # The simulation promotes what a tier holds; the engine's cost rules may decline reads that
    # a 2-core machine under load times as slower than computing: a timing question, not the
    # recorder's.
    extra = kvtier_config(
        tmp_path, POOL_BLOCKS * size.block_bytes, stats_path, promotion_costs=False
    )
    extra["vllm"]["trace_path"] = str(trace)
    llm = h.build_llm(
        model,
        kv_transfer_config=h.make_kv_transfer_config(
            "KVTierConnector", "kvtier.integrations.vllm", extra_config=extra
        ),
        kv_cache_memory_bytes=engine_blocks * size.block_bytes,
        max_model_len=(engine_blocks - 1) * BLOCK_TOKENS,
        max_num_seqs=1,
        multiprocessing=False,
    )
    try:
        for prompt in workload.prompts:  # one at a time, as the demo sends them
            h.generate_ids(llm, [prompt], max_tokens=1)
            # The simulation's writes take no time; the engine's fs tier holds each stored block
            # pinned in the pool until it is written, and a store finding the pool pinned full
            # is skipped (engine 0.644 against 0.670 in one run of the full suite; 0.22-0.64
            # with writes slowed by 30 ms a block).
            settle_tier_writes(llm)
    finally:
        h.shutdown_llm(llm)
    stats = json.loads(stats_path.read_text())
    cache = stats["cache"]
    # The engine's prefix hits: kvtier's, and the blocks vLLM's own cache still held (the
    # simulation has no such cache in front: kvtier would have served those).
    own = stats["connector"]["engine_hit_blocks"]
    engine_ratio = (cache["hit_blocks"] + own) / (cache["lookup_blocks"] + own)

    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len(lines) == REQUESTS
    assert [line["input_length"] for line in lines] == [len(p) for p in workload.prompts]
    assert [len(line["hash_ids"]) for line in lines] == [
        len(p) // BLOCK_TOKENS for p in workload.prompts
    ]
    assert all(line["output_length"] == 1 for line in lines)

    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "simulate",
            "--trace",
            str(trace),
            "--pool-blocks",
            str(stats["pool_slots"]),
            "--tier",
            # The engine's 8 GiB fs tier holds 16,384 of its 512 KiB blocks; simulate counts
            # capacities in blocks of block.bytes (64 MiB): the same 16,384 blocks.
            f"fs:{tmp_path / 'sim-fs'}:1TiB",
            "--json",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    predicted = json.loads(proc.stdout)
    print(
        f"engine hit ratio {engine_ratio:.4f} (kvtier {cache['hit_blocks']} + vLLM {own} of "
        f"{cache['lookup_blocks'] + own} blocks), "
        f"simulate {predicted['hit_ratio']:.4f} "
        f"({predicted['hit_blocks']}/{predicted['blocks']})"
    )
    assert engine_ratio > 0.2  # the workload reuses a lot: a real test of the prediction
    assert abs(predicted["hit_ratio"] - engine_ratio) <= 0.02
