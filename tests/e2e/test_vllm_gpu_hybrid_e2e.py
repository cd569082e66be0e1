"""End to end on an NVIDIA GPU: hybrid models through vLLM's hybrid KV cache manager with kvtier
(vLLM's CUDA build, the CUDA copy backend).

* A tiny Gemma-2 (sliding-window and full-attention layers, ``hybrid_models.write_tiny_gemma2``),
  in vLLM's batch-invariant mode.
* A tiny Nemotron-H (Mamba-2 layers with attention and MLP layers,
  ``hybrid_models.write_tiny_nemotron_h``), run where vLLM keeps its Mamba states in
  ``mamba_cache_mode`` ``all`` (0.25.1 picks it with prefix caching; 0.32 has ``align`` only,
  which kvtier does not serve: skipped there). vLLM 0.25.1 refuses batch-invariant mode for
  Mamba-2 layers ("not supported for MAMBA2_ATTN"), so each prompt runs alone instead: every
  step then has the same shapes with and without kvtier.
* Released architectures with dummy weights, as the GPU benchmark builds them: Gemma-3-12B's text
  model (batch-invariant) and Nemotron-H-8B (each prompt alone), with every group kind hit.

Every round compares greedy outputs token for token with vLLM alone (no connector) running the
same rounds: a round after a reset of vLLM's prefix cache is served by kvtier's loads, the same
round in vLLM alone by its own prefix cache (same resume boundary, same state bytes). The hits,
loads and stores per group come from kvtier's stats file. Skipped without a CUDA device or vLLM.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support import require
from support.scripts import benchmark_modules

GPU_MISSING = require.vllm_missing() or require.cuda_missing()
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.gpu,
    require.unless("gpu", GPU_MISSING),
    pytest.mark.timeout(900),
]
GPU_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}

if GPU_MISSING is None:
    from e2e import hybrid_models as models
    from e2e import vllm_harness as h
    from e2e import vllm_jobs as jobs


@dataclass(frozen=True, slots=True)
class Case:
    """How one model runs: vLLM's KV cache, kvtier's pool, the prompts and the batching."""

    long: list[list[int]]
    """Two prompts, run together (or one by one), cold and again after a prefix-cache reset."""
    shared: list[list[int]]
    """A prompt sharing a prefix with the first long one, after another reset."""
    batch_invariant: bool
    """vLLM's batch-invariant mode; without it each prompt is generated alone."""
    kv_cache_bytes: int = 64 << 20
    pool_size: str = "64MiB"
    max_model_len: int = 2048


def _case(long_tokens: int, shared_tokens: int, batch_invariant: bool, **sizes: Any) -> Case:
    if GPU_MISSING is not None:
        return Case([], [], batch_invariant)
    long = [h.prompt_tokens(long_tokens, seed=900 + i) for i in range(2)]
    shared = [long[0][:shared_tokens] + h.prompt_tokens(200, seed=950)]
    return Case(long, shared, batch_invariant, **sizes)


TINY_GEMMA2 = _case(1000, 900, batch_invariant=True)
"""Prompts ending inside a block: 1000 tokens are 31 Gemma-2 blocks of 32 and 8; the shared
prompt shares 28 blocks."""
TINY_NEMOTRON_H = _case(1000, 900, batch_invariant=False)
"""1000 tokens are 3 Nemotron-H blocks of 256 and 232; the shared prompt shares 3 blocks."""
RELEASED = {
    # 3,000 tokens: 187 Gemma-3 blocks of 16; 2 Nemotron-H-8B blocks of 1,152 (vLLM's 'all'
    # mode grows its attention block until a page holds a Mamba state), shared: 2 of each.
    # 4,608 tokens: the prompts and their outputs fit (2 Nemotron-H blocks of 1,152 are 2,304).
    kind: _case(
        3000,
        2600,
        batch_invariant=kind == "gemma3",
        kv_cache_bytes=2 << 30,
        pool_size="4GiB",
        max_model_len=4608,
    )
    for kind in ("gemma3", "nemotronh")
}
"""Released architectures (``benchmarks/vllm_bench_engine.HYBRID_MODELS``: Gemma-3-12B,
Nemotron-H-8B), dummy weights."""


@pytest.fixture(scope="module", autouse=True)
def gpu_env() -> Iterator[None]:
    with h.scoped_env(GPU_ENV):
        yield


