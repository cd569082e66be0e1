"""vLLM asks ``matched_tokens`` every step for a waiting request it has no room for yet: asked
again from the same start, the planner keeps the pins of its previous plan
(``TieredCache.lookup_and_pin``) instead of dropping and taking them again; a changed start, a
deferred lookup, nothing to load or a request that gets no loads give them up, and no pin
outlives the request. Random asks, stores, loads and other requests' loads decide and pin as
releasing the previous plan first did."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from support import require

require.importorskip("torch", "vllm")

from engine.test_planner import (  # noqa: E402
    BLOCK_TOKENS,
    BPS,
    BS,
    RANKS,
    Tables,
    ToyPlanner,
    ToyRequest,
)
from kvtier.cache.manager import TieredCache  # noqa: E402
from kvtier.cache.records import LookupResult  # noqa: E402
from kvtier.cache.shared import SharedTieredCache  # noqa: E402
from kvtier.config import load_config  # noqa: E402
from kvtier.engine.orders import RankReport  # noqa: E402
from kvtier.engine.planner_settings import PlannerSettings  # noqa: E402
from kvtier.keys import BlockKey, Namespace, chain_keys  # noqa: E402

PROMPT = list(range(100, 133))  # 8 full kvtier blocks of 4 tokens and one token to compute
SLOTS = 128


def _planner(shm_dir: Path, slots: int = SLOTS) -> ToyPlanner:
    shm_dir.mkdir(parents=True, exist_ok=True)
    slot_bytes = RANKS * 2 * BPS * 64
    config = load_config(
        {"model": "toy", "pool": {"size": slots * slot_bytes, "shm_dir": str(shm_dir)}}
    )
    ns = Namespace(model="toy", dtype="uint8", block_tokens=BLOCK_TOKENS, tp_size=RANKS)
    return ToyPlanner(config, PlannerSettings(blocks_per_slot=BPS), ns, slot_bytes, BS, RANKS)


def _cache(planner: ToyPlanner) -> TieredCache:
    cache = planner.cache
    assert isinstance(cache, TieredCache)
    return cache


def _store(planner: ToyPlanner, keys: Sequence[BlockKey]) -> None:
    cache = _cache(planner)
    cache.complete_store(cache.prepare_store(keys).keys)


def _keys(planner: ToyPlanner, tokens: list[int]) -> list[BlockKey]:
    return chain_keys(planner.namespace, tokens)[: (len(tokens) - 1) // BLOCK_TOKENS]


def _pins(planner: ToyPlanner) -> tuple[dict[BlockKey, int], dict[BlockKey, int]]:
    cache = _cache(planner)
    return dict(cache._pins), dict(cache._loading)


def _no_pins_left(planner: ToyPlanner) -> None:
    cache = _cache(planner)
    assert cache._pins == {} and cache._loading == {}
    assert planner.stats()["pool_pinned"] == 0
    cache.check_invariants()


@pytest.fixture
def planner(tmp_path: Path) -> Iterator[ToyPlanner]:
    planner = _planner(tmp_path)
    _store(planner, _keys(planner, PROMPT))
    yield planner
    planner.close()


@pytest.fixture
def released(planner: ToyPlanner, monkeypatch: pytest.MonkeyPatch) -> list[BlockKey]:
    """Every key the planner's cache unpins (``release_load``), in order."""
    cache = _cache(planner)
    out: list[BlockKey] = []
    real = cache.release_load

    def spy(keys: Sequence[BlockKey]) -> None:
        out.extend(keys)
        real(keys)

    monkeypatch.setattr(cache, "release_load", spy)
    return out


def test_asking_again_keeps_the_plans_pins(planner: ToyPlanner, released: list[BlockKey]) -> None:
    keys = _keys(planner, PROMPT)
    request = ToyRequest("b", PROMPT, blocks=list(range(20, 37)))
    assert planner.matched_tokens(request, 0) == (32, False)
    pinned = _pins(planner)
    assert pinned == (dict.fromkeys(keys, 1), dict.fromkeys(keys, 1))
    slots = planner._plans["b"].slots
    for _ in range(3):  # the engine had no room: it asks again next step
        # Other requests' stores between the steps fill the pool: the pinned blocks stay.
        _store(planner, chain_keys(planner.namespace, list(range(5000, 5000 + 4 * SLOTS))))
        assert planner.matched_tokens(request, 0) == (32, False)
        assert released == []  # never unpinned, not even for a moment
        assert _pins(planner) == pinned
        assert planner._plans["b"].slots == slots
    planner.after_alloc(request, request.blocks, 32)
    (load,) = planner.plan_step({"b": 1}, Tables(b=request.blocks), None).loads
    assert load.slots == slots
    planner.on_report(RankReport({load.job_id: RANKS}))
    planner.request_finished(request)
    _no_pins_left(planner)


