"""The connector's scheduler half: vLLM requests -> kvtier lookups, load plans and store orders.

Runs on vLLM's scheduler thread and never waits on I/O: lookups answer from the manager, tier
jobs run on their own threads and are collected once per engine step (``build_meta``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from kvtier import series
from kvtier.config import KVTierConfig
from kvtier.copy.base import SKIP
from kvtier.events import POOL_TIER, CacheEvent
from kvtier.factory import build_cache
from kvtier.integrations.vllm.metadata import CopyOrder, KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.settings import VllmSettings
from kvtier.keys import BlockKey, Namespace, chain_keys, chain_root
from kvtier.metrics import CacheStats
from kvtier.policies.hints import RequestHint

log = logging.getLogger(__name__)

STATS_INTERVAL_S = 1.0
DEFERRED_WAIT_S = 0.001
"""After a step that deferred a request and scheduled nothing, the scheduler thread waits up to
this long for a tier job to end. vLLM re-asks a deferred request every step, and with nothing
else to run its loop spins and holds the GIL: the tier's reader threads then got it only every
5 ms (Python's switch interval), so each promotion took several milliseconds more than its I/O."""


class JobKind(Enum):
    LOAD = "load"
    STORE = "store"


@dataclass(slots=True)
class _LoadPlan:
    """Blocks pinned for a request between the lookup and vLLM's block allocation."""

    keys: list[BlockKey]
    slots: list[int]
    first_token: int
    """First token of the first kvtier block to load."""
    num_computed: int
    """Tokens vLLM already has (its own prefix cache): engine blocks before this are skipped."""
    external_tokens: int
    origins: list[str]
    """Per slot, the tier its block came from (``pool`` or a secondary tier's name)."""


@dataclass(slots=True)
class _Job:
    kind: JobKind
    keys: list[BlockKey]
    done: int = 0
    failed: int = 0


@dataclass(slots=True)
class ConnectorCounters:
    requests_looked_up: int = 0
    deferred_lookups: int = 0
    hit_tokens: int = 0
    loads_ordered: int = 0
    load_blocks_failed: int = 0
    stores_ordered: int = 0
    store_blocks_failed: int = 0
    stale_plans: int = 0
    engine_hit_blocks: int = 0
    """Blocks vLLM's own prefix cache held at a lookup (not looked up in kvtier): with
    ``cache.hit_blocks`` over ``cache.lookup_blocks`` plus these, the engine's whole prefix hit
    ratio, what ``kvtier simulate`` predicts from a recorded trace."""


def fresh_blocks(scheduler_output: Any) -> list[int] | None:
    """Engine blocks this step's scheduling handed to requests (new requests' blocks, blocks
    added to running or resumed ones, copy-on-write targets): a block freed while a store of it
    was still running can only be written again after it shows up here. None when the output
    does not say (then the workers fence every store still running)."""
    try:
        out: list[int] = []
        for new in scheduler_output.scheduled_new_reqs:
            out.extend(new.block_ids[0])  # one KV cache group (checked at start)
        for ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            if ids:
                out.extend(ids[0])
        for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():
            out.append(int(copy.dst_block_id))
    except (AttributeError, IndexError, TypeError):
        return None
    return out


class BlockTables:
    """Each request's engine block ids, followed from the scheduler outputs the way vLLM's
    workers follow them (every supported release carries them there): a new request brings its
    whole table, a running one appends its new blocks, a resumed one brings a new table."""

    def __init__(self) -> None:
        self._tables: dict[str, list[int]] = {}

    def update(self, scheduler_output: Any) -> None:
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()):
            self._tables[new.req_id] = list(new.block_ids[0])  # one KV cache group
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is None:
            return
        resumed = getattr(cached, "resumed_req_ids", ())
        for req_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=False):
            if req_id in resumed:
                self._tables[req_id] = list(ids[0]) if ids else []
            elif ids:
                self._tables.setdefault(req_id, []).extend(ids[0])

    def get(self, req_id: str) -> list[int]:
        return self._tables.get(req_id, [])

    def drop(self, req_id: str) -> None:
        self._tables.pop(req_id, None)