def _engine(model: Path, stats: Path | None, case: Case) -> Any:
    config = None
    if stats is not None:
        config = jobs.transfer_config(jobs.kvtier_config(stats, pool_size=case.pool_size))
    return h.build_llm(
        model,
        kv_transfer_config=config,
        multiprocessing=False,
        gpu=True,
        kv_cache_memory_bytes=case.kv_cache_bytes,
        max_model_len=case.max_model_len,
    )


def _vllm_groups(llm: Any) -> list[str]:
    """vLLM's KV cache groups as its scheduler has them, in its order: each spec's class, layer
    count, block size, and window or Mamba mode where it has one."""
    core = llm.llm_engine.engine_core.engine_core
    out = []
    for group in core.scheduler.kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        extra = [
            f"{name}={getattr(spec, name)!r}"
            for name in ("sliding_window", "mamba_cache_mode")
            if getattr(spec, name, None) is not None
        ]
        fields = [f"layers={len(group.layer_names)}", f"block={spec.block_size}", *extra]
        out.append(f"{type(spec).__name__}({', '.join(fields)})")
    return out


def _kinds(groups: list[str]) -> list[str]:
    return [g.split("(")[0] for g in groups]


def _generate(llm: Any, prompts: list[list[int]], case: Case) -> list[list[int]]:
    if case.batch_invariant:
        return h.generate_ids(llm, prompts, max_tokens=16)
    return [h.generate_ids(llm, [p], max_tokens=16)[0] for p in prompts]


def _rounds(
    model: Path, stats: Path | None, case: Case
) -> tuple[list[list[list[int]]], dict[str, Any]]:
    """The long prompts cold, again after a prefix-cache reset (vLLM alone: again from its own
    prefix cache), then the shared prompt after another reset (vLLM alone: from its cache)."""
    with h.scoped_env({"VLLM_BATCH_INVARIANT": "1" if case.batch_invariant else "0"}):
        llm = _engine(model, stats, case)
    try:
        config = llm.llm_engine.vllm_config
        info = {
            "mode": getattr(config.cache_config, "mamba_cache_mode", None),
            "hybrid_off": config.scheduler_config.disable_hybrid_kv_cache_manager,
            "groups": _vllm_groups(llm),
        }
        reset = stats is not None
        out = [_generate(llm, case.long, case)]
        if reset:
            assert h.reset_prefix_cache(llm)
        out.append(_generate(llm, case.long, case))
        if reset:
            assert h.reset_prefix_cache(llm)
        out.append(_generate(llm, case.shared, case))
        if stats is not None:
            jobs.flush_stats(llm)
    finally:
        h.shutdown_llm(llm)
    return out, info


Rounds = Callable[[Path, Path | None, Case], tuple[list[list[list[int]]], dict[str, Any]]]


def _kvtier_matches(
    reference: list[list[list[int]]],
    alone: dict[str, Any],
    model: Path,
    case: Case,
    tmp_path: Path,
    rounds: Rounds = _rounds,
) -> dict[str, Any]:
    """The same rounds with kvtier: the hybrid manager on, vLLM's groups as without kvtier, the
    outputs vLLM alone gave; returns kvtier's stats."""
    ours, info = rounds(model, tmp_path / "stats.json", case)
    assert info["hybrid_off"] is False
    assert info["groups"] == alone["groups"], f"with kvtier {info['groups']}"
    assert ours == reference
    return jobs.read_stats(tmp_path / "stats.json")


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_tiny_gemma2(tmp_path_factory.mktemp("gpu-gemma2"))


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_tiny_nemotron_h(tmp_path_factory.mktemp("gpu-nemotron-h"))


def test_sliding_window_model_identical_with_hits(gemma2: Path, tmp_path: Path) -> None:
    reference, alone = _rounds(gemma2, None, TINY_GEMMA2)
    # Two groups of two layers: the sliding layers (0, 2) first, then the full ones (1, 3).
    expected = ["SlidingWindowSpec", "FullAttentionSpec"]
    assert _kinds(alone["groups"]) == expected, f"vLLM alone built {alone['groups']}"
    assert f"sliding_window={models.GEMMA2_WINDOW}" in alone["groups"][0], alone["groups"]
    stats = _kvtier_matches(reference, alone, gemma2, TINY_GEMMA2, tmp_path)
    window, full = stats["groups"]["0"], stats["groups"]["1"]
    assert (window["kind"], full["kind"]) == ("window", "full")
    assert full["hit_blocks"] >= 2 * 31 and window["hit_blocks"] >= 2 * 2
    assert stats["connector"]["load_blocks_failed"] == 0 and stats["pool_pinned"] == 0


