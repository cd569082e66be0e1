"""End to end with tensor parallelism: kvtier under a real vLLM CPU engine with
``tensor_parallel_size=2``.

The tiny Llama has 2 KV heads, so each rank holds one; each rank runs in its own worker process
(vLLM's multiprocessing executor) while the engine core, and with it kvtier's scheduler half and
host pool, stays in this process. The reference is the same TP=2 engine without kvtier (not the
TP=1 reference of the other tests: a different reduction order may change greedy outputs).
One kvtier engine then runs four rounds of the same prompts, vLLM's prefix cache reset between
rounds so every kvtier block is loaded from the pool:

1. cold: outputs identical, every block stored;
2. warm: outputs identical, every block a kvtier hit, loaded on both ranks;
3. rank 1 fails every load (rank 0 does not): every load job fails, vLLM recomputes, outputs
   identical;
4. the two rank parts of each stored slot swapped: outputs change (so rounds 2-3 prove the
   ranks load their own parts).

Between rounds 1 and 2 the pool is read directly: each stored slot has both parts written, and
they differ.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import require

pytestmark = [
    pytest.mark.e2e,
    require.unless("vllm", require.vllm_missing()),
    pytest.mark.timeout(300),
]

if require.vllm_missing() is None:
    from e2e import vllm_harness as h
    from e2e import vllm_jobs as jobs

TP = 2
PROMPTS = "basic"  # 3 prompts of 9 whole kvtier blocks + 12 tokens
BLOCKS = 27


def _generate(llm: Any) -> list[list[int]]:
    return h.generate_ids(llm, jobs.PROMPT_SETS[PROMPTS], max_tokens=jobs.MAX_TOKENS[PROMPTS])


def _connector(llm: Any) -> Any:
    """The scheduler-role KVTierConnector (the engine core runs in this process)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def _live_stats(llm: Any) -> dict[str, Any]:
    data: dict[str, Any] = _connector(llm).stats_snapshot()
    return data


@pytest.fixture(scope="module")
def tp_reference(model_dir: Path) -> Iterator[list[list[int]]]:
    llm = h.build_llm(model_dir, multiprocessing=False, tensor_parallel_size=TP)
    try:
        out = _generate(llm)
    finally:
        h.shutdown_llm(llm)
    yield out


def test_tp2_rank_parts_hits_and_one_rank_failing_loads(
    model_dir: Path, tp_reference: list[list[int]], tmp_path: Path
) -> None:
    stats_path = tmp_path / "stats.json"
    llm = h.build_llm(
        model_dir,
        kv_transfer_config=jobs.transfer_config(jobs.kvtier_config(stats_path)),
        multiprocessing=False,
        tensor_parallel_size=TP,
    )
    try:
        assert sorted(llm.collective_rpc(h.kvtier_worker_rank)) == [0, 1]

        # 1. Cold round: computed by vLLM, stored by both ranks.
        cold = _generate(llm)
        stats = _live_stats(llm)
        assert stats["cache"]["stored_blocks"] == BLOCKS, stats["cache"]
        assert stats["cache"]["loaded_blocks"] == 0, stats["cache"]

        # Each stored slot: rank 0's part and rank 1's part both written, and not the same bytes
        # (each rank holds a different KV head). The pool starts zeroed.
        pool = _connector(llm)._scheduler.pool
        used = pool.array()[:, : pool.slot_bytes]
        part = pool.slot_bytes // TP
        written = [used[:, r * part : (r + 1) * part].any(axis=1) for r in range(TP)]
        assert int(written[0].sum()) == BLOCKS and (written[0] == written[1]).all()
        slots = written[0].nonzero()[0]
        for slot in slots:
            assert (used[slot, :part] != used[slot, part:]).any(), slot

        # 2. Warm round: every kvtier block loaded, on both ranks.
        assert h.reset_prefix_cache(llm)
        warm = _generate(llm)
        stats = _live_stats(llm)
        assert stats["cache"]["loaded_blocks"] == BLOCKS, stats["cache"]
        assert stats["connector"]["hit_tokens"] == BLOCKS * jobs.BLOCK_TOKENS
        assert stats["connector"]["load_blocks_failed"] == 0

        # 3. Rank 1 fails every load; rank 0 copies its share. Each job fails as a whole and vLLM
        # recomputes the blocks rank 1 reported.
        assert llm.collective_rpc(h.kvtier_fail_loads_on_rank, args=(1, 1.0)) == [None, 1.0]
        assert h.reset_prefix_cache(llm)
        failing = _generate(llm)
        llm.collective_rpc(h.kvtier_fail_loads_on_rank, args=(1, 0.0))
        stats = _live_stats(llm)
        assert stats["connector"]["load_blocks_failed"] == BLOCKS, stats["connector"]
        assert stats["cache"]["loaded_blocks"] == BLOCKS, stats["cache"]  # round 2's only

        # 4. Sensitivity: with the parts of every slot swapped each rank loads the other's head.
        for slot in slots:
            ours = used[slot, :part].copy()
            used[slot, :part] = used[slot, part:]
            used[slot, part:] = ours
        assert h.reset_prefix_cache(llm)
        swapped = _generate(llm)
        live = _live_stats(llm)
    finally:
        h.shutdown_llm(llm)

    assert cold == tp_reference
    assert warm == tp_reference
    assert failing == tp_reference
    assert all(s != r for s, r in zip(swapped, tp_reference, strict=True)), swapped
    assert live["cache"]["loaded_blocks"] == 2 * BLOCKS, live["cache"]
    assert live["pool_pinned"] == 0 and live["pinned_plans"] == 0, live
    assert live["jobs_in_flight"] == 0, live
    # The stats file the connector writes at shutdown says the same.
    stats = jobs.read_stats(stats_path)
    assert stats["cache"]["hit_blocks"] >= 3 * BLOCKS, stats["cache"]
    assert stats["connector"]["load_blocks_failed"] == BLOCKS, stats["connector"]
    assert stats["pool_used"] == BLOCKS and stats["pool_pinned"] == 0, stats
