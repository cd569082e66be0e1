"""Predicted host-pool hits of a hybrid benchmark model: kvtier's pool and vLLM's own CPU
offloading (``native``), each an LRU pool of the same host bytes, replaying the benchmark's
prompts in the order ``kvtier simulate --concurrency N`` sends a trace's conversations
(``kvtier.sim.conversations.schedule``: N conversations in flight, round robin, a finished one
replaced by the next). vLLM's GPU prefix cache is left out (it holds about 2.5 requests by
default): the figures say whether a pool holds the conversations between their turns.

Both pools count in vLLM blocks of one KV cache group (``vllm_bench_kv.KVPool.block_bytes``:
a kvtier slot, and a native CPU block at vLLM's default offloaded block size, are one such
block). Per request, as each connector does (read from kvtier's ``engine/hybrid.py`` and vLLM
0.25.1's ``offloading/scheduler.py``):

* kvtier: a lookup takes the leading blocks every full-attention group has, then needs each
  window group's ``need`` blocks (a state group's one block) before that boundary, stepping back
  to the first one missing; the loaded blocks are touched. It stores the prompt's whole blocks
  of the full-attention groups (present ones touched) and each window or state group's blocks
  before the prompt's end, the block before it where the prompt ends on a block boundary, and
  every ``auto_boundary_blocks`` blocks (``groups.window_tail``), none before what the engine
  still holds (``window - 1`` tokens before the resume).
* native: the longest prefix every full-attention group has, then the last run of a window's
  blocks (``cdiv(window, block)``; one for a Mamba group) before it in each other group, until
  the boundary holds for all; it stores every block of every group past the hit, generated
  tokens included, and touches the request's full-attention keys and each other group's keys
  from a window before the hit.

Generated tokens never match the next turn's prompt (dummy weights): they only fill the pool.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_bench_kv import KVPool, cdiv

from kvtier.engine.groups import auto_boundary_blocks, window_blocks, window_tail
from kvtier.sim.conversations import schedule
from kvtier.sim.trace import TraceRequest

Key = tuple[int, int]
"""(group, chain id of the block): the pool's key of one group's block."""


class LRU:
    """A pool of ``capacity`` blocks, least recently used evicted first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._order: OrderedDict[Key, None] = OrderedDict()
        self.evictions = 0

    def __contains__(self, key: Key) -> bool:
        return key in self._order

    def touch(self, keys: Iterable[Key]) -> None:
        for key in keys:
            if key in self._order:
                self._order.move_to_end(key)

    def store(self, keys: Iterable[Key]) -> None:
        for key in keys:
            if key in self._order:
                self._order.move_to_end(key)
                continue
            self._order[key] = None
            if len(self._order) > self.capacity:
                self._order.popitem(last=False)
                self.evictions += 1


@dataclass(frozen=True, slots=True)
class Groups:
    """The model's groups as the connectors see them: group ids of each kind."""

    full: tuple[int, ...]
    window: tuple[int, ...]
    state: tuple[int, ...]
    window_tokens: int

    @classmethod
    def of(cls, pool: KVPool) -> Groups:
        ids = iter(range(pool.groups))
        full = tuple(next(ids) for _ in range(pool.full_groups))
        window = tuple(next(ids) for _ in range(pool.window_groups))
        state = tuple(next(ids) for _ in range(pool.state_groups))
        return cls(full, window, state, pool.window)

    def tails(self, block: int, native: bool) -> list[tuple[int, int]]:
        """(group, blocks a resume needs before its boundary) of each window and state group."""
        if native:
            win = cdiv(self.window_tokens, block) if self.window else 0
        else:
            win = window_blocks(self.window_tokens, block) if self.window else 0
        return [(g, win) for g in self.window] + [(g, 1) for g in self.state]


