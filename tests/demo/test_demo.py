"""The vLLM demo's workload builder, cache model and report helpers (no vLLM needed).

The end-to-end run of the demo itself is ``tests/e2e/test_demo_e2e.py``.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import pytest
from support import require

from kvtier.demo import (
    BLOCK_TOKENS,
    FIRST_TOKEN,
    MODELS,
    SCALE,
    Turn,
    Workload,
    block_tokens,
    build_workload,
    conversation,
    engine_blocks_for,
    interleave,
    predict_shares,
    trace_groups,
    unbounded_engine_blocks,
)
from kvtier.demo.__main__ import delta, tier_summary, warmup_prompts
from kvtier.sim.trace import TraceRequest, bundled_trace_path, read_trace

VOCAB = MODELS["demo"].vocab_size


@pytest.fixture(scope="module")
def workload() -> Workload:
    return build_workload()  # the demo's defaults


def by_session(w: Workload) -> dict[int, list[Turn]]:
    out: dict[int, list[Turn]] = defaultdict(list)
    for t in w.turns:
        out[t.session].append(t)
    return out


def test_deterministic(workload: Workload) -> None:
    again = build_workload()
    assert again == workload
    assert len(workload.turns) == 64
    # Another shape gives another workload, from the same trace.
    assert build_workload(requests=64, concurrency=3) != workload


def test_later_turns_resend_the_earlier_prompt_as_prefix(workload: Workload) -> None:
    trace = read_trace(bundled_trace_path())
    sessions = by_session(workload)
    assert len(sessions) == workload.sessions >= 10
    multi = 0
    for turns in sessions.values():
        assert [t.turn for t in turns] == list(range(1, len(turns) + 1))
        assert turns[0].resent == 0
        # Turns come from trace requests of one group (same first block), in trace order.
        firsts = {trace[t.trace_index].hash_ids[0] for t in turns}
        assert len(firsts) == 1
        assert [t.trace_index for t in turns] == sorted(t.trace_index for t in turns)
        for prev, cur in itertools.pairwise(turns):
            multi += 1
            assert cur.resent == len(prev.tokens)
            assert cur.tokens[: cur.resent] == prev.tokens
            # After the re-sent prompt: the previous answer (scaled output length), then the
            # new question (at least one token).
            answer = math.ceil(trace[prev.trace_index].output_length / SCALE)
            assert len(cur.tokens) >= cur.resent + answer + 1
    assert multi >= 30


def test_conversations_do_not_share_their_context(workload: Workload) -> None:
    starts = {t.tokens[:BLOCK_TOKENS] for t in workload.turns if t.turn == 1}
    assert len(starts) == workload.sessions


def test_first_conversation_is_scaled_from_the_trace() -> None:
    trace = read_trace(bundled_trace_path())
    group = next(trace_groups(trace, 4))
    # The bundled trace's first group: requests 1, 121, 1652, 2666 share 67 of their blocks.
    assert group == [1, 121, 1652, 2666]
    turns = conversation(trace, group, max_context_blocks=40, vocab=VOCAB)
    index, prompt, resent = turns[0]
    first = trace[1]
    context = [tok for h in first.hash_ids[:40] for tok in block_tokens(h, BLOCK_TOKENS, VOCAB)]
    assert prompt[: len(context)] == context
    # Its question: its 5 blocks after the shared 67, the last one partial (36640 - 71 * 512
    # = 288 trace tokens -> 18 tokens).
    assert len(first.hash_ids) == 72
    assert len(prompt) == 40 * BLOCK_TOKENS + 4 * BLOCK_TOKENS + 18
    assert prompt[-18:] == block_tokens(first.hash_ids[-1], 18, VOCAB)
    assert (index, resent) == (1, 0)
    # Equal hash ids give equal tokens; a partial block is the start of the full one.
    assert block_tokens(7, 32, VOCAB)[:5] == block_tokens(7, 5, VOCAB)
    assert block_tokens(7, 32, VOCAB) != block_tokens(8, 32, VOCAB)


def test_context_is_cut_to_max_context_blocks() -> None:
    short = build_workload(requests=8, max_context_blocks=4)
    first = [t for t in short.turns if t.turn == 1]
    long = build_workload(requests=8, max_context_blocks=40)
    assert max(len(t.tokens) for t in first) < max(len(t.tokens) for t in long.turns)


def test_identical_requests_still_get_a_question() -> None:
    same = TraceRequest(0.0, 1000, 32, (10, 11))
    turns = conversation([same, same, same], [0, 1, 2], max_context_blocks=8, vocab=VOCAB)
    assert [len(p) for _, p, _ in turns] == [32 + 31, 32 + 31 + 2 + 31, 32 + 31 + 2 + 31 + 2 + 31]
    assert [r for _, _, r in turns] == [0, 63, 96]


def test_token_ids_within_vocab(workload: Workload) -> None:
    ids = {tok for t in workload.turns for tok in t.tokens}
    assert min(ids) >= FIRST_TOKEN and max(ids) < VOCAB
    tiny = build_workload(requests=8, vocab=MODELS["tiny"].vocab_size)
    assert max(tok for t in tiny.turns for tok in t.tokens) < MODELS["tiny"].vocab_size


def test_interleave_round_robin_keeps_the_window_full() -> None:
    sessions = iter([["a1", "a2"], ["b1", "b2", "b3"], ["c1"], ["d1", "d2"]])
    out = interleave(sessions, concurrency=2, limit=100)
    # a finishes: c takes its place; c finishes: d; b finishes and nothing is left to keep two
    # sessions open, so the stream stops (d alone would send its turns back to back).
    assert [item for _, item in out] == ["a1", "b1", "a2", "b2", "c1", "b3"]
    assert [n for n, _ in out] == [0, 1, 0, 1, 2, 1]
    assert len(interleave(iter([["x"] * 5] * 9), concurrency=3, limit=7)) == 7


def test_turns_of_a_conversation_are_spread_apart(workload: Workload) -> None:
    position: dict[int, int] = {}
    gaps = []
    for i, t in enumerate(workload.turns):
        if t.session in position:
            gaps.append(i - position[t.session])
        position[t.session] = i
    assert min(gaps) >= workload.concurrency
    # Between two turns, the other conversations send more than vLLM's cache holds.
    engine_tokens = engine_blocks_for(workload) * BLOCK_TOKENS
    lengths = [len(t.tokens) for t in workload.turns]
    seen: dict[int, int] = {}
    for i, t in enumerate(workload.turns):
        if t.session in seen:
            assert sum(lengths[seen[t.session] + 1 : i]) > engine_tokens
        seen[t.session] = i


def test_expected_reuse_share(workload: Workload) -> None:
    # Direct count: full blocks of the previous turn's prompt, which a later turn re-sends.
    resent = sum(t.resent // BLOCK_TOKENS * BLOCK_TOKENS for t in workload.turns)
    share = resent / workload.prompt_tokens
    assert share >= 0.5
    shares = predict_shares(workload.prompts, engine_blocks_for(workload), pool_blocks=128)
    assert shares.reusable == pytest.approx(share, abs=0.01)
    # vLLM's own small cache serves next to nothing; the pool and the fs tier both a lot.
    assert shares.engine <= 0.02
    assert shares.pool >= 0.2 and shares.fs >= 0.2
    assert shares.engine + shares.pool + shares.fs == pytest.approx(shares.reusable)
    everything = predict_shares(workload.prompts, engine_blocks_for(workload), pool_blocks=10**6)
    assert everything.fs == 0 and everything.pool == pytest.approx(shares.reusable, abs=0.02)


def test_predict_shares_small_case() -> None:
    a = list(range(100, 100 + 3 * BLOCK_TOKENS + 5))
    b = list(range(1000, 1000 + 3 * BLOCK_TOKENS + 5))
    a2 = [*a, 7, 8, 9]
    total = len(a) + len(b) + len(a2)
    # A big engine cache keeps a's 3 blocks.
    assert predict_shares([a, b, a2], engine_blocks=100, pool_blocks=100).engine == pytest.approx(
        3 * BLOCK_TOKENS / total
    )
    block = BLOCK_TOKENS / total
    # An engine cache of 5 blocks: b (4 blocks while it runs) evicts a's last two blocks (vLLM
    # frees a request's blocks tail first), so the pool serves those.
    s = predict_shares([a, b, a2], engine_blocks=5, pool_blocks=100)
    assert (s.engine, s.pool, s.fs) == (pytest.approx(block), pytest.approx(2 * block), 0)
    # 4 blocks: a is gone from vLLM's cache entirely.
    s = predict_shares([a, b, a2], engine_blocks=4, pool_blocks=100)
    assert (s.engine, s.pool, s.fs) == (0, pytest.approx(3 * block), 0)
    # A pool of 3 blocks holds only b: a comes back from the fs tier.
    s = predict_shares([a, b, a2], engine_blocks=4, pool_blocks=3)
    assert (s.engine, s.pool, s.fs) == (0, 0, pytest.approx(3 * block))
    # At most the full blocks before the last token: a prompt of exactly 3 blocks uses 2.
    exact = a[: 3 * BLOCK_TOKENS]
    s = predict_shares([exact, exact], engine_blocks=100, pool_blocks=100)
    assert s.reusable == pytest.approx(2 * BLOCK_TOKENS / (6 * BLOCK_TOKENS))


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        build_workload(requests=0)
    with pytest.raises(ValueError):
        build_workload(max_turns=1)


def test_model_sizes() -> None:
    demo = MODELS["demo"]
    assert demo.head_dim == 64 and demo.num_attention_heads % demo.num_key_value_heads == 0
    # 8 layers x (K, V) x 32 tokens x 4 heads x 64 x 4 bytes.
    assert demo.block_bytes == 8 * 2 * 32 * 4 * 64 * 4
    assert 40e6 < demo.parameters < 60e6
    assert demo.config()["hidden_size"] == 768


def test_write_model_matches_its_config(tmp_path: pytest.TempPathFactory) -> None:
    torch = require.importorskip("torch", "vllm")
    safetensors = require.importorskip("safetensors.torch", "vllm")
    from pathlib import Path

    from kvtier.demo import write_model

    size = MODELS["tiny"]
    directory = write_model(Path(str(tmp_path)) / "m", size)
    weights = safetensors.load_file(str(directory / "model.safetensors"))
    assert sum(w.numel() for w in weights.values()) == size.parameters
    again = safetensors.load_file(
        str(write_model(Path(str(tmp_path)) / "n", size) / "model.safetensors")
    )
    assert all(torch.equal(weights[k], again[k]) for k in weights)


def test_warmup_prompts_are_unrelated_and_fit(workload: Workload) -> None:
    prompts = warmup_prompts(workload, VOCAB)
    assert len(prompts) == 5
    assert max(map(len, prompts)) <= workload.max_prompt_tokens
    starts = {tuple(t.tokens[:BLOCK_TOKENS]) for t in workload.turns}
    assert not starts & {tuple(p[:BLOCK_TOKENS]) for p in prompts}
    # The last one re-sends the first with new tokens (exercises kvtier's load path).
    assert prompts[4][: len(prompts[0])] == prompts[0]


def test_delta_and_tier_summary() -> None:
    before = {"cache": {"lookup_blocks": 10, "hit_blocks": 2}, "tiers": {"fs": {"read_bytes": 5}}}
    after = {
        "cache": {
            "lookup_blocks": 110,
            "hit_blocks": 62,
            "loaded_blocks": 60,
            "stored_blocks": 50,
            "pool_evictions": 4,
        },
        "tiers": {"fs": {"read_bytes": 45, "write_bytes": 500}},
        "promoted": {"fs": 20},
        "pool_slots": 128,
        "connector": {"hit_tokens": 1920, "load_blocks_failed": 0},
    }
    d = delta(after, before)
    assert d["cache"]["lookup_blocks"] == 100 and d["cache"]["hit_blocks"] == 60
    assert d["tiers"]["fs"] == {"read_bytes": 40, "write_bytes": 500}
    s = tier_summary(d, block_bytes=1000)
    assert s["tiers"]["host pool"]["hit_blocks"] == 40
    assert s["tiers"]["host pool"]["hit_ratio"] == pytest.approx(0.4)
    assert s["tiers"]["fs"]["hit_ratio"] == pytest.approx(0.2)
    assert s["tiers"]["host pool"]["read_bytes"] == 60_000


def test_unbounded_engine_cache_serves_all_the_reuse(workload: Workload) -> None:
    blocks = unbounded_engine_blocks(workload)
    distinct = {
        t.tokens[: (b + 1) * BLOCK_TOKENS]
        for t in workload.turns
        for b in range(len(t.tokens) // BLOCK_TOKENS)
    }
    assert blocks == len(distinct) + engine_blocks_for(workload)
    shares = predict_shares(workload.prompts, blocks, pool_blocks=128)
    assert shares.engine == pytest.approx(shares.reusable)
    assert shares.pool == shares.fs == 0