def test_asking_again_pins_the_blocks_stored_since(tmp_path: Path) -> None:
    planner = _planner(tmp_path)
    try:
        keys = _keys(planner, PROMPT)
        _store(planner, keys[:3])
        request = ToyRequest("b", PROMPT)
        assert planner.matched_tokens(request, 0) == (12, False)
        _store(planner, keys[3:])
        assert planner.matched_tokens(request, 0) == (32, False)
        assert _pins(planner) == (dict.fromkeys(keys, 1), dict.fromkeys(keys, 1))
        planner.after_alloc(request, [], 0)  # the engine took none of it
        _no_pins_left(planner)
    finally:
        planner.close()


def test_a_changed_start_gives_up_the_pins(planner: ToyPlanner, released: list[BlockKey]) -> None:
    keys = _keys(planner, PROMPT)
    request = ToyRequest("b", PROMPT)
    assert planner.matched_tokens(request, 0) == (32, False)
    # The engine's own prefix cache holds the first 2 blocks now: the plan starts at block 2.
    assert planner.matched_tokens(request, 2 * BLOCK_TOKENS) == (24, False)
    assert released == keys
    assert _pins(planner) == (dict.fromkeys(keys[2:], 1), dict.fromkeys(keys[2:], 1))
    # All the engine may reuse is its own: nothing to load, nothing held.
    assert planner.matched_tokens(request, len(PROMPT) - 1) == (0, False)
    assert released == keys + keys[2:]
    _no_pins_left(planner)
    planner.request_finished(request)
    _no_pins_left(planner)


def test_a_deferred_ask_gives_up_the_pins(planner: ToyPlanner, released: list[BlockKey]) -> None:
    keys = _keys(planner, PROMPT)
    cache = _cache(planner)
    request = ToyRequest("b", PROMPT)
    assert planner.matched_tokens(request, 0) == (32, False)
    other = keys[: len(cache.prepare_load(keys[5:]))]  # another load of the last 3 blocks
    assert planner.matched_tokens(request, 0) == (None, False)  # asked again after that load
    assert "b" not in planner._plans
    assert _pins(planner) == (dict.fromkeys(keys[5:], 1), dict.fromkeys(keys[5:], 1))
    cache.complete_load(keys[5 : 5 + len(other)])
    _no_pins_left(planner)
    assert planner.matched_tokens(request, 0) == (32, False)
    planner.request_finished(request)
    _no_pins_left(planner)


def test_a_request_that_gets_no_loads_gives_up_the_pins(
    planner: ToyPlanner, released: list[BlockKey]
) -> None:
    request = ToyRequest("b", PROMPT)
    assert planner.matched_tokens(request, 0) == (32, False)
    planner._no_loads.add("b")  # its asynchronous load failed, or a reset
    assert planner.matched_tokens(request, 0) == (0, False)
    assert released == _keys(planner, PROMPT)
    _no_pins_left(planner)
    planner.request_finished(request)
    _no_pins_left(planner)


def _release_first(cache: TieredCache) -> None:
    """The cache answers ``lookup_and_pin`` as the planner asked it before: the previous plan's
    pins released, a lookup, the hits pinned."""

    def lookup_and_pin(
        keys: Sequence[BlockKey], owner: Any, held: int = 0
    ) -> tuple[LookupResult, list[int]]:
        cache.release_load(keys[:held])
        result = cache.lookup(keys, owner)
        if not result.final:
            return result, []
        return result, cache.prepare_load(keys[: result.hits], owner)

    cache.lookup_and_pin = lookup_and_pin  # type: ignore[method-assign]


def _state(planner: ToyPlanner) -> object:
    cache = _cache(planner)
    plans = {
        r: (p.keys, p.slots, p.first_token, p.external_tokens) for r, p in planner._plans.items()
    }
    return (
        dict(cache._pins),
        dict(cache._loading),
        dict(cache._index),
        cache.stats().cache,
        plans,
        planner.counters,
    )


