"""``python -m kvtier.demo``: vLLM (CPU build) with kvtier on a multi-turn workload.

The model
    A Llama-architecture model (``LlamaForCausalLM``) with seeded random weights, written locally
    as ``config.json`` + ``model.safetensors`` (nothing is downloaded; the weights are "dummy" in
    the sense of untrained, and the same in every run). The default size (hidden 768, 8 layers,
    12 query / 4 KV heads of 64, 53M parameters, float32) makes a prompt token cost well
    under a millisecond of prefill on 2 CPU cores, so the whole demo takes a few minutes, while
    prefill compute still dwarfs what kvtier does per engine step. ``tiny`` is for smoke tests.

The workload, derived from the bundled trace
    The bundled trace (Mooncake format, ``hash_ids`` of 512-token blocks) is synthetic: requests
    that start with the same block form a group sharing a long prefix (a document or a system
    prompt) and differ only in their last block(s), the question; the trace has hardly any
    explicit conversation chains. Each group becomes one conversation (groups of one request,
    or whose requests share no full block besides their last, have nothing to re-send and are
    skipped):

    * scale: one 512-token trace block becomes one 32-token block here; a block's token ids are
      drawn from a generator seeded by its hash id (equal ids, equal tokens), a partial last
      block keeps its share of the 32 tokens (``ceil(tokens / 16)``).
    * context: the blocks every used request of the group shares (at most all but each one's
      last block), cut to ``max_context_blocks``.
    * turn k (requests of the group in trace order, at most ``max_turns``): the question is
      request k's own blocks after the shared prefix. Turn 1 sends context + question 1; turn k
      re-sends turn k-1's whole prompt, then turn k-1's answer (``output_length / 16`` tokens,
      seeded by the request; it stands in for the reply a chat client sends back, since the
      demo only generates one token), then question k. Later turns thus start with everything
      earlier turns sent, which is the reuse a KV cache can exploit.

    ``concurrency`` conversations are open at a time; they take turns round robin, and a
    finished conversation's place goes to the next group of the trace. The replay is the first
    ``requests`` requests of that stream, so it never runs with fewer conversations open (at the
    end the last ones would otherwise send their turns back to back). Between two turns of a
    conversation the others send thousands of tokens, more than vLLM's deliberately small KV
    cache holds: its own prefix cache has evicted the conversation, and the reuse has to come
    from kvtier. :func:`predict_shares` predicts the shares from an LRU model of each cache.

The run
    The identical request sequence runs four times, each in a fresh engine warmed up with
    unrelated prompts of the workload's lengths (and one re-sent prompt, so the kvtier run has
    exercised its load path too): without kvtier; with kvtier (a host pool smaller than the
    conversations' working set, so blocks are found in the fs tier in a local folder and
    promoted back); with a vLLM KV cache big enough to keep every block (the best any cache can
    do: no evictions, no copies); and without kvtier again. The two baselines bracket the other
    runs, so a change of the machine's speed shows up as a gap between them instead of as a gain
    or loss of kvtier; the vLLM-cache-for-all run tells what kvtier's copies cost. Each request
    is sent alone with ``max_tokens=1`` (greedy): its time is its prefill, and its one output
    token must be the same in all runs. vLLM is imported only when the demo runs.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections import OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.policies import DEFAULT_EVICTION
from kvtier.sim.trace import TRACE_BLOCK_TOKENS, TraceRequest, bundled_trace_path, read_trace

BLOCK_TOKENS = 32
"""vLLM block size (the CPU attention kernel needs a multiple of 32); one trace block."""
SCALE = TRACE_BLOCK_TOKENS // BLOCK_TOKENS
"""Trace tokens per demo token."""
FIRST_TOKEN = 3
"""Token ids below this (pad, BOS, EOS) never appear in prompts."""


@dataclass(frozen=True, slots=True)
class ModelSize:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 64
    """64: one the CPU attention kernel supports."""
    vocab_size: int = 2048

    def config(self) -> dict[str, Any]:
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "bos_token_id": 1,
            "eos_token_id": 2,
        }

    @property
    def block_bytes(self) -> int:
        """float32 K and V of one 32-token block over all layers (one kvtier slot)."""
        per_layer = 2 * BLOCK_TOKENS * self.num_key_value_heads * self.head_dim * 4
        return self.num_hidden_layers * per_layer

    @property
    def parameters(self) -> int:
        h, q = self.hidden_size, self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        layer = 2 * h * q + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h
        return self.num_hidden_layers * layer + 2 * self.vocab_size * h + h


MODELS: dict[str, ModelSize] = {
    "demo": ModelSize(768, 2048, 8, 12, 4),
    "tiny": ModelSize(128, 256, 2, 2, 1),
}


def write_model(directory: Path, size: ModelSize, seed: int = 0) -> Path:
    """``config.json`` + ``model.safetensors`` with seeded random weights (same in every run).

    Each matrix is N(0, 1/fan_in), so activations stay of order one through the layers and the
    attention is spread over many positions: wrong KV bytes change the output.
    """
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(size.config(), indent=2))
    weights = llama_weights(size, seed)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def llama_weights(size: ModelSize, seed: int = 0) -> dict[str, Any]:
    """The seeded random ``LlamaForCausalLM`` state dict ``write_model`` saves (drawn in a fixed
    order from a CPU generator: the same tensors in every process)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = size.hidden_size, size.intermediate_size, size.vocab_size
    q_dim = size.num_attention_heads * size.head_dim
    kv_dim = size.num_key_value_heads * size.head_dim

    def rnd(rows: int, cols: int, std: float | None = None) -> Any:
        return torch.randn(rows, cols, generator=gen) * (cols**-0.5 if std is None else std)

    weights: dict[str, Any] = {"model.embed_tokens.weight": rnd(vocab, hidden, 1.0)}
    for i in range(size.num_hidden_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        weights[p + "self_attn.q_proj.weight"] = rnd(q_dim, hidden)
        weights[p + "self_attn.k_proj.weight"] = rnd(kv_dim, hidden)
        weights[p + "self_attn.v_proj.weight"] = rnd(kv_dim, hidden)
        weights[p + "self_attn.o_proj.weight"] = rnd(hidden, q_dim)
        weights[p + "mlp.gate_proj.weight"] = rnd(inter, hidden)
        weights[p + "mlp.up_proj.weight"] = rnd(inter, hidden)
        weights[p + "mlp.down_proj.weight"] = rnd(hidden, inter)
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = rnd(vocab, hidden)
    return weights


# -- the workload -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Turn:
    session: int
    """0-based, conversations numbered in the order the trace starts them."""
    turn: int
    """1-based."""
    trace_index: int
    """The trace request (0-based line) this turn is derived from."""
    tokens: tuple[int, ...]
    resent: int
    """Leading tokens that are the previous turn's prompt (0 for turn 1)."""


@dataclass(frozen=True, slots=True)
class Workload:
    turns: tuple[Turn, ...]
    """In the order they are sent."""
    concurrency: int

    @property
    def prompts(self) -> list[list[int]]:
        return [list(t.tokens) for t in self.turns]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(t.tokens) for t in self.turns)

    @property
    def max_prompt_tokens(self) -> int:
        return max((len(t.tokens) for t in self.turns), default=0)

    @property
    def sessions(self) -> int:
        return len({t.session for t in self.turns})


