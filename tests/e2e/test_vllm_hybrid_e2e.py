"""End to end: a hybrid model (sliding-window and full-attention layers) through vLLM's hybrid KV
cache manager with kvtier, real vLLM (CPU build), tiny Gemma-2-shaped model with random weights.

Every case compares greedy outputs with vLLM alone (hybrid manager on, no connector) and reads
kvtier's per-group stats. A Mamba hybrid cannot run on this build: Jamba stops in
``selective_scan_fwd`` (``torch.ops._C`` has no such op) and a Mamba-2 model (Nemotron-H shape) in
``mamba_mixer2.conv_ssm_forward`` (IndexError at its first forward), with or without kvtier; the
GPU tests cover its outputs. Here a tiny Nemotron-H starts with kvtier, the hybrid manager on.
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
    from e2e import hybrid_models as models
    from e2e import vllm_harness as h
    from e2e import vllm_jobs as jobs

BLOCK = 32
LONG = (
    [h.prompt_tokens(1000, seed=700 + i) for i in range(2)]
    if require.vllm_missing() is None
    else []
)
"""31 whole blocks each: the window tails stored are before blocks 16 and 31."""


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_tiny_gemma2(tmp_path_factory.mktemp("tiny-gemma2"))


@pytest.fixture(scope="module")
def shared_prompts() -> list[list[int]]:
    # 700 tokens of the first long prompt (21 whole blocks), then a suffix of its own.
    return [LONG[0][:700] + h.prompt_tokens(200, seed=800 + i) for i in range(2)]


@pytest.fixture(scope="module")
def reference(gemma2: Path, shared_prompts: list[list[int]]) -> Iterator[dict[str, Any]]:
    llm = h.build_llm(gemma2, multiprocessing=False)
    try:
        groups = _core(llm).scheduler.kv_cache_config.kv_cache_groups
        yield {
            "long": h.generate_ids(llm, LONG, max_tokens=8),
            "shared": h.generate_ids(llm, shared_prompts, max_tokens=8),
            "groups": [type(g.kv_cache_spec).__name__ for g in groups],
        }
    finally:
        h.shutdown_llm(llm)


def _core(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core


def _engine(model: Path, stats: Path, **vllm: Any) -> Any:
    config = jobs.transfer_config(jobs.kvtier_config(stats, **vllm))
    return h.build_llm(model, kv_transfer_config=config, multiprocessing=False)


def test_hybrid_manager_stays_on_and_outputs_match(
    gemma2: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    assert reference["groups"] == ["SlidingWindowSpec", "FullAttentionSpec"]
    llm = _engine(gemma2, tmp_path / "stats.json")
    try:
        assert llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
        assert len(_core(llm).scheduler.kv_cache_config.kv_cache_groups) == 2
        first = h.generate_ids(llm, LONG, max_tokens=8)
        assert h.reset_prefix_cache(llm)
        second = h.generate_ids(llm, LONG, max_tokens=8)
        stats = _core(llm).scheduler.connector.stats_snapshot()
    finally:
        h.shutdown_llm(llm)
    assert first == reference["long"]
    assert second == reference["long"]
    window, full = stats["groups"]["0"], stats["groups"]["1"]
    assert (window["kind"], full["kind"]) == ("window", "full")
    # Each prompt resumes at block 31 (one token of 1000 is left to compute): all 31 blocks of
    # the full-attention group and the 2 window blocks before the boundary.
    assert full["hit_blocks"] == 2 * 31 and window["hit_blocks"] == 2 * 2
    assert stats["connector"]["hit_tokens"] == 2 * 31 * BLOCK
    assert stats["connector"]["load_blocks_failed"] == 0
    # Stored: 31 full blocks a prompt, the window's blocks only before blocks 16 and 31 (1000
    # tokens end past block 31: no lookup of this prompt stops at 30).
    assert full["stored_blocks"] == 2 * 31 and window["stored_blocks"] == 2 * 4
    assert stats["pool_pinned"] == 0 and stats["jobs_in_flight"] == 0


def test_window_group_stores_less_than_full_attention(gemma2: Path, tmp_path: Path) -> None:
    """Bytes stored per cached token against a model of the same size with full attention in
    all four layers (which stores every block of every layer)."""
    llm = _engine(gemma2, tmp_path / "stats.json")
    try:
        h.generate_ids(llm, LONG, max_tokens=1)
        stats = _core(llm).scheduler.connector.stats_snapshot()
    finally:
        h.shutdown_llm(llm)
    window, full = stats["groups"]["0"], stats["groups"]["1"]
    cached_tokens = full["stored_blocks"] * BLOCK
    layer_block_bytes = full["stored_bytes"] // (full["stored_blocks"] * full["layers"])
    all_full = cached_tokens // BLOCK * 4 * layer_block_bytes
    hybrid = window["stored_bytes"] + full["stored_bytes"]
    ratio = hybrid / all_full
    # 2 x 31 full blocks + 2 x 4 window blocks of 2 layers, against 2 x 31 blocks of 4 layers.
    assert ratio == pytest.approx((62 + 8) / 124)
    # What the window needs: half the layers keep 2 blocks before each resumable boundary.
    assert ratio < 0.6


def test_shared_prefix_resumes_at_a_stored_window_boundary(
    gemma2: Path, reference: dict[str, Any], shared_prompts: list[list[int]], tmp_path: Path
) -> None:
    """Two prompts share 21 whole blocks with a stored one; the window group has blocks only
    before blocks 16 and 31 there, so the hit is 16 blocks: every group's state at that
    boundary, never the 21 blocks the full-attention group alone has."""
    llm = _engine(gemma2, tmp_path / "stats.json")
    try:
        h.generate_ids(llm, LONG[:1], max_tokens=1)
        assert h.reset_prefix_cache(llm)
        out = h.generate_ids(llm, shared_prompts[:1], max_tokens=8)
        assert h.reset_prefix_cache(llm)
        out += h.generate_ids(llm, shared_prompts[1:], max_tokens=8)
        stats = _core(llm).scheduler.connector.stats_snapshot()
    finally:
        h.shutdown_llm(llm)
    assert out == reference["shared"]
    # The first shared prompt resumes at 16 and stores the window before its own end (28
    # blocks); the second one diverges from it after block 21 too, so it resumes at 16 again.
    assert stats["connector"]["hit_tokens"] == 2 * 16 * BLOCK
    assert stats["groups"]["0"]["hit_blocks"] == 2 * 2


def test_window_blocks_evicted_from_the_pool_are_a_miss(gemma2: Path, tmp_path: Path) -> None:
    """A pool too small for a prompt's blocks of both groups: what is missing is never loaded
    in part; the outputs stay vLLM's."""
    llm = _engine(gemma2, tmp_path / "stats.json")
    ref = None
    try:
        ref = h.generate_ids(llm, LONG, max_tokens=4)
    finally:
        h.shutdown_llm(llm)
    config = jobs.transfer_config(
        jobs.kvtier_config(tmp_path / "small.json", pool_size=20 * 16384 * 2)
    )
    llm = h.build_llm(gemma2, kv_transfer_config=config, multiprocessing=False)
    try:
        for _ in range(2):
            assert h.generate_ids(llm, LONG, max_tokens=4) == ref
            assert h.reset_prefix_cache(llm)
        stats = _core(llm).scheduler.connector.stats_snapshot()
    finally:
        h.shutdown_llm(llm)
    assert stats["connector"]["load_blocks_failed"] == 0
    assert stats["pool_pinned"] == 0


def test_a_mamba_hybrid_in_align_mode_starts_and_is_never_served(tmp_path: Path) -> None:
    """vLLM 0.32 keeps a Mamba group's states in ``mamba_cache_mode`` ``align`` (its only mode
    with prefix caching: 0.25.1's ``all`` is gone), where states move between blocks: kvtier
    starts with the hybrid manager on, describes the groups and serves no request (misses)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    model = models.write_tiny_nemotron_h(tmp_path / "nemotron-h")
    llm = _engine(model, tmp_path / "stats.json")
    try:
        config = llm.llm_engine.vllm_config
        assert config.scheduler_config.disable_hybrid_kv_cache_manager is False
        assert config.cache_config.mamba_cache_mode == "align"
        scheduler = _core(llm).scheduler.connector._scheduler
        assert sorted(g.kind.value for g in scheduler.groups) == ["full", "other", "other"]
        assert scheduler.refused is not None and "other" in scheduler.refused
        # Every group's tensors are registered as vLLM hands them over (0.32: page views).
        worker = get_kv_transfer_group()._worker
        assert sorted(worker._groups) == sorted(g.index for g in scheduler.groups)
    finally:
        h.shutdown_llm(llm)
