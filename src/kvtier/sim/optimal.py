"""The offline optimum of the prefix hit model: an upper bound for every online policy.

The hit model: a request hits on the leading run of its blocks that are cached; afterwards each of
its blocks may be stored (storing is optional: a cache may bypass a block). The cache holds at most
``capacity_blocks`` blocks.

The optimum is Belady's rule with bypass, run over the blocks of all requests in order: a block
that must be stored while the cache is full replaces the cached block whose next use is farthest
in the future, or is not stored at all when its own next use is the farthest; a block never used
again is never stored. Ties are broken towards the deeper block (its position in its request).

Why it is exact for the prefix model, not only for per-block hits:

* Per-block hits (a block counts when cached, whatever its prefix) bound prefix hits from above
  for any schedule, and Belady with bypass maximises per-block hits (uniform block sizes).
* Block ids are prefix-aware (the id of block ``i`` depends on blocks ``0..i``), so every request
  that uses a block also uses its parent, earlier: the parent's next use is never later than the
  child's. With ties broken towards the deeper block, a block is evicted only when no cached
  descendant remains, and a child is never stored when its parent was bypassed: the cache stays
  closed under prefixes. Its per-block hits are then exactly leading runs, i.e. prefix hits.
* Its cache between two requests is a subset of the previous cache and the request's blocks, of at
  most ``capacity_blocks`` blocks: a schedule the prefix model allows.

So its prefix hits equal the per-block optimum, which bounds every prefix schedule. The
brute-force test in ``tests/sim/test_optimal.py`` checks this on small traces. A trace whose ids
are not prefix-aware (one id under two different parents) breaks the argument: ``optimal_hit_ratio``
reports it in ``prefix_consistent``.

Cost: one heap operation per stored or touched block, about 1 s per million blocks.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.sim.trace import TraceRequest

OPTIMAL_POLICY = "optimal"
"""``kvtier simulate --policy optimal``: this bound instead of a replay."""


@dataclass(frozen=True, slots=True)
class OptimalResult:
    """The bound for one capacity. ``hit_ratio`` = ``hit_blocks`` / ``blocks``."""

    capacity_blocks: int
    requests: int
    blocks: int
    hit_blocks: int
    hit_ratio: float
    stored_blocks: int
    """Blocks the optimum stored (the rest were bypassed or already cached)."""
    prefix_consistent: bool
    """Every id appeared under one parent: the bound is exact for the prefix model."""


def next_uses(hash_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """For each request and position, the index of the next request using that block again
    (``len(hash_ids)`` when never)."""
    never = len(hash_ids)
    last: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in hash_ids]
    for t in range(len(hash_ids) - 1, -1, -1):
        ids = hash_ids[t]
        out[t] = [last.get(b, never) for b in ids]
        for b in ids:
            last[b] = t
    return out


def optimal_hit_ratio(
    requests: Sequence[TraceRequest] | Sequence[Sequence[int]], capacity_blocks: int
) -> OptimalResult:
    """The offline optimum's prefix hits for ``requests`` (trace requests or lists of block ids)
    with a cache of ``capacity_blocks`` blocks."""
    if capacity_blocks < 0:
        raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
    ids: list[Sequence[int]] = [r.hash_ids if isinstance(r, TraceRequest) else r for r in requests]
    nxt = next_uses(ids)
    never = len(ids)
    cached: dict[int, tuple[int, int]] = {}
    """Cached block -> (next use, depth): its current entry in the heap."""
    heap: list[tuple[int, int, int]] = []
    """(-next use, -depth, block): the top is the block to evict; stale entries are skipped."""
    parent: dict[int, int] = {}
    consistent = True
    hits = blocks = stored = 0
    for t, hash_ids in enumerate(ids):
        blocks += len(hash_ids)
        run = 0
        for b in hash_ids:
            if b not in cached:
                break
            run += 1
        hits += run
        uses = nxt[t]
        prev = -1
        for depth, b in enumerate(hash_ids):
            if parent.setdefault(b, prev) != prev:
                consistent = False
            prev = b
            nu = uses[depth]
            if b in cached:
                cached[b] = (nu, depth)
                heapq.heappush(heap, (-nu, -depth, b))
                continue
            if nu == never or capacity_blocks == 0:
                continue  # never used again: storing it cannot help
            if len(cached) >= capacity_blocks:
                while True:
                    top_nu, top_depth, top = heap[0]
                    if cached.get(top) == (-top_nu, -top_depth):
                        break
                    heapq.heappop(heap)
                if (nu, depth) > (-top_nu, -top_depth):
                    continue  # bypass: this block is the one used farthest in the future
                heapq.heappop(heap)
                del cached[top]
            cached[b] = (nu, depth)
            heapq.heappush(heap, (-nu, -depth, b))
            stored += 1
        if len(heap) > 4 * len(cached) + 1024:
            # Drop stale entries so the heap stays proportional to the cache.
            heap = [(-v[0], -v[1], k) for k, v in cached.items()]
            heapq.heapify(heap)
    return OptimalResult(
        capacity_blocks=capacity_blocks,
        requests=len(ids),
        blocks=blocks,
        hit_blocks=hits,
        hit_ratio=hits / blocks if blocks else 0.0,
        stored_blocks=stored,
        prefix_consistent=consistent,
    )


def infinite_hit_ratio(requests: Sequence[TraceRequest] | Sequence[Sequence[int]]) -> float:
    """Prefix hit ratio of a cache that keeps every block (the ceiling of any capacity)."""
    seen: set[int] = set()
    hits = blocks = 0
    for r in requests:
        hash_ids = r.hash_ids if isinstance(r, TraceRequest) else r
        blocks += len(hash_ids)
        for b in hash_ids:
            if b not in seen:
                break
            hits += 1
        seen.update(hash_ids)
    return hits / blocks if blocks else 0.0


def format_optimal(result: OptimalResult, trace_name: str, concurrency: int | None = None) -> str:
    """The bound as ``kvtier simulate`` prints it, labelled as a bound (``concurrency``: the
    conversations in flight the trace was reordered for)."""
    exact = (
        "exact for the prefix hit model"
        if result.prefix_consistent
        else "ids are not prefix-aware: an upper bound on per-block hits only"
    )
    return "\n".join(
        [
            f"trace       {trace_name}: {result.requests} requests, {result.blocks} blocks"
            + (f", {concurrency} conversations in flight" if concurrency else ""),
            f"pool        {result.capacity_blocks} blocks, policy optimal "
            "(OFFLINE BOUND: knows the future; no online policy reaches it)",
            f"bound       {exact}",
            f"hit ratio   {result.hit_ratio:.4f} ({result.hit_blocks} of {result.blocks} blocks), "
            f"stored {result.stored_blocks} blocks",
        ]
    )
