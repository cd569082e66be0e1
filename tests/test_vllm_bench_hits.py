"""``benchmarks/vllm_bench_hits.py``: the predicted host-pool hits of a hybrid benchmark model
(kvtier's pool and vLLM's offloading as LRU pools), the hybrid models' run defaults and the bytes
per cached token against full attention (no vLLM needed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from support.scripts import benchmark_modules


@pytest.fixture(scope="module")
def mods() -> Iterator[dict[str, ModuleType]]:
    names = ("vllm_bench_engine", "vllm_bench_hits", "vllm_bench_kv", "vllm_gpu_bench")
    with benchmark_modules(*names) as (eng, hits, kv, bench):
        yield {"eng": eng, "hits": hits, "kv": kv, "bench": bench}


def _toy(kv: ModuleType) -> Any:
    # 4-token blocks, one full-attention and one window group (window 9: 2 blocks), 1 KiB blocks.
    return kv.KVPool(4, 1, 1024, full_groups=1, window_groups=1, window=9)


def test_kvtier_resumes_at_the_stored_end_with_the_window_before_it(
    mods: dict[str, ModuleType],
) -> None:
    hits = mods["hits"]
    groups = hits.Groups.of(_toy(mods["kv"]))
    first = list(range(41))  # 10 whole blocks and a token
    second = first + list(range(100, 120))  # 15 blocks
    chain1, chain2 = hits.chains([first, second], 4)
    assert chain2[:10] == chain1
    pool = hits.LRU(100)
    assert hits.kvtier_request(pool, groups, chain1, len(first), 4) == 0
    # Stored: the 10 full-attention blocks and the window's 2 blocks before the end.
    assert all((0, c) in pool for c in chain1)
    assert [b for b, c in enumerate(chain1) if (1, c) in pool] == [8, 9]
    assert hits.kvtier_request(pool, groups, chain2, len(second), 4) == 10
    # A pool that lost a window block before the end steps back to no boundary at all.
    small = hits.LRU(100)
    hits.kvtier_request(small, groups, chain1, len(first), 4)
    small._order.pop((1, chain1[9]))
    assert hits.kvtier_request(small, groups, chain2, len(second), 4) == 0


def test_native_stores_every_group_and_needs_more_room(mods: dict[str, ModuleType]) -> None:
    hits = mods["hits"]
    pool = _toy(mods["kv"])
    convs = [
        [list(range(k * 1000, k * 1000 + 41)), list(range(k * 1000, k * 1000 + 61))]
        for k in range(4)
    ]
    # kvtier: 10 full blocks and 2 window blocks a first turn, 5 and 2 more a second one.
    found = hits.predict(convs, 4, pool, 4 * (12 + 7) * 1024, 4)
    assert found["kvtier"].hit_tokens == 4 * 40 and found["kvtier"].evictions == 0
    assert found["kvtier"].hit_requests == 4
    # Native stores both groups' blocks, the generated one too: 2 x 11, then 2 x 6.
    assert found["native"].hit_tokens == 0
    found = hits.predict(convs, 4, pool, 4 * (22 + 12) * 1024, 4)
    assert found["native"].hit_tokens == 4 * 40 and found["native"].evictions == 0


def test_gemma3_thrashes_at_16_in_flight_and_holds_at_its_defaults(
    mods: dict[str, ModuleType], tmp_path: Path
) -> None:
    """The H100 run (vLLM 0.25.1, 2026-11-27, 16 in flight, 8 GiB): no configuration cached a
    token, kvtier's pool evicted 119,792 blocks. The defaults hold the conversations in both."""
    eng, hits = mods["eng"], mods["hits"]
    model = eng.make_model("gemma3", tmp_path)
    settings = eng.Settings(4, 40, 4, 32, 16384, None, tmp_path)

    def predict(concurrency: int, requests: int, host_gib: float) -> dict[str, Any]:
        prompts, summary = eng.build_point(settings, model, concurrency, requests)
        convs = [[p for _t, p in turns] for _i, turns in prompts.by_conversation]
        out = hits.summary(convs, concurrency, model.pool, host_gib, 32)
        out["reusable"] = summary["reusable_prompt_tokens"]
        return out

    old = predict(16, 160, 8.0)
    assert old["kvtier"]["hit_tokens"] == 0 and old["native"]["hit_tokens"] == 0
    assert 100_000 < old["kvtier"]["evictions"] < 140_000
    d = eng.RUN_DEFAULTS["gemma3"]
    new = predict(d.concurrency, d.requests, d.host_gib)
    assert new["kvtier"]["hit_tokens"] == new["reusable"]
    assert new["native"]["hit_share"] > 0.6 and new["kvtier"]["hit_share"] > 0.6
    # Native needs the margin: at 8 GiB it loses part of it.
    assert predict(d.concurrency, d.requests, 8.0)["native"]["hit_share"] < 0.66


def test_hybrid_models_have_their_own_run_defaults(
    mods: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bench = mods["bench"]
    seen: dict[str, Any] = {}

    def fake_run(args: Any, settings: Any, model: Any, configs: list[str]) -> int:
        seen[args.model] = (args.concurrency, args.requests, args.host_gib)
        return 0

    monkeypatch.setattr(bench, "run_single", fake_run)
    monkeypatch.setattr(bench, "prepare_env", lambda: None)
    for name in ("llama8b", "gemma3", "nemotronh"):
        assert bench.main(["--model", name, "--workdir", str(tmp_path)]) == 0
    bench.main(["--model", "gemma3", "--concurrency", "8", "--workdir", str(tmp_path)])
    assert seen["llama8b"] == (16, 160, 8.0)
    assert seen["nemotronh"] == (4, 40, 8.0)
    assert seen["gemma3"] == (8, 160, 12.0)


def test_bytes_per_cached_token_against_full_attention(
    mods: dict[str, ModuleType], tmp_path: Path
) -> None:
    eng, bench = mods["eng"], mods["bench"]
    gemma = eng.make_model("gemma3", tmp_path).pool
    # 48 layers x 8 KV heads x 256 x 2 (K, V) x 2 bytes.
    assert gemma.full_attention_bytes_per_token == 48 * 8192
    # The H100 run's figures (vLLM 0.25.1, 2026-11-27).
    row = bench.bytes_ratio({"window": 120_858.0, "full": 65_536.0}, 48 * 8192)
    assert row == {"full_attention_bytes_per_token": 393_216, "kvtier_bytes_per_token_ratio": 0.474}
    # Nemotron-H-8B: 4 attention and 24 Mamba layers, each at the 4,096-byte attention page.
    assert eng.make_model("nemotronh", tmp_path).pool.full_attention_bytes_per_token == 28 * 4096