def block_tokens(hash_id: int, n: int, vocab: int) -> list[int]:
    """The first ``n`` token ids of the block with this trace hash id."""
    rng = random.Random(f"block:{hash_id}")
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)]


def answer_tokens(trace_index: int, output_length: int, vocab: int) -> list[int]:
    rng = random.Random(f"answer:{trace_index}")
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(math.ceil(output_length / SCALE))]


def trace_groups(trace: Sequence[TraceRequest], max_turns: int) -> Iterator[list[int]]:
    """Indices of the requests that start with the same block, at most ``max_turns`` of each,
    in trace order; groups are yielded in the order of their first request, and only when they
    have two requests or more (a single request has no later turn) that share at least one
    full block besides their last (one-block prompts would have no context to re-send)."""
    members: dict[int, list[int]] = {}
    for index, request in enumerate(trace):
        if request.hash_ids:
            members.setdefault(request.hash_ids[0], []).append(index)
    for group in members.values():
        if len(group) >= 2 and _shared_blocks(trace, group[:max_turns]) >= 1:
            yield group[:max_turns]


def _shared_blocks(trace: Sequence[TraceRequest], group: Sequence[int]) -> int:
    """Leading blocks all requests of the group share, leaving each at least its last one."""
    requests = [trace[i] for i in group]
    shared = min(len(r.hash_ids) for r in requests) - 1
    first = requests[0].hash_ids
    for r in requests[1:]:
        shared = next((k for k in range(shared) if r.hash_ids[k] != first[k]), shared)
    return shared


