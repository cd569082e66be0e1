"""End to end, ``vllm.async_loads``: loads go through vLLM's asynchronous path (the request waits
for its KV while others run). Real vLLM (CPU build), tiny random-weight Llama, single-process
engines; outputs compared with the no-kvtier reference (``conftest.reference``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support import require

pytestmark = [
    pytest.mark.e2e,
    require.unless("vllm", require.vllm_missing()),
    pytest.mark.timeout(240),
]

if require.vllm_missing() is None:
    from e2e import vllm_harness as h
    from e2e import vllm_jobs as jobs

Ref = dict[str, list[list[int]]]


def _engine(model_dir: Path, stats: Path, **pool: Any) -> Any:
    extra = jobs.kvtier_config(stats, async_loads=True, **pool)
    return h.build_llm(
        model_dir, kv_transfer_config=jobs.transfer_config(extra), multiprocessing=False
    )


def _gen(llm: Any, name: str) -> list[list[int]]:
    return h.generate_ids(llm, jobs.PROMPT_SETS[name], max_tokens=jobs.MAX_TOKENS[name])


def test_asynchronous_loads_give_identical_outputs(
    model_dir: Path, reference: Ref, tmp_path: Path
) -> None:
    stats_path = tmp_path / "stats.json"
    llm = _engine(model_dir, stats_path)
    try:
        first = _gen(llm, "basic")
        assert h.reset_prefix_cache(llm)
        second = _gen(llm, "basic")
        assert h.reset_prefix_cache(llm)
        shared = _gen(llm, "shared")
    finally:
        h.shutdown_llm(llm)
    assert first == reference["basic"] and second == reference["basic"]
    assert shared == reference["shared"]
    stats = jobs.read_stats(stats_path)
    assert stats["cache"]["loaded_blocks"] >= 27, stats["cache"]
    assert stats["connector"]["hit_tokens"] >= 27 * jobs.BLOCK_TOKENS, stats["connector"]
    assert stats["pool_pinned"] == 0 and stats["jobs_in_flight"] == 0


def test_failed_asynchronous_loads_are_recomputed(
    model_dir: Path, reference: Ref, tmp_path: Path
) -> None:
    stats_path = tmp_path / "stats.json"
    os.environ["KVTIER_TEST_FAIL_LOADS"] = "1.0"
    try:
        llm = _engine(model_dir, stats_path)
    finally:
        del os.environ["KVTIER_TEST_FAIL_LOADS"]
    try:
        first = _gen(llm, "basic")
        h.reset_prefix_cache(llm)
        second = _gen(llm, "basic")
    finally:
        h.shutdown_llm(llm)
    assert first == reference["basic"] and second == reference["basic"]
    stats = jobs.read_stats(stats_path)
    assert stats["connector"]["load_blocks_failed"] >= 27, stats["connector"]
    assert stats["pool_pinned"] == 0 and stats["jobs_in_flight"] == 0