class SchedulerSide:
    def __init__(
        self,
        config: KVTierConfig,
        settings: VllmSettings,
        namespace: Namespace,
        slot_bytes: int,
        engine_block_size: int,
        tp_size: int,
    ) -> None:
        self.settings = settings
        self.namespace = namespace
        self.engine_block_size = engine_block_size
        self.blocks_per_slot = settings.blocks_per_slot
        self.block_tokens = engine_block_size * settings.blocks_per_slot
        self.tp_size = tp_size
        self.pool, self.cache = build_cache(config, namespace, slot_bytes)
        self.counters = ConnectorCounters()
        self._keys: dict[str, list[BlockKey]] = {}
        self._plans: dict[str, _LoadPlan] = {}
        self._offered: dict[str, int] = {}
        self._hit_blocks: dict[str, int] = {}
        """Requests -> leading blocks cached at their lookup (vLLM's own and kvtier's), for the
        eviction policy's hint when they finish."""
        self._requests: dict[str, Any] = {}
        self._tables = BlockTables()
        self._loads: list[CopyOrder] = []
        self._jobs: dict[int, _Job] = {}
        self._next_job = 0
        self._stats_written = 0.0
        self._deferred = False
        self.hits_by_tier: dict[str, int] = {POOL_TIER: 0, **{t.name: 0 for t in config.tiers}}
        """Hit blocks of final lookups by the tier that held them (``TieredCache.origins``)."""
        self.hit_tokens_by_tier: dict[str, int] = dict.fromkeys(self.hits_by_tier, 0)
        """``ConnectorCounters.hit_tokens`` by the tier they came from (what vLLM's prefix cache
        hits by source count)."""
        self._deferred_since: dict[str, float] = {}
        """Requests waiting for a promotion -> when their first deferred lookup was."""
        self._hit_sources: dict[str, dict[str, int]] = {}
        """Requests with a load order -> tokens by the tier they come from, for vLLM's prefix
        cache hit metrics (``take_hit_sources``)."""
        self._delta = series.DeltaTracker()
        self._waits: list[float] = []
        self._last_gauges: series.Values = {}
        self.recorder: Any = None
        """A ``TraceRecorder`` (``vllm.trace_path``) told of every request looked up."""

    # -- lookups and loads ----------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        self._requests[request.request_id] = request

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: tokens loadable beyond ``num_computed``.

        ``None`` defers the request (a promotion or a shared load is in flight). vLLM may call
        this many times per request; a hit pins its blocks until the allocation (or the next call)
        so a lookup of another request cannot evict them in between.
        """
        req_id = request.request_id
        self._requests[req_id] = request
        self._release_plan(req_id)
        keys = self._request_keys(request)
        if keys is None:
            return 0, False
        bt = self.block_tokens
        limit = min((request.num_tokens - 1) // bt, len(keys))  # >= 1 token left to compute
        start = num_computed // bt
        if start >= limit:
            self.counters.engine_hit_blocks += limit
            self._hit_blocks[req_id] = start
            return 0, False
        if req_id not in self._deferred_since:
            self.counters.requests_looked_up += 1
        if self.recorder is not None:
            self.recorder.record(request, keys)  # once per request
        result = self.cache.lookup(keys[start:limit])
        if not result.final:
            self.counters.deferred_lookups += 1
            self._deferred = True
            self._deferred_since.setdefault(req_id, time.monotonic())
            return None, False
        self._end_wait(req_id)
        self.counters.engine_hit_blocks += start
        self._hit_blocks[req_id] = start + result.hits
        hit_keys = keys[start : start + result.hits]
        origins = self.cache.origins(hit_keys) if hit_keys else []
        for origin in origins:
            self.hits_by_tier[origin] = self.hits_by_tier.get(origin, 0) + 1
        slots = self.cache.prepare_load(hit_keys) if hit_keys else []
        external = (start + len(slots)) * bt - num_computed
        if external <= 0:
            if slots:
                self.cache.release_load(hit_keys[: len(slots)])
            return 0, False
        self._plans[req_id] = _LoadPlan(
            hit_keys[: len(slots)],
            slots,
            start * bt,
            num_computed,
            external,
            origins[: len(slots)],
        )
        return external, False

    def _end_wait(self, req_id: str) -> None:
        since = self._deferred_since.pop(req_id, None)
        if since is not None:
            self._waits.append(time.monotonic() - since)

    def after_alloc(self, request: Any, block_ids: Sequence[int], external_tokens: int) -> None:
        """vLLM's ``update_state_after_alloc``: turn the request's plan into a load order."""
        plan = self._plans.pop(request.request_id, None)
        if plan is None:
            return
        if external_tokens == 0:
            self._unpin(plan)
            return
        bs = self.engine_block_size
        first = plan.first_token // bs
        computed = plan.num_computed // bs
        engine_blocks = [
            SKIP if first + i < computed else block_ids[first + i]
            for i in range(len(plan.slots) * self.blocks_per_slot)
        ]
        job_id = self._new_job(JobKind.LOAD, plan.keys)
        stale = external_tokens != plan.external_tokens
        if stale:
            # vLLM changed the count we gave it: do not guess which bytes it expects; have the
            # worker report every block of the range as failed so vLLM recomputes them.
            self.counters.stale_plans += 1
            log.warning(
                "vLLM allocated %d external tokens, kvtier planned %d: recomputing",
                external_tokens,
                plan.external_tokens,
            )
        self._loads.append(CopyOrder(job_id, plan.slots, engine_blocks, fail=stale))
        self.counters.loads_ordered += 1
        self.counters.hit_tokens += 0 if stale else external_tokens
        if not stale:
            # The first block's tokens that vLLM already holds are not loaded.
            split: dict[str, int] = {}
            for i, origin in enumerate(plan.origins):
                tokens = self.block_tokens
                if i == 0:
                    tokens -= plan.num_computed - plan.first_token
                split[origin] = split.get(origin, 0) + tokens
            self._hit_sources[request.request_id] = split
            by_tier = self.hit_tokens_by_tier
            for origin, tokens in split.items():
                by_tier[origin] = by_tier.get(origin, 0) + tokens

    def take_hit_sources(self, req_id: str) -> dict[str, int]:
        """Tokens of the request's load by the tier they come from (empty: no load planned)."""
        return self._hit_sources.pop(req_id, {})

    def _release_plan(self, req_id: str) -> None:
        plan = self._plans.pop(req_id, None)
        if plan is not None:
            self._unpin(plan)

    def _unpin(self, plan: _LoadPlan) -> None:
        self.cache.release_load(plan.keys)

    # -- stores, once per engine step -----------------------------------------------------------

    def build_meta(self, scheduler_output: Any) -> KVTierMetadata:
        idle = not scheduler_output.num_scheduled_tokens
        if self._deferred and idle:  # a step with work runs the model, which releases the GIL
            self.cache.wait(DEFERRED_WAIT_S)  # steps the cache; returns when a job ended
        else:
            self.cache.step()
        self._deferred = False
        self._tables.update(scheduler_output)
        stores: list[CopyOrder] = []
        for req_id, num_scheduled in scheduler_output.num_scheduled_tokens.items():
            order = self._store_order(req_id, num_scheduled)
            if order is not None:
                stores.append(order)
        loads, self._loads = self._loads, []
        self._maybe_write_stats()
        return KVTierMetadata(self.pool.handle, loads, stores, fresh_blocks(scheduler_output))

    def _store_order(self, req_id: str, num_scheduled: int) -> CopyOrder | None:
        request = self._requests.get(req_id)
        if request is None:
            return None
        # num_computed_tokens is still the value before this step.
        filled = request.num_computed_tokens + num_scheduled
        if not self.settings.store_generated:
            filled = min(filled, request.num_prompt_tokens)
        keys = self._request_keys(request)
        if keys is None:
            return None
        full = min(filled // self.block_tokens, len(keys))
        offered = self._offered.get(req_id, 0)
        if full <= offered:
            return None
        self._offered[req_id] = full
        wanted = keys[offered:full]
        reservation = self.cache.prepare_store(wanted)
        if not reservation.keys:
            return None
        block_ids = self._tables.get(req_id)
        position = {key: offered + i for i, key in enumerate(wanted)}
        bps = self.blocks_per_slot
        engine_blocks: list[int] = []
        for key in reservation.keys:
            first = position[key] * bps
            engine_blocks.extend(block_ids[first : first + bps])
        if len(engine_blocks) != len(reservation.keys) * bps:
            self.cache.complete_store(reservation.keys, ok=False)
            return None
        job_id = self._new_job(JobKind.STORE, reservation.keys)
        self.counters.stores_ordered += 1
        return CopyOrder(job_id, reservation.slots, engine_blocks)

    def _new_job(self, kind: JobKind, keys: list[BlockKey]) -> int:
        job_id = self._next_job
        self._next_job += 1
        self._jobs[job_id] = _Job(kind, keys)
        return job_id

    # -- completions from the workers -----------------------------------------------------------

    def on_worker_meta(self, meta: KVTierWorkerMetadata | None) -> None:
        """Settle jobs once every tensor-parallel rank reported them."""
        if meta is None:
            return
        for job_id, n in meta.done.items():
            job = self._jobs.get(job_id)
            if job is not None:
                job.done += n
                self._settle(job_id, job)
        for job_id, n in meta.failed.items():
            job = self._jobs.get(job_id)
            if job is not None:
                job.failed += n
                self._settle(job_id, job)

    def _settle(self, job_id: int, job: _Job) -> None:
        if job.done + job.failed < self.tp_size:
            return
        del self._jobs[job_id]
        ok = job.failed == 0
        if job.kind is JobKind.STORE:
            self.cache.complete_store(job.keys, ok=ok)
            if not ok:
                self.counters.store_blocks_failed += len(job.keys)
        else:
            self.cache.complete_load(job.keys, ok=ok)
            if not ok:
                self.counters.load_blocks_failed += len(job.keys)

    def request_finished(self, request: Any) -> None:
        req_id = request.request_id
        self._release_plan(req_id)
        self._end_wait(req_id)
        self._hit_sources.pop(req_id, None)
        if self.recorder is not None:
            self.recorder.forget(req_id)
        self._hint(request)
        self._keys.pop(req_id, None)
        self._offered.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._tables.drop(req_id)

    def _hint(self, request: Any) -> None:
        """Tell the eviction policy what vLLM knows of a finished request: its prompt's blocks,
        the leading ones cached at its lookup and the tokens it generated."""
        req_id = request.request_id
        keys = self._keys.get(req_id)
        hits = self._hit_blocks.pop(req_id, None)
        if not keys or hits is None:
            return  # never looked up (or not cacheable): nothing was stored for it
        prompt = keys[: getattr(request, "num_prompt_tokens", 0) // self.block_tokens]
        output = getattr(request, "num_output_tokens", None)
        hint = RequestHint(min(hits, len(prompt)), output if isinstance(output, int) else None)
        self.cache.hint_request(prompt, hint)

    # -- keys -----------------------------------------------------------------------------------

    def _request_keys(self, request: Any) -> list[BlockKey] | None:
        """Keys of the request's full kvtier blocks (cached, extended as tokens arrive).

        ``None`` for requests whose KV does not follow from token ids alone (multimodal inputs,
        prompt embeddings): those are never cached.
        """
        if getattr(request, "mm_features", None):
            return None
        if getattr(request, "prompt_embeds", None) is not None:
            return None
        keys = self._keys.get(request.request_id)
        if keys is None:
            keys = self._keys[request.request_id] = []
        tokens = request.all_token_ids
        bt = self.block_tokens
        have = len(keys)
        full = len(tokens) // bt
        if full > have:
            start = keys[-1] if keys else self._root(request)
            keys.extend(chain_keys(self.namespace, tokens[have * bt : full * bt], start))
        return keys

    def _root(self, request: Any) -> BlockKey | None:
        """Chain root: the namespace, or the namespace mixed with a LoRA adapter / cache salt."""
        lora = getattr(request, "lora_request", None)
        adapter = None if lora is None else getattr(lora, "lora_name", "")
        return chain_root(self.namespace, adapter, getattr(request, "cache_salt", None))

    # -- reporting ------------------------------------------------------------------------------

    def take_events(self) -> list[CacheEvent]:
        return self.cache.take_events()

    def stats(self) -> dict[str, Any]:
        snapshot: CacheStats = self.cache.stats()
        out = snapshot.to_dict()
        out["connector"] = {
            name: getattr(self.counters, name) for name in ConnectorCounters.__slots__
        }
        out["hits_by_tier"] = dict(self.hits_by_tier)
        out["hit_tokens_by_tier"] = dict(self.hit_tokens_by_tier)
        out["jobs_in_flight"] = len(self._jobs)
        out["pinned_plans"] = len(self._plans)
        return out

    def take_stats(self) -> series.Payload | None:
        """What changed since the last call, as a :mod:`kvtier.series` payload (None: nothing).
        vLLM asks once per engine step."""
        snapshot = self.cache.stats()
        cumulative = series.cache_counters(snapshot, self.hits_by_tier)
        c = self.counters
        cumulative["kvtier_requests_looked_up"] = {"": c.requests_looked_up}
        cumulative["kvtier_deferred_lookups"] = {"": c.deferred_lookups}
        cumulative["kvtier_hit_tokens"] = {"": c.hit_tokens}
        cumulative["kvtier_engine_hit_blocks"] = {"": c.engine_hit_blocks}
        payload = series.empty_payload()
        payload["counters"] = self._delta.delta(cumulative)
        gauges = series.pool_gauges(snapshot)
        gauges["kvtier_jobs_in_flight"] = {"": len(self._jobs)}
        if gauges != self._last_gauges:
            payload["gauges"] = self._last_gauges = gauges
        if self._waits:
            payload["histograms"]["kvtier_promotion_wait_seconds"] = {"": self._waits}
            self._waits = []
        return None if series.is_empty(payload) else payload

    def _maybe_write_stats(self, force: bool = False) -> None:
        path = self.settings.stats_path
        if path is None:
            return
        now = time.monotonic()
        if not force and now - self._stats_written < STATS_INTERVAL_S:
            return
        self._stats_written = now
        target = Path(path)
        tmp = target.with_suffix(target.suffix + ".tmp")
        try:
            tmp.write_text(json.dumps(self.stats(), indent=1))
            tmp.replace(target)
        except OSError:
            log.exception("cannot write kvtier stats to %s", path)

    def close(self) -> None:
        for req_id in list(self._plans):
            self._release_plan(req_id)
        if self.recorder is not None:
            self.recorder.close()
        self.cache.close()
        self._maybe_write_stats(force=True)
        self.pool.close()