def _own_block_lengths(request: TraceRequest, first: int) -> list[int]:
    """Demo tokens of the request's blocks from ``first`` on (the last one may be partial)."""
    out = []
    for b in range(first, len(request.hash_ids)):
        trace_tokens = min(TRACE_BLOCK_TOKENS, request.input_length - b * TRACE_BLOCK_TOKENS)
        out.append(max(1, math.ceil(trace_tokens / SCALE)))
    return out


def conversation(
    trace: Sequence[TraceRequest], group: Sequence[int], max_context_blocks: int, vocab: int
) -> list[tuple[int, list[int], int]]:
    """The turns of one group: (trace index, prompt tokens, tokens re-sent from the last turn)."""
    requests = [trace[i] for i in group]
    shared = _shared_blocks(trace, group)
    first = requests[0].hash_ids
    history: list[int] = []
    for h in first[: min(shared, max_context_blocks)]:
        history.extend(block_tokens(h, BLOCK_TOKENS, vocab))
    turns: list[tuple[int, list[int], int]] = []
    resent = 0
    for index, request in zip(group, requests, strict=True):
        prompt = list(history)
        own = request.hash_ids[shared:]
        for h, n in zip(own, _own_block_lengths(request, shared), strict=True):
            prompt.extend(block_tokens(h, n, vocab))
        turns.append((index, prompt, resent))
        history = prompt + answer_tokens(index, request.output_length, vocab)
        resent = len(prompt)
    return turns


def interleave(
    sessions: Iterator[list[Any]], concurrency: int, limit: int
) -> list[tuple[int, Any]]:
    """Round robin over ``concurrency`` open sessions: (session number, item), ``limit`` items.

    A session that sent its last item makes room for the next one from ``sessions``; the stream
    stops at ``limit`` items or when no session is left to keep ``concurrency`` of them open.
    """
    out: list[tuple[int, Any]] = []
    started = 0
    open_: deque[tuple[int, list[Any], int]] = deque()

    def start() -> bool:
        nonlocal started
        items = next(sessions, None)
        if items is None:
            return False
        open_.append((started, items, 0))
        started += 1
        return True

    while len(open_) < concurrency and start():
        pass
    while open_ and len(out) < limit:
        number, items, k = open_.popleft()
        out.append((number, items[k]))
        if k + 1 < len(items):
            open_.append((number, items, k + 1))
        elif not start():
            break
    return out


def build_workload(
    requests: int = 64,
    concurrency: int = 4,
    max_turns: int = 4,
    max_context_blocks: int = 40,
    vocab: int = 2048,
    trace_path: Path | None = None,
) -> Workload:
    """The first ``requests`` turns of the interleaved conversations (see the module docstring)."""
    if requests < 1 or concurrency < 1 or max_turns < 2 or max_context_blocks < 0:
        raise ValueError("requests, concurrency >= 1, max_turns >= 2, max_context_blocks >= 0")
    trace = read_trace(trace_path or bundled_trace_path())
    sessions = (
        conversation(trace, group, max_context_blocks, vocab)
        for group in trace_groups(trace, max_turns)
    )
    turns = tuple(
        Turn(number, k + 1, index, tuple(tokens), resent)
        for number, (k, (index, tokens, resent)) in interleave(
            (list(enumerate(s)) for s in sessions), concurrency, requests
        )
    )
    return Workload(turns, concurrency)


# -- what the caches can serve, by an LRU model -------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shares:
    """Shares of the prompt tokens each cache would serve (LRU model, 32-token blocks)."""

    reusable: float
    """In full blocks an earlier prompt already had: what an unbounded cache serves."""
    engine: float
    """Served by vLLM's own prefix cache of ``engine_blocks``."""
    pool: float
    """Served by the host pool of ``pool_blocks`` (after the engine's hits)."""
    fs: float
    """Served by the fs tier (unbounded): the rest of the reusable blocks."""