def test_random_asks_decide_and_pin_as_releasing_first(tmp_path: Path) -> None:
    """Waiting requests asked again from the same or another start, prompts stored and evicted
    (6 prompts of up to 40 blocks over 32 slots), loads of other requests deferring them,
    requests allocated (their loads run) or finished: both ways give the same answers, pins,
    plans, index and counters after every operation, and leave no pin."""
    for seed in range(12):
        rng = random.Random(seed)
        base = [rng.randrange(1000) for _ in range(160)]
        prompts = [
            base[: rng.randrange(0, 80)]
            + [rng.randrange(1000) for _ in range(rng.randrange(2, 80))]
            for _ in range(6)
        ]
        kept, old = (_planner(tmp_path / f"{way}{seed}", 32) for way in ("kept", "old"))
        _release_first(_cache(old))
        pair = (kept, old)
        live: dict[str, tuple[list[int], int]] = {}  # request -> its prompt and last start
        others: dict[str, list[BlockKey]] = {}
        answers: dict[str, tuple[int | None, bool]] = {}
        try:
            for op in range(150):
                what = rng.random()
                if what < 0.45 or not live:
                    if live and rng.random() < 0.8:
                        rid = rng.choice(sorted(live))
                    else:
                        rid = f"r{op}"
                        live[rid] = (rng.choice(prompts), 0)
                    tokens, computed = live[rid]
                    if rng.random() < 0.4:
                        computed = rng.randrange(0, len(tokens) + 1, BS)
                    live[rid] = (tokens, computed)
                    got = [p.matched_tokens(ToyRequest(rid, tokens), computed) for p in pair]
                    assert got[0] == got[1], (seed, op)
                    answers[rid] = got[0]
                elif what < 0.6:
                    keys = _keys(kept, rng.choice(prompts))
                    cut = rng.randrange(0, len(keys) + 1)
                    for p in pair:
                        _store(p, keys[:cut])
                elif what < 0.75:
                    rid = rng.choice(sorted(live))
                    tokens, _ = live.pop(rid)
                    external = answers.pop(rid, (0, False))[0] or 0
                    for p in pair:
                        request = ToyRequest(rid, tokens, blocks=list(range(len(tokens))))
                        p.after_alloc(request, request.blocks, external)
                        loads = p.plan_step({}, Tables(), None).loads
                        p.on_report(RankReport({load.job_id: RANKS for load in loads}))
                        p.request_finished(request)
                elif what < 0.88:
                    keys = _keys(kept, rng.choice(prompts))
                    cut = rng.randrange(1, len(keys) + 1) if keys else 0
                    pinned = [_cache(p).prepare_load(keys[:cut]) for p in pair]
                    assert pinned[0] == pinned[1]
                    others[f"o{op}"] = keys[: len(pinned[0])]
                elif others:
                    name = rng.choice(sorted(others))
                    keys = others.pop(name)
                    for p in pair:
                        _cache(p).complete_load(keys)
                assert _state(kept) == _state(old), (seed, op)
                _cache(kept).check_invariants()
            for p in pair:
                for rid, (tokens, _) in live.items():
                    p.request_finished(ToyRequest(rid, tokens))
                for keys in others.values():
                    _cache(p).complete_load(keys)
                _no_pins_left(p)
            assert _state(kept) == _state(old)
        finally:
            for p in pair:
                p.close()


def test_a_held_block_a_shared_index_read_misses_is_not_left_pinned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lookup reads a shared pool's index without its lock and may miss a key whose table
    entry another engine's removal is shifting, pinned by this request or not: the pins of the
    previous plan past the hits are given up with it."""
    slot_bytes = RANKS * 2 * BPS * 64
    pool = {"size": SLOTS * slot_bytes, "shm_dir": str(tmp_path), "share": "reask"}
    config = load_config({"model": "toy", "pool": pool})
    ns = Namespace(model="toy", dtype="uint8", block_tokens=BLOCK_TOKENS, tp_size=RANKS)
    planner = ToyPlanner(config, PlannerSettings(blocks_per_slot=BPS), ns, slot_bytes, BS, RANKS)
    try:
        cache = planner.cache
        assert isinstance(cache, SharedTieredCache)
        keys = _keys(planner, PROMPT)
        cache.complete_store(cache.prepare_store(keys).keys)
        request = ToyRequest("b", PROMPT)
        assert planner.matched_tokens(request, 0) == (32, False)
        real = cache.index.leading_hits
        monkeypatch.setattr(cache.index, "leading_hits", lambda k: min(real(k), 5))
        assert planner.matched_tokens(request, 0) == (20, False)
        assert cache._loading == dict.fromkeys(keys[:5], 1)
        planner.request_finished(request)
        assert cache._pins == {} and cache._loading == {}
        assert cache.index._pin_counts == {}
    finally:
        planner.close()


def test_hit_tokens_by_origin_leave_out_what_the_engine_holds(
    planner: ToyPlanner, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Blocks promoted from a tier alternate with the pool's own; the engine holds the first
    # block's first engine block, which is not loaded.
    cache = _cache(planner)
    monkeypatch.setattr(cache, "origins", lambda keys: ["disk0", "pool"] * (len(keys) // 2))
    request = ToyRequest("b", PROMPT, blocks=list(range(20, 37)))
    assert planner.matched_tokens(request, BS) == (8 * BLOCK_TOKENS - BS, False)
    assert planner.hits_by_tier == {"pool": 4, "disk0": 4}
    planner.after_alloc(request, request.blocks, 8 * BLOCK_TOKENS - BS)
    split = {"disk0": 4 * BLOCK_TOKENS - BS, "pool": 4 * BLOCK_TOKENS}
    assert planner.take_hit_sources("b") == split
    assert list(planner.take_hit_sources("b")) == []
    assert planner.hit_tokens_by_tier == split
