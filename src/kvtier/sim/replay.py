"""Trace replay through the real manager (``TieredCache``), not a model of it.

Per request: ``lookup`` its keys (stepping and asking again while a promotion from a secondary tier
is pending), pin and "load" the leading run of hits (``prepare_load`` / ``complete_load``, checking
every loaded payload), then ``prepare_store`` all its keys and write a payload derived from each key
into the reserved slots (``complete_store``). A payload that comes back different from what was
written for its key is counted as a mismatch: the replay's correctness check, which must stay 0.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.cache.manager import TieredCache
from kvtier.keys import BlockKey, Namespace, keys_from_hashes
from kvtier.metrics import TierCounters
from kvtier.policies.hints import RequestHint
from kvtier.pool import HostPool
from kvtier.sim.trace import TraceRequest

POOL_TIER = "pool"

log = logging.getLogger(__name__)


def payload_for(key: BlockKey, size: int) -> bytes:
    """The deterministic payload the replay stores for ``key`` (the key repeated)."""
    reps = -(-size // len(key))
    return (key * reps)[:size]


@dataclass(slots=True)
class TierResult:
    """What one tier did during the replay. ``name`` is ``pool`` for the host pool."""

    name: str
    kind: str
    write: str = ""
    """``through`` or ``on_evict`` for a secondary tier."""
    capacity_blocks: int | None = None
    """Blocks of ``block.bytes`` the tier may hold (None: bounded elsewhere, e.g. Redis)."""
    hit_blocks: int = 0
    """Blocks of lookups served from this tier (for a secondary tier: promoted, then loaded)."""
    hit_ratio: float = 0.0
    """``hit_blocks`` / all looked-up blocks of the trace."""
    evictions: int = 0
    read_blocks: int = 0
    written_blocks: int = 0
    read_bytes: int = 0
    """Logical bytes (``block.bytes`` per block) read from this tier."""
    written_bytes: int = 0
    errors: int = 0
    corrupt: int = 0
    timeouts: int = 0
    rejected: int = 0


@dataclass(slots=True)
class ReplayResult:
    trace: str
    requests: int = 0
    blocks: int = 0
    """All blocks looked up (the sum of every request's ``hash_ids``)."""
    hit_blocks: int = 0
    """Blocks loaded from the cache, whatever the tier."""
    hit_ratio: float = 0.0
    stored_blocks: int = 0
    """Blocks written into reserved pool slots (keys not yet present and admitted)."""
    tiers: list[TierResult] = field(default_factory=list)
    mismatched_blocks: int = 0
    """Loaded payloads that differ from what was stored for their key: must be 0."""
    failed_loads: int = 0
    """Hit blocks that ``prepare_load`` could no longer pin (evicted between lookup and load)."""
    pending_timeouts: int = 0
    """Lookups still pending after ``pending_timeout_s``; the hits known by then were used."""
    drain_timeouts: int = 0
    """Times tier jobs did not end within ``pending_timeout_s`` after a request."""
    manager_ops: int = 0
    """Calls of lookup, prepare_load, complete_load, prepare_store, complete_store, hint_request."""
    elapsed_s: float = 0.0
    """Wall time of the replay loop (payload writes and checks included)."""
    ops_per_s: float = 0.0
    """``manager_ops`` per wall second."""
    manager_s: float = 0.0
    """Time spent inside the manager's calls (``step`` included)."""
    manager_ops_per_s: float = 0.0
    """``manager_ops`` per second spent inside the manager."""
    blocks_per_s: float = 0.0
    """Looked-up blocks per wall second."""
    overlap: bool = False
    """Whether requests went on while tier jobs ran (see ``Replayer.overlap``)."""
    pool_blocks: int = 0
    payload_bytes: int = 0
    """Real bytes per pool slot in this replay."""
    block_bytes: int = 0
    """Logical bytes per block, for bytes moved (``block.bytes`` of the config)."""
    policy: str = ""
    admission_min_seen: int = 1
    concurrency: int = 0
    """Conversations in flight the trace was reordered for (0: trace order)."""
    cache: dict[str, Any] = field(default_factory=dict)
    """The manager's own counters at the end (``CacheStats.to_dict()``)."""
    machine: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def machine_description() -> str:
    """CPU model, core count, OS and Python version of this machine."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}"
    )


class Replayer:
    """Replays requests through ``cache`` (over ``pool``); one instance per replay."""

    def __init__(
        self,
        cache: TieredCache,
        pool: HostPool,
        namespace: Namespace,
        *,
        tier_labels: dict[str, tuple[str, str]] | None = None,
        block_bytes: int | None = None,
        pending_timeout_s: float = 60.0,
        overlap: bool = False,
        trace_name: str = "",
    ) -> None:
        self.cache = cache
        self.pool = pool
        self.namespace = namespace
        self.tier_labels = dict(tier_labels or {})
        """Secondary tier name -> (kind, write mode), for the result."""
        self.block_bytes = block_bytes if block_bytes is not None else pool.slot_bytes
        self.pending_timeout_s = pending_timeout_s
        self.overlap = overlap
        """False: finish every tier job (cascades) before the next request, as if requests were
        far apart, so results do not depend on tier speed. True: go on at once, as fast as the
        manager allows (stores are skipped while the pool is full of blocks being written)."""
        self.result = ReplayResult(
            trace=trace_name,
            pool_blocks=pool.num_slots,
            payload_bytes=pool.slot_bytes,
            block_bytes=self.block_bytes,
            overlap=overlap,
        )
        self.tier_capacity_blocks: dict[str, int] = {}
        """Secondary tier name -> capacity in blocks of ``block_bytes``, for the result."""
        self._secondary_hits: dict[str, int] = dict.fromkeys(self.tier_labels, 0)
        self._stuck_jobs = 0

    # -- payloads (a test may override these to inject wrong data) ------------------------------

    def write_payload(self, key: BlockKey, slot: int) -> None:
        self.pool.view(slot)[:] = payload_for(key, self.pool.slot_bytes)

    def payload_ok(self, key: BlockKey, slot: int) -> bool:
        return self.pool.view(slot) == payload_for(key, self.pool.slot_bytes)

    # -- the replay -----------------------------------------------------------------------------

    def run(
        self,
        requests: Sequence[TraceRequest],
        on_request: Callable[[], object] | None = None,
    ) -> ReplayResult:
        """Replay ``requests`` in order; ``on_request`` is called after each (progress bars)."""
        # Keys are derived once per distinct hash id, outside the timed loop: hashing is the
        # engine adapter's cost, not the manager's.
        ids = list(dict.fromkeys(h for request in requests for h in request.hash_ids))
        key_of = dict(zip(ids, keys_from_hashes(self.namespace, ids), strict=True))
        start = time.perf_counter()
        for request in requests:
            self.replay_one([key_of[h] for h in request.hash_ids], request.output_length)
            if on_request is not None:
                on_request()
        # Let write-through cascades of the last requests finish, so the counters are complete.
        self._drain()
        self.result.elapsed_s = time.perf_counter() - start
        return self.finish()

    def replay_one(self, keys: list[BlockKey], output_tokens: int | None = None) -> int:
        """One request: lookup, load the hit run, store all, then hint the policy with what an
        engine knows once the request finished (its hit run, ``output_tokens`` when given).
        Returns the blocks loaded."""
        cache, r, clock = self.cache, self.result, time.perf_counter
        r.requests += 1
        r.blocks += len(keys)
        promoted_before = self._promoted()
        t0 = clock()
        found = cache.lookup(keys)
        spent = clock() - t0
        r.manager_ops += 1
        if not found.final:
            deadline = time.monotonic() + self.pending_timeout_s
            while not found.final:
                if time.monotonic() > deadline:
                    r.pending_timeouts += 1
                    break
                if not cache.wait(0.05) and not cache.jobs_in_flight:
                    time.sleep(0.001)  # a tier cannot tell yet and runs no job: do not spin
                t0 = clock()
                found = cache.lookup(keys)
                spent += clock() - t0
                r.manager_ops += 1
        loaded = 0
        if found.hits:
            hit_keys = keys[: found.hits]
            t0 = clock()
            slots = cache.prepare_load(hit_keys)
            spent += clock() - t0
            loaded = len(slots)
            mismatches = sum(
                not self.payload_ok(key, slot) for key, slot in zip(hit_keys, slots, strict=False)
            )
            t0 = clock()
            cache.complete_load(hit_keys[:loaded], ok=mismatches == 0)
            spent += clock() - t0
            r.manager_ops += 2
            r.mismatched_blocks += mismatches
            r.failed_loads += found.hits - loaded
            r.hit_blocks += loaded
            self._attribute(promoted_before, loaded)
        t0 = clock()
        reservation = cache.prepare_store(keys)
        spent += clock() - t0
        for key, slot in zip(reservation.keys, reservation.slots, strict=True):
            self.write_payload(key, slot)
        t0 = clock()
        cache.complete_store(reservation.keys, ok=True)
        cache.step()
        spent += clock() - t0
        t0 = clock()
        cache.hint_request(keys, RequestHint(found.hits, output_tokens))
        spent += clock() - t0
        r.manager_ops += 3
        r.manager_s += spent
        r.stored_blocks += len(reservation.keys)
        if not self.overlap:
            self._drain()
        cache.take_events()  # keep the event log bounded; the replay reads counters instead
        return loaded

    def _promoted(self) -> dict[str, int]:
        if not self.tier_labels:
            return {}
        return self.cache.stats().promoted

    def _attribute(self, promoted_before: dict[str, int], loaded: int) -> None:
        """Split the loaded blocks between the secondary tiers that promoted blocks for this
        request (fastest tier first) and the pool (the rest). Single-threaded replay: every
        promotion during this request's lookups was started by them."""
        left = loaded
        for name, promoted in self._promoted().items():
            served = min(left, promoted - promoted_before.get(name, 0))
            if served > 0:
                self._secondary_hits[name] = self._secondary_hits.get(name, 0) + served
                left -= served

    def _drain(self) -> None:
        """Wait until the tier jobs in flight ended (or, after ``pending_timeout_s``, give up on
        the ones still running, naming their tiers in a warning: later drains do not wait for
        them again). Jobs the manager already gave up (``job_timeout_s``) are not waited for."""
        cache = self.cache
        deadline = time.monotonic() + self.pending_timeout_s
        while sum(cache.jobs_waiting().values()) > self._stuck_jobs:
            if time.monotonic() >= deadline:
                self.result.drain_timeouts += 1
                waiting = cache.jobs_waiting()
                self._stuck_jobs = sum(waiting.values())
                log.warning(
                    "tier jobs did not end within %g s (%s); going on without them",
                    self.pending_timeout_s,
                    ", ".join(f"tier {name}: {n}" for name, n in sorted(waiting.items())),
                )
                break
            cache.wait(0.05)
        self._stuck_jobs = min(self._stuck_jobs, sum(cache.jobs_waiting().values()))
        cache.step()
        cache.take_events()

    def finish(self) -> ReplayResult:
        r = self.result
        stats = self.cache.stats()
        r.hit_ratio = r.hit_blocks / r.blocks if r.blocks else 0.0
        if r.elapsed_s > 0:
            r.ops_per_s = r.manager_ops / r.elapsed_s
            r.blocks_per_s = r.blocks / r.elapsed_s
        if r.manager_s > 0:
            r.manager_ops_per_s = r.manager_ops / r.manager_s
        secondary_hits = sum(self._secondary_hits.values())
        pool = TierResult(
            POOL_TIER,
            "pool",
            hit_blocks=r.hit_blocks - secondary_hits,
            evictions=stats.cache.pool_evictions,
            read_blocks=stats.cache.loaded_blocks,
            written_blocks=stats.cache.stored_blocks,
        )
        tiers = [pool]
        for name, counters in stats.tiers.items():
            tiers.append(self._tier_result(name, counters))
        for tier in tiers:
            tier.hit_ratio = tier.hit_blocks / r.blocks if r.blocks else 0.0
            tier.read_bytes = tier.read_blocks * self.block_bytes
            tier.written_bytes = tier.written_blocks * self.block_bytes
        r.tiers = tiers
        r.cache = stats.to_dict()
        # Timed on this machine's clock, unlike the counters: a replay's result repeats exactly.
        del r.cache["read_tokens_per_s"]
        r.machine = machine_description()
        return r

    def _tier_result(self, name: str, c: TierCounters) -> TierResult:
        kind, write = self.tier_labels.get(name, ("?", "?"))
        return TierResult(
            name,
            kind,
            write,
            capacity_blocks=self.tier_capacity_blocks.get(name),
            hit_blocks=self._secondary_hits.get(name, 0),
            evictions=c.evictions,
            read_blocks=c.read_blocks,
            written_blocks=c.write_blocks,
            errors=c.errors,
            corrupt=c.corrupt,
            timeouts=c.timeouts,
            rejected=c.rejected,
        )


def trace_label(path: str | Path) -> str:
    return Path(path).name
