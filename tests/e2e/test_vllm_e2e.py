"""End to end: kvtier as vLLM's KV connector, real vLLM (CPU build), tiny random-weight Llama.

Every case compares greedy outputs with the no-kvtier reference (``conftest.reference``) and
reads kvtier's stats from the ``vllm.stats_path`` file. Engines run in vLLM's single-process
mode for speed, except the warm-restart case, which runs vLLM's default multi-process mode in a
fresh Python process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
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


def _engine(model_dir: Path, extra: dict[str, Any], **kwargs: Any) -> Any:
    return h.build_llm(
        model_dir, kv_transfer_config=jobs.transfer_config(extra), multiprocessing=False, **kwargs
    )


def _core(llm: Any) -> Any:
    """The in-process EngineCore (single-process mode only)."""
    return llm.llm_engine.engine_core.engine_core


def _gen(llm: Any, name: str) -> list[list[int]]:
    return h.generate_ids(llm, jobs.PROMPT_SETS[name], max_tokens=jobs.MAX_TOKENS[name])


def _compute_and_store(
    model_dir: Path, reference: Ref, tmp_path: Path, fs_tier: dict[str, Any], name: str
) -> None:
    """An engine in this process generates prompt set ``name`` (checked against the reference)
    and stores its KV through ``fs_tier``; then it is shut down."""
    llm = _engine(model_dir, jobs.kvtier_config(tmp_path / "stats1.json", tiers=[fs_tier]))
    try:
        assert _gen(llm, name) == reference[name]
    finally:
        h.shutdown_llm(llm)


@pytest.fixture
def fs_tier(tmp_path: Path) -> Iterator[dict[str, Any]]:
    yield {"kind": "fs", "path": str(tmp_path / "fs"), "capacity": "256MiB"}


def test_a_identical_outputs_with_hits(model_dir: Path, reference: Ref, tmp_path: Path) -> None:
    stats_path = tmp_path / "stats.json"
    llm = _engine(model_dir, jobs.kvtier_config(stats_path))
    try:
        first = _gen(llm, "basic")
        assert h.reset_prefix_cache(llm)
        second = _gen(llm, "basic")
    finally:
        h.shutdown_llm(llm)
    assert first == reference["basic"]
    assert second == reference["basic"]
    stats = jobs.read_stats(stats_path)
    assert stats["cache"]["hit_blocks"] >= 27, stats["cache"]
    assert stats["cache"]["loaded_blocks"] >= 27, stats["cache"]
    assert stats["connector"]["hit_tokens"] >= 27 * jobs.BLOCK_TOKENS, stats["connector"]
    assert stats["pool_pinned"] == 0 and stats["jobs_in_flight"] == 0


def test_a_connector_reset_makes_the_next_round_compute_again(
    model_dir: Path, reference: Ref, tmp_path: Path
) -> None:
    """``reset_prefix_cache(reset_connector=True)``, as after a weight update: before, kvtier had
    no ``reset_cache`` and the round after it loaded the blocks stored before."""
    stats_path = tmp_path / "stats.json"
    llm = _engine(model_dir, jobs.kvtier_config(stats_path))
    try:
        rounds = [_gen(llm, "basic")]
        assert h.reset_prefix_cache(llm, reset_connector=True)
        rounds.append(_gen(llm, "basic"))  # computed again, stored in the new generation
        assert h.reset_prefix_cache(llm)
        rounds.append(_gen(llm, "basic"))  # the new generation's blocks load
    finally:
        h.shutdown_llm(llm)
    assert rounds == [reference["basic"]] * 3
    stats = jobs.read_stats(stats_path)
    assert stats["connector"]["resets"] == 1
    stored, loaded = stats["cache"]["stored_blocks"], stats["cache"]["loaded_blocks"]
    assert loaded >= 27 and stored >= 2 * loaded, stats["cache"]  # without the reset: 1x


def test_b_warm_restart_multiprocess(
    model_dir: Path, reference: Ref, tmp_path: Path, fs_tier: dict[str, Any]
) -> None:
    # Process 1 (this one, single-process engine): compute and store into the fs tier.
    _compute_and_store(model_dir, reference, tmp_path, fs_tier, "basic")
    assert list(Path(fs_tier["path"]).rglob("*.kvb")), "nothing written to the fs tier"
    # Process 2: a new Python process, vLLM's default multi-process mode, empty host pool.
    extra = jobs.kvtier_config(tmp_path / "stats2.json", tiers=[fs_tier])
    result = h.run_in_fresh_process(
        "e2e.vllm_jobs:run_rounds", str(model_dir), extra, ["basic"], True, timeout=200
    )
    assert result["outputs"][0] == reference["basic"]
    cache = result["stats"]["cache"]
    assert cache["promoted_blocks"] >= 27, cache
    assert cache["loaded_blocks"] >= 27, cache


def test_c_shared_prefix_loaded_once(
    model_dir: Path, reference: Ref, tmp_path: Path, fs_tier: dict[str, Any]
) -> None:
    # Engine 1 stores the shared prefix in the fs tier; engine 2 starts with an empty pool, so
    # its lookups go pending while the prefix is promoted, and 4 concurrent requests share it.
    _compute_and_store(model_dir, reference, tmp_path, fs_tier, "prefix_only")
    stats_path = tmp_path / "stats2.json"
    llm = _engine(model_dir, jobs.kvtier_config(stats_path, tiers=[fs_tier]))
    try:
        out = _gen(llm, "shared")
    finally:
        h.shutdown_llm(llm)
    assert out == reference["shared"]
    stats = jobs.read_stats(stats_path)
    cache, conn = stats["cache"], stats["connector"]
    shared_blocks = len(jobs.SHARED_PREFIX) // jobs.BLOCK_TOKENS
    assert cache["loaded_blocks"] == shared_blocks, (cache, conn)
    assert cache["pending_lookups"] > 0 or conn["deferred_lookups"] > 0, (cache, conn)
    # The first request waits for the promotion; the three asked after it in that pass wait
    # behind it (``vllm.keep_order``) instead of being scheduled ahead of it.
    assert conn["lookups_held_in_order"] >= 3, conn


def test_d_tier_failures_and_corrupt_files(
    model_dir: Path, reference: Ref, tmp_path: Path, fs_tier: dict[str, Any]
) -> None:
    # 1. A flaky memory tier (writes and reads fail or come back corrupt) behind a small pool.
    flaky = {"kind": "memory", "failure_rate": 0.3, "corrupt_rate": 0.4, "seed": 7}
    stats1 = tmp_path / "stats1.json"
    extra = jobs.kvtier_config(stats1, tiers=[flaky], pool_size=4 * jobs.BLOCK_BYTES)
    llm = _engine(model_dir, extra)
    try:
        rounds = [_gen(llm, "basic")]
        for _ in range(2):
            h.reset_prefix_cache(llm)
            rounds.append(_gen(llm, "basic"))
    finally:
        h.shutdown_llm(llm)
    assert all(r == reference["basic"] for r in rounds)
    stats = jobs.read_stats(stats1)
    tier = stats["tiers"]["memory"]
    assert tier["errors"] + tier["corrupt"] > 0, tier
    assert stats["cache"]["cascade_failures"] + stats["cache"]["promotion_failures"] > 0

    # 2. Every worker-side load fails: vLLM recomputes (kv_load_failure_policy=recompute).
    stats2 = tmp_path / "stats2.json"
    os.environ["KVTIER_TEST_FAIL_LOADS"] = "1.0"
    try:
        llm = _engine(model_dir, jobs.kvtier_config(stats2, tiers=[fs_tier]))
    finally:
        del os.environ["KVTIER_TEST_FAIL_LOADS"]
    try:
        first = _gen(llm, "basic")
        h.reset_prefix_cache(llm)
        second = _gen(llm, "basic")
    finally:
        h.shutdown_llm(llm)
    assert first == reference["basic"] and second == reference["basic"]
    stats = jobs.read_stats(stats2)
    assert stats["connector"]["load_blocks_failed"] >= 27, stats["connector"]

    # 3. Flip a byte in every file of the fs tier, then a fresh engine promotes from it.
    files = list(Path(fs_tier["path"]).rglob("*.kvb"))
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))
    stats3 = tmp_path / "stats3.json"
    llm = _engine(model_dir, jobs.kvtier_config(stats3, tiers=[fs_tier]))
    try:
        out = _gen(llm, "basic")
    finally:
        h.shutdown_llm(llm)
    assert out == reference["basic"]
    stats = jobs.read_stats(stats3)
    assert stats["tiers"]["fs"]["corrupt"] > 0, stats["tiers"]
    assert stats["cache"]["loaded_blocks"] == 0, stats["cache"]


def test_e_pool_smaller_than_working_set(model_dir: Path, reference: Ref, tmp_path: Path) -> None:
    # 12 slots; each prompt stores 9 blocks in its prefill step, 27 in all: the second prompt
    # already needs evictions. Prompts go one at a time so each one's stores have settled.
    stats_path = tmp_path / "stats.json"
    llm = _engine(model_dir, jobs.kvtier_config(stats_path, pool_size=12 * jobs.BLOCK_BYTES))
    prompts = jobs.PROMPT_SETS["basic"]
    try:
        rounds = []
        for _ in range(2):
            h.reset_prefix_cache(llm)
            rounds.append([h.generate_ids(llm, [p], max_tokens=8)[0] for p in prompts])
    finally:
        h.shutdown_llm(llm)
    assert all(r == reference["basic"] for r in rounds)
    stats = jobs.read_stats(stats_path)
    assert stats["pool_slots"] == 12
    assert stats["cache"]["pool_evictions"] > 0, stats["cache"]
    assert stats["pool_used"] <= 12 and stats["pool_pinned"] == 0


def test_f_preempt_and_abort_leak_nothing(model_dir: Path, reference: Ref, tmp_path: Path) -> None:
    stats_path = tmp_path / "stats.json"
    # 28 engine blocks of KV cache; 4 requests of up to 420 tokens (14 blocks) each: preemption.
    llm = _engine(
        model_dir,
        jobs.kvtier_config(stats_path),
        kv_cache_memory_bytes=28 * jobs.BLOCK_BYTES,
        max_model_len=512,
    )
    try:
        core = _core(llm)
        scheduler = core.scheduler
        preemptions = []
        original = scheduler._preempt_request

        def counting(request: Any, *args: Any, **kwargs: Any) -> Any:
            preemptions.append(request.request_id)
            return original(request, *args, **kwargs)

        scheduler._preempt_request = counting
        out = _gen(llm, "long")
        assert preemptions, "no request was preempted: make the KV cache smaller"
        assert out == reference["long"]

        # Abort one request mid-run through the engine's step loop.
        from vllm.inputs import TokensPrompt

        engine = llm.llm_engine
        h.reset_prefix_cache(llm)
        ids = [
            engine.add_request(
                f"abort-{i}",
                TokensPrompt(prompt_token_ids=p),
                h.greedy_params(jobs.MAX_TOKENS["long"]),
            )
            for i, p in enumerate(jobs.PROMPT_SETS["long"][:2])
        ]
        for _ in range(3):
            engine.step()
        engine.abort_request(["abort-0"])
        finished = {}
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            for o in engine.step():
                if o.finished:
                    finished[o.request_id] = list(o.outputs[0].token_ids)
        assert not engine.has_unfinished_requests()
        assert len(ids) == 2
        assert "abort-0" not in finished, "the abort came too late"
        assert finished.get("abort-1") == reference["long"][1]
        side = scheduler.connector._scheduler
        live = side.stats()
    finally:
        h.shutdown_llm(llm)
    assert live["pool_pinned"] == 0, live
    assert live["jobs_in_flight"] == 0 and live["pinned_plans"] == 0, live
    cache = live["cache"]
    assert live["pool_used"] == cache["stored_blocks"], live
    assert cache["pool_evictions"] == 0
    file_stats = jobs.read_stats(stats_path)
    assert file_stats["pool_pinned"] == 0 and file_stats["pinned_plans"] == 0


def test_sensitivity_poisoned_pool_changes_outputs(
    model_dir: Path, reference: Ref, tmp_path: Path
) -> None:
    """Wrong KV in the pool must change the outputs, else the cases above prove nothing."""
    stats_path = tmp_path / "stats.json"
    llm = _engine(model_dir, jobs.kvtier_config(stats_path))
    try:
        assert _gen(llm, "basic") == reference["basic"]
        jobs.zero_the_pool(llm)
        assert h.reset_prefix_cache(llm)
        poisoned = _gen(llm, "basic")
    finally:
        h.shutdown_llm(llm)
    stats = jobs.read_stats(stats_path)
    assert stats["cache"]["loaded_blocks"] >= 27
    assert all(p != r for p, r in zip(poisoned, reference["basic"], strict=True)), poisoned


def test_an_engine_may_capture_cuda_graphs_after_another_engine_in_this_process() -> None:
    """vLLM 0.25.1's first model runner leaves the process-wide capture flag off after its
    capture; the harness turns it back on before each GPU engine (the H100 hybrid tests start a
    Gemma-3 engine, on vLLM's second runner, after Nemotron-H engines in one process)."""
    from vllm.compilation import monitor

    monitor.set_cudagraph_capturing_enabled(False)
    try:
        h.allow_cuda_graph_capture()
        monitor.validate_cudagraph_capturing_enabled()
    finally:
        monitor.set_cudagraph_capturing_enabled(True)
