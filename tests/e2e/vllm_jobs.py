"""Prompt sets, kvtier configs and child-process jobs for the vLLM end-to-end tests.

Importable by a fresh interpreter (``vllm_harness.run_in_fresh_process``): no pytest here.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from e2e import vllm_harness as h

CONNECTOR = "KVTierConnector"
MODULE = "kvtier.integrations.vllm"
BLOCK_TOKENS = h.DEFAULT_BLOCK_SIZE
# 2 layers x 32 tokens x 2 KV heads x (2 x 32 head_dim) x 4 bytes (float32), one TP rank.
BLOCK_BYTES = 2 * BLOCK_TOKENS * 2 * 64 * 4

SHARED_PREFIX = h.prompt_tokens(8 * BLOCK_TOKENS, seed=100)  # 8 whole blocks
PROMPT_SETS: dict[str, list[list[int]]] = {
    # 3 prompts of 9 full blocks + 12 tokens.
    "basic": [h.prompt_tokens(300, seed=i) for i in range(3)],
    # the shared prefix alone (stored first), then 4 requests = prefix + own suffix.
    "prefix_only": [SHARED_PREFIX + h.prompt_tokens(20, seed=200)],
    "shared": [SHARED_PREFIX + h.prompt_tokens(40, seed=300 + i) for i in range(4)],
    # long requests for the preemption test.
    "long": [h.prompt_tokens(260, seed=400 + i) for i in range(4)],
}
MAX_TOKENS = {"basic": 8, "prefix_only": 4, "shared": 8, "long": 160}


def kvtier_config(
    stats_path: str | Path,
    *,
    tiers: list[dict[str, Any]] | None = None,
    pool_size: int | str = "64MiB",
    **vllm: Any,
) -> dict[str, Any]:
    return {
        # These tests check that blocks move between tiers and engines; whether a promotion beats
        # computing on a busy 2-core machine is a timing question (tests/cache/test_promotion.py).
        "pool": {"size": pool_size, "promotion_costs": False},
        "tiers": tiers or [],
        "vllm": {"stats_path": str(stats_path), **vllm},
    }


def transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    return h.make_kv_transfer_config(
        CONNECTOR, MODULE, extra_config=extra, kv_load_failure_policy="recompute"
    )


def read_stats(path: str | Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return data


def flush_stats(llm: Any) -> None:
    """Make the scheduler write its stats file now: one more engine step after the interval."""
    time.sleep(1.2)
    h.generate_ids(llm, [[5, 6, 7]], max_tokens=1)


def settle_tier_writes(llm: Any, timeout_s: float = 60.0) -> None:
    """Engine steps until kvtier has no tier job in flight (single-process engine): what was
    stored is on its tiers and the write-through pins are gone. Without it, whether the next
    prompt set's stores find the pool pinned full depends on how fast the write thread ran."""
    cache = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler.cache
    end = time.monotonic() + timeout_s
    while cache.jobs_in_flight:  # finished jobs are collected by the scheduler's next step
        assert time.monotonic() < end, f"tier jobs still in flight after {timeout_s} s"
        time.sleep(0.05)
        h.generate_ids(llm, [[5, 6, 7]], max_tokens=1)


def zero_the_pool(llm: Any) -> None:
    """Overwrite every slot of the engine's kvtier host pool with zeros, through a second
    mapping of it (single-process engine: the scheduler lives in this process)."""
    from kvtier.pool import HostPool

    pool = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler.pool
    other = HostPool.attach(pool.handle)
    try:
        other.array()[:] = 0
    finally:
        other.close()


def run_rounds(
    model_dir: str,
    extra: dict[str, Any],
    sets: list[str],
    multiprocessing: bool,
    reset_first: bool = False,
) -> dict[str, Any]:
    """Child job: one engine with kvtier, generate each prompt set in turn (vLLM's prefix cache
    reset before each but the first, or before every one with ``reset_first``); return the
    outputs and the stats file's content."""
    llm = h.build_llm(
        model_dir,
        kv_transfer_config=transfer_config(extra),
        multiprocessing=multiprocessing,
    )
    outputs: list[list[list[int]]] = []
    try:
        for i, name in enumerate(sets):
            if i or reset_first:
                h.reset_prefix_cache(llm)
            outputs.append(h.generate_ids(llm, PROMPT_SETS[name], max_tokens=MAX_TOKENS[name]))
        flush_stats(llm)
    finally:
        h.shutdown_llm(llm)
    return {"outputs": outputs, "stats": read_stats(extra["vllm"]["stats_path"])}


def shared_pool_config(stats_path: str | Path, shm_dir: str | Path, share: str) -> dict[str, Any]:
    """``kvtier_config`` over the node's shared pool ``share``, its file in ``shm_dir``."""
    extra = kvtier_config(stats_path)
    extra["pool"].update(share=share, shm_dir=str(shm_dir))
    return extra


def serve_shared(
    model_dir: str, extra: dict[str, Any], sets: list[str], hold_dir: str | None = None
) -> dict[str, Any]:
    """Child job: one engine (engine core in this process) over a shared pool generates each
    prompt set in turn (vLLM's prefix cache reset and tier writes settled between them). With
    ``hold_dir`` it then writes ``<hold_dir>/ready`` (the outputs) and keeps the engine, and with
    it the pool, until ``<hold_dir>/release`` exists (at most 300 s). Returns the outputs and the
    stats file as the engine left it at shutdown."""
    llm = h.build_llm(model_dir, kv_transfer_config=transfer_config(extra), multiprocessing=False)
    outputs: list[list[list[int]]] = []
    try:
        for i, name in enumerate(sets):
            if i:
                settle_tier_writes(llm)
                h.reset_prefix_cache(llm)
            outputs.append(h.generate_ids(llm, PROMPT_SETS[name], max_tokens=MAX_TOKENS[name]))
        flush_stats(llm)
        if hold_dir is not None:
            hold = Path(hold_dir)
            (hold / "ready.tmp").write_text(json.dumps(outputs))
            (hold / "ready.tmp").rename(hold / "ready")
            end = time.monotonic() + 300
            while not (hold / "release").exists() and time.monotonic() < end:
                time.sleep(0.2)
    finally:
        h.shutdown_llm(llm)
    return {"outputs": outputs, "stats": read_stats(extra["vllm"]["stats_path"])}