def test_mamba_hybrid_identical_with_state_hits(nemotron_h: Path, tmp_path: Path) -> None:
    reference, alone = _rounds(nemotron_h, None, TINY_NEMOTRON_H)
    if alone["mode"] != "all":
        pytest.skip(f"vLLM keeps Mamba states in mode {alone['mode']!r} here (kvtier: 'all')")
    # Groups of two layers: the Mamba layers (0, 2, 4) in two groups, one padded, the
    # attention layers (1, 5) in one; every Mamba group in mode 'all'.
    assert sorted(_kinds(alone["groups"])) == ["FullAttentionSpec", "MambaSpec", "MambaSpec"], (
        f"vLLM alone built {alone['groups']}"
    )
    states = [g for g in alone["groups"] if g.startswith("MambaSpec")]
    assert all("mamba_cache_mode='all'" in g for g in states), alone["groups"]
    stats = _kvtier_matches(reference, alone, nemotron_h, TINY_NEMOTRON_H, tmp_path)
    assert stats["groups_refused"] is None
    kinds = {g["kind"] for g in stats["groups"].values()}
    assert kinds == {"full", "state"}
    states = [g for g in stats["groups"].values() if g["kind"] == "state"]
    full = next(g for g in stats["groups"].values() if g["kind"] == "full")
    # Each long prompt resumes at 3 blocks: 3 full-attention blocks and one state per Mamba
    # group; the shared prompt at 3 (the first prompt's stored end, 768 tokens) likewise.
    assert full["hit_blocks"] == 3 * 3
    assert all(g["hit_blocks"] == 3 for g in states)
    # Stored: one state per Mamba group at each stored end (1000 tokens: not the block before).
    assert all(g["stored_blocks"] == 2 + 1 for g in states)
    assert stats["connector"]["load_blocks_failed"] == 0 and stats["pool_pinned"] == 0


def released_rounds(model: str, stats: str | None, kind: str) -> list[Any]:
    """``_rounds`` of a released architecture, run by ``_fresh_rounds`` in a process of its own:
    after a Gemma-3-12B engine (vLLM 0.25.1) was shut down, its 23 GiB of weights stayed on the
    GPU in that process, and the next engine refused to start (too little free memory)."""
    out, info = _rounds(Path(model), None if stats is None else Path(stats), RELEASED[kind])
    return [out, info]


def _fresh_rounds(kind: str) -> Rounds:
    def rounds(
        model: Path, stats: Path | None, case: Case
    ) -> tuple[list[list[list[int]]], dict[str, Any]]:
        assert case is RELEASED[kind]
        job = "e2e.test_vllm_gpu_hybrid_e2e:released_rounds"
        stats_path = None if stats is None else str(stats)
        out, info = h.run_in_fresh_process(job, str(model), stats_path, kind)
        return out, info

    return rounds


@pytest.fixture(scope="module")
def released_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``make_model(kind, dir)`` of the GPU benchmark: a released architecture's config.json."""
    with benchmark_modules("vllm_bench_engine") as (engine,):
        yield lambda kind: engine.make_model(kind, tmp_path_factory.mktemp(kind)).path


@pytest.mark.parametrize("kind", sorted(RELEASED))
def test_released_hybrid_architecture_identical_with_hits_in_every_group(
    kind: str, released_models: Any, tmp_path: Path
) -> None:
    case, rounds = RELEASED[kind], _fresh_rounds(kind)
    model = released_models(kind)
    reference, alone = rounds(model, None, case)
    if kind == "nemotronh" and alone["mode"] != "all":
        pytest.skip(f"vLLM keeps Mamba states in mode {alone['mode']!r} here (kvtier: 'all')")
    assert len(alone["groups"]) > 1, f"vLLM alone built {alone['groups']}"
    stats = _kvtier_matches(reference, alone, model, case, tmp_path, rounds)
    assert stats["groups_refused"] is None
    hits: dict[str, int] = {}
    for group in stats["groups"].values():
        hits[group["kind"]] = hits.get(group["kind"], 0) + group["hit_blocks"]
    assert set(hits) == ({"full", "window"} if kind == "gemma3" else {"full", "state"}), hits
    assert all(n > 0 for n in hits.values()), hits
    assert stats["connector"]["load_blocks_failed"] == 0 and stats["pool_pinned"] == 0