class _BlockIds:
    """One id per full block, standing for the whole prefix up to it (as the engines chain
    their block hashes): equal ids, equal prefixes."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int, tuple[int, ...]], int] = {}

    def __call__(self, tokens: Sequence[int]) -> list[int]:
        out: list[int] = []
        parent = -1
        for b in range(len(tokens) // BLOCK_TOKENS):
            block = tuple(tokens[b * BLOCK_TOKENS : (b + 1) * BLOCK_TOKENS])
            parent = self._ids.setdefault((parent, block), len(self._ids))
            out.append(parent)
        return out

    def __len__(self) -> int:
        return len(self._ids)


def predict_shares(
    prompts: Sequence[Sequence[int]], engine_blocks: int, pool_blocks: int
) -> Shares:
    """Replay the prompts through an LRU model of vLLM's prefix cache, the host pool and an
    unbounded fs tier, each request alone, as the demo sends them.

    Like the engines, a request can use at most its full blocks before its last token; vLLM also
    needs blocks for the request's own partial block and generated token while it runs.
    """
    engine: OrderedDict[int, None] = OrderedDict()
    pool: OrderedDict[int, None] = OrderedDict()
    fs: set[int] = set()
    block_ids = _BlockIds()
    total = served_reuse = served_engine = served_pool = served_fs = 0
    seen: set[int] = set()
    for tokens in prompts:
        keys = block_ids(tokens)
        usable = keys[: (len(tokens) - 1) // BLOCK_TOKENS]
        total += len(tokens)
        served_reuse += BLOCK_TOKENS * _leading(usable, seen)
        e = _leading(usable, engine)
        for key in usable[:e]:
            engine.move_to_end(key)
        p = f = 0
        for key in usable[e:]:
            if key in pool:
                p += 1
                pool.move_to_end(key)
            elif key in fs:
                f += 1
                pool[key] = None  # promoted
            else:
                break
        served_engine += BLOCK_TOKENS * e
        served_pool += BLOCK_TOKENS * p
        served_fs += BLOCK_TOKENS * f
        # vLLM: the request's blocks (hits reused, the rest allocated by evicting cold ones).
        needed = -(-(len(tokens) + 1) // BLOCK_TOKENS)
        hit = set(usable[:e])
        while engine and len(engine) - len(hit) + needed > engine_blocks:
            victim = next(k for k in engine if k not in hit)
            del engine[victim]
        for key in reversed(keys):  # vLLM frees a request's blocks tail first
            engine[key] = None
            engine.move_to_end(key)
        # kvtier stores every full prompt block (write-through to fs).
        for key in keys:
            pool[key] = None
            pool.move_to_end(key)
            fs.add(key)
            seen.add(key)
        while len(pool) > pool_blocks:
            pool.popitem(last=False)
        while len(engine) > engine_blocks:
            engine.popitem(last=False)
    n = max(total, 1)
    return Shares(served_reuse / n, served_engine / n, served_pool / n, served_fs / n)


def _leading(keys: Sequence[int], present: Any) -> int:
    n = 0
    for key in keys:
        if key not in present:
            break
        n += 1
    return n


# -- engine and kvtier settings -----------------------------------------------------------------


def engine_blocks_for(workload: Workload) -> int:
    """vLLM's KV cache: room for the longest request (what vLLM insists on) plus one block."""
    return -(-(workload.max_prompt_tokens + 1) // BLOCK_TOKENS) + 1


def unbounded_engine_blocks(workload: Workload) -> int:
    """A vLLM KV cache that never evicts a block of the workload: every distinct full block,
    plus room for the longest request while it runs."""
    block_ids = _BlockIds()
    for t in workload.turns:
        block_ids(t.tokens)
    return len(block_ids) + engine_blocks_for(workload)


def kvtier_config(
    workdir: Path,
    pool_bytes: int,
    stats_path: Path,
    eviction: str = DEFAULT_EVICTION,
    fs_tier: bool = True,
    promotion_costs: bool = True,
) -> dict[str, Any]:
    """The embedded default: a host pool (evicting by ``eviction``) and an fs tier
    (write-through) in ``workdir/fs``; without ``fs_tier`` the host pool alone.
    ``promotion_costs``: ``pool.promotion_costs``."""
    tiers = [{"kind": "fs", "path": str(workdir / "fs"), "capacity": "8GiB"}] if fs_tier else []
    return {
        "pool": {"size": pool_bytes, "promotion_costs": promotion_costs},
        "eviction": eviction,
        "tiers": tiers,
        "vllm": {"stats_path": str(stats_path)},
    }


def prepare_env() -> None:
    """Offline, no telemetry, the engine core in this process (faster start, and the demo reads
    the connector's counters after each request)."""
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # vLLM's start-up INFO and WARNING lines would bury the demo's report.
        "VLLM_LOGGING_LEVEL": "ERROR",
    }.items():
        os.environ.setdefault(key, value)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # kv_cache_memory_bytes decides