def chains(prompts: Sequence[Sequence[int]], block: int) -> list[list[int]]:
    """Each prompt's whole blocks as prefix ids: equal ids, equal prefixes."""
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    out = []
    for prompt in prompts:
        parent, chain = -1, []
        for b in range(len(prompt) // block):
            parent = ids.setdefault((parent, tuple(prompt[b * block : (b + 1) * block])), len(ids))
            chain.append(parent)
        out.append(chain)
    return out


def order(turns: Sequence[int], concurrency: int) -> list[int]:
    """Request indices (conversation by conversation, each's turns in order; ``turns``: each
    conversation's count) in the order ``kvtier simulate --concurrency`` sends them."""
    trace: list[TraceRequest] = []
    for index, count in enumerate(turns):
        trace.extend(TraceRequest(0.0, 0, 0, (index,)) for _ in range(count))
    return schedule(trace, concurrency)


def full_hits(pool: LRU, groups: Groups, chain: list[int], tokens: int, block: int) -> int:
    """The leading blocks every full-attention group has (at least one token left to compute)."""
    limit = min((tokens - 1) // block, len(chain))
    hit = 0
    while hit < limit and all((g, chain[hit]) in pool for g in groups.full):
        hit += 1
    return hit


def kvtier_request(pool: LRU, groups: Groups, chain: list[int], tokens: int, block: int) -> int:
    """One request through kvtier's pool: the blocks it resumes at."""
    hit = full_hits(pool, groups, chain, tokens, block)
    tails = groups.tails(block, native=False)
    end = hit
    while end > 0:
        need = [(g, b) for g, n in tails for b in range(max(0, end - n), end)]
        missing = next((b for g, b in need if (g, chain[b]) not in pool), None)
        if missing is None:
            break
        end = missing
    pool.touch((g, chain[b]) for b in range(end) for g in groups.full)
    pool.touch((g, chain[b]) for g, n in tails for b in range(max(0, end - n), end))
    full = len(chain)
    pool.store((g, chain[b]) for b in range(full) for g in groups.full)
    whole = full * block == tokens
    for g, n in tails:
        every = auto_boundary_blocks(n)
        live = max(0, end * block - (groups.window_tokens - 1 if g in groups.window else 1))
        blocks = [b for b in window_tail(0, full, n, every, whole) if b >= live // block]
        pool.store((g, chain[b]) for b in blocks)
    return end


def native_request(
    pool: LRU, groups: Groups, chain: list[int], tokens: int, block: int, junk: list[int]
) -> int:
    """One request through vLLM's OffloadingConnector (LRU CPU tier): the blocks it resumes at.
    ``junk``: chain ids for its generated tokens' blocks (never looked up again)."""
    hit = full_hits(pool, groups, chain, tokens, block)
    tails = groups.tails(block, native=True)
    changed = True
    while changed and hit > 0:
        changed = False
        for g, n in tails:
            run, end = 0, 0
            for b in range(hit - 1, -1, -1):
                run = run + 1 if (g, chain[b]) in pool else 0
                if run == n:
                    end = b + n
                    break
            if end < hit:
                hit, changed = end, True
    blocks = chain + junk
    pool.touch((g, blocks[b]) for b in range(len(blocks)) for g in groups.full)
    start = max(0, hit - max((n for _, n in tails), default=0))
    pool.touch((g, blocks[b]) for g, _ in tails for b in range(start, len(blocks)))
    every = [*groups.full, *(g for g, _ in tails)]
    pool.store((g, blocks[b]) for b in range(hit, len(blocks)) for g in every)
    return hit


@dataclass(frozen=True, slots=True)
class Prediction:
    style: str
    pool_blocks: int
    hit_tokens: int
    prompt_tokens: int
    hit_requests: int
    evictions: int

    def as_dict(self) -> dict[str, int | float | str]:
        share = round(self.hit_tokens / self.prompt_tokens, 3) if self.prompt_tokens else 0.0
        return {
            "pool_blocks": self.pool_blocks,
            "hit_tokens": self.hit_tokens,
            "hit_share": share,
            "hit_requests": self.hit_requests,
            "evictions": self.evictions,
        }


def predict(
    conversations: Sequence[Sequence[Sequence[int]]],
    concurrency: int,
    pool: KVPool,
    host_bytes: int,
    max_tokens: int,
) -> dict[str, Prediction]:
    """kvtier's and native's predicted pool hits (see the module docstring); ``conversations``
    hold each conversation's prompts in turn order."""
    flat = [p for turns in conversations for p in turns]
    block = pool.block_tokens
    ids = chains(flat, block)
    groups = Groups.of(pool)
    capacity = host_bytes // pool.block_bytes
    sequence = order([len(t) for t in conversations], concurrency)
    out: dict[str, Prediction] = {}
    for style in ("kvtier", "native"):
        lru, hits, requests = LRU(capacity), 0, 0
        next_junk = -1
        for i in sequence:
            tokens = len(flat[i])
            if style == "kvtier":
                end = kvtier_request(lru, groups, ids[i], tokens, block)
            else:
                extra = (tokens + max_tokens) // block - len(ids[i])
                junk = list(range(next_junk, next_junk - extra, -1))
                next_junk -= extra
                end = native_request(lru, groups, ids[i], tokens, block, junk)
            hits += end * block
            requests += end > 0
        total = sum(len(p) for p in flat)
        out[style] = Prediction(style, capacity, hits, total, requests, lru.evictions)
    return out


def summary(
    conversations: Sequence[Sequence[Sequence[int]]],
    concurrency: int,
    pool: KVPool,
    host_gib: float,
    max_tokens: int,
) -> dict[str, Any]:
    """``predict`` for ``host_gib`` GiB, as the benchmark's JSON keeps it (``prediction``)."""
    found = predict(conversations, concurrency, pool, int(host_gib * (1 << 30)), max_tokens)
    out: dict[str, Any] = {style: p.as_dict() for style, p in found.items()}
    out["concurrency"], out["host_gib"] = concurrency, host_gib
    return out


def print_hybrid(data: dict[str, Any]) -> None:
    """A hybrid model's predicted pool hits and kvtier's bytes per cached token, from the
    benchmark's JSON."""
    prediction = data.get("prediction")
    if prediction:
        print(
            f"predicted pool hits ({prediction['concurrency']} in flight, "
            f"{prediction['host_gib']:g} GiB, vllm_bench_hits, GPU prefix cache left out):"
        )
        for style in ("kvtier", "native"):
            p = prediction.get(style, {})
            print(
                f"  {style:<7} {p.get('hit_tokens', 0):>9,} tokens ({p.get('hit_share', 0):.3f} "
                f"of the prompts), {p.get('hit_requests', 0)} requests, "
                f"{p.get('evictions', 0):,} evictions of {p.get('pool_blocks', 0):,} blocks"
            )
    for name, row in data.get("configs", {}).items():
        per_kind = row.get("kvtier_bytes_per_token")
        if not per_kind:
            continue
        kinds = ", ".join(f"{kind} {b:,.0f}" for kind, b in per_kind.items())
        print(
            f"{name} bytes per cached token: {kinds}; total {sum(per_kind.values()):,.0f} = "
            f"{row.get('kvtier_bytes_per_token_ratio', 0):.3f} of full attention in every layer "
            f"({row.get('full_attention_bytes_per_token', 0):,})"
        )
