"""A trace replay with an engine's timing, through the real ``TieredCache`` (host pool only).

``kvtier simulate`` stores all of a request's blocks at once and hints the policy right after: its
requests do not overlap. An engine does neither. vLLM stores a request's blocks step by step
during its prefill, tells the policy about the request only when it finished (with other requests'
blocks stored in between when several are in flight), and finishes a request in the same step as
its last store completes, the finish first. ``EngineTiming`` reproduces those orders on a trace,
so a policy that depends on when its hints come can be measured as an engine would drive it.
"""

from __future__ import annotations

import tempfile
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.cache.manager import TieredCache
from kvtier.keys import BlockKey, keys_from_hashes
from kvtier.policies import make_policy
from kvtier.policies.hints import RequestHint
from kvtier.pool import HostPool
from kvtier.sim.simulate import simulation_namespace
from kvtier.sim.trace import TraceRequest


@dataclass(slots=True, frozen=True)
class EngineTiming:
    hint_lag: int = 0
    """The hint of request i comes after the stores of request i + ``hint_lag`` (requests in
    flight at once, minus one)."""
    store_chunk: int = 0
    """Blocks per store (one engine step's worth of prefill); 0: the whole request at once."""
    hint_first: bool = False
    """Hints that are due are given before the request's last store completed (vLLM finishes a
    request before it collects that step's finished stores)."""

    def __post_init__(self) -> None:
        if self.hint_lag < 0 or self.store_chunk < 0:
            raise ValueError(f"hint_lag and store_chunk must be >= 0, got {self}")


def engine_hit_ratio(
    requests: Sequence[TraceRequest],
    eviction: str,
    capacity_blocks: int,
    timing: EngineTiming,
) -> float:
    """The pool's prefix hit ratio (hit blocks / blocks asked for) of ``requests`` under ``timing``,
    evicting by ``eviction`` in a pool of ``capacity_blocks`` blocks."""
    from kvtier.config import bundled_config_mapping, parse_config

    namespace = simulation_namespace(parse_config(bundled_config_mapping()))
    ids = list(dict.fromkeys(h for r in requests for h in r.hash_ids))
    key_of = dict(zip(ids, keys_from_hashes(namespace, ids), strict=True))
    with tempfile.TemporaryDirectory(prefix="kvtier-engine-timing-") as shm_dir:
        pool = HostPool.create(capacity_blocks, 64, shm_dir)
        cache = TieredCache(pool, make_policy(eviction, capacity_blocks), record_events=False)
        try:
            hits = blocks = 0
            due: deque[tuple[int, list[BlockKey], RequestHint]] = deque()
            for index, request in enumerate(requests):
                keys = [key_of[h] for h in request.hash_ids]
                found = cache.lookup(keys).hits
                if found:
                    loaded = cache.prepare_load(keys[:found])
                    cache.complete_load(keys[:found][: len(loaded)])
                hits += found
                blocks += len(keys)
                due.append((index, keys, RequestHint(found, request.output_length)))
                chunk = timing.store_chunk or max(1, len(keys))
                starts = range(0, len(keys), chunk)
                for start in starts:
                    reserved = cache.prepare_store(keys[start : start + chunk]).keys
                    last = start == starts[-1]
                    if last and timing.hint_first:
                        _give_due(cache, due, index - timing.hint_lag)
                    cache.complete_store(reserved)
                if not timing.hint_first:
                    _give_due(cache, due, index - timing.hint_lag)
            _give_due(cache, due, len(requests))
            cache.check_invariants()
            return hits / blocks if blocks else 0.0
        finally:
            cache.close()
            pool.close()


def _give_due(
    cache: TieredCache, due: deque[tuple[int, list[BlockKey], RequestHint]], up_to: int
) -> None:
    """Hint every queued request with index <= ``up_to``, oldest first."""
    while due and due[0][0] <= up_to:
        _, keys, hint = due.popleft()
        cache.hint_request(keys, hint)
