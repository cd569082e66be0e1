"""The scheduler side of an engine adapter: requests -> kvtier lookups, load plans and store orders.

Runs on the engine's scheduler thread and never waits on I/O: lookups answer from the manager,
tier jobs run on their own threads and are collected once per engine step (``plan_step``). The
engine adapter hands it requests (anything with the attributes of ``EngineRequest``), each step's
scheduled tokens and block tables, and the workers' reports; it says what a request's key chain
starts from (``key_scope``).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier import series
from kvtier.cache.factory import build_cache
from kvtier.config import KVTierConfig
from kvtier.copy.base import Direction
from kvtier.engine.ledger import JobLedger
from kvtier.engine.load_mode import load_async
from kvtier.engine.orders import SKIP, CopyOrder, RankReport, StepOrders
from kvtier.engine.planner_settings import PlannerSettings
from kvtier.engine.prefix_keys import PrefixKeys
from kvtier.engine.stats_file import Snapshot, StatsFile
from kvtier.events import POOL_TIER, CacheEvent
from kvtier.keys import BlockKey, Namespace, chain_keys, chain_root
from kvtier.metrics import CacheStats
from kvtier.policies.hints import RequestHint

log = logging.getLogger(__name__)

DEFERRED_WAIT_S = 0.001
"""After a step that deferred a request and scheduled nothing, the scheduler thread waits up to
this long for a tier job to end: vLLM re-asks a deferred request every step, its idle loop holds
the GIL, and the tier's readers got it every 5 ms only (the switch interval), promotions later."""


class EngineRequest(Protocol):
    """What the planner reads of an engine's request (vLLM's ``Request`` has these)."""

    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> Sequence[int]:
        """Prompt and generated tokens so far."""

    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV the engine holds (before this step's)."""


class BlockTableView(Protocol):
    """Each request's engine block ids as of this step."""

    def get(self, req_id: str) -> Sequence[int]: ...


@dataclass(frozen=True, slots=True)
class KeyScope:
    """What besides its tokens decides the KV of a request's blocks (``keys.chain_root``)."""

    adapter: str | None = None
    """The name of the LoRA adapter it runs with (``""``: an adapter without a name)."""
    salt: str | None = None
    """A per-request cache salt: only requests with the same salt share blocks."""


PLAIN = KeyScope()


@dataclass(slots=True)
class _LoadPlan:
    """Blocks pinned for a request between the lookup and the engine's block allocation."""

    keys: list[BlockKey]
    slots: list[int]
    first_token: int
    """First token of the first kvtier block to load."""
    num_computed: int
    """Tokens the engine already has (its own prefix cache): engine blocks before this are
    skipped."""
    external_tokens: int
    origins: list[str]
    """Per slot, the tier its block came from (``pool`` or a secondary tier's name)."""


@dataclass(slots=True)
class PlannerCounters:
    requests_looked_up: int = 0
    deferred_lookups: int = 0
    hit_tokens: int = 0
    loads_ordered: int = 0
    load_blocks_failed: int = 0
    stores_ordered: int = 0
    store_blocks_failed: int = 0
    stale_plans: int = 0
    resets: int = 0
    """Cache resets (``reset``: vLLM's ``reset_prefix_cache(reset_connector=True)``)."""
    lookups_deferred_for_landed_loads: int = 0
    """Lookups an engine adapter deferred to let its engine take in landed asynchronous loads."""
    lookups_held_in_order: int = 0
    """Lookups an engine adapter deferred because one asked before them in the same scheduling
    pass was deferred (an engine that schedules the requests behind a deferred one)."""
    engine_hit_blocks: int = 0
    """Blocks the engine's own prefix cache held at a lookup (not looked up): with ``cache``'s
    hit_blocks / (lookup_blocks + these), the prefix hit ratio ``kvtier simulate`` predicts."""


class Planner:
    """One engine's scheduler side: see the module docstring. An engine adapter subclasses it to
    say what a request's keys depend on (``key_scope``) and calls its methods from the engine's
    hooks."""

    def __init__(
        self,
        config: KVTierConfig,
        settings: PlannerSettings,
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
        self.counters = PlannerCounters()
        self._keys: dict[str, list[BlockKey] | None] = {}
        """Request -> keys of its full blocks so far; None: not cacheable (``key_scope``)."""
        self._roots: dict[str, BlockKey | None] = {}
        """Request -> the start of its key chain (None: the namespace)."""
        self._prefixes = PrefixKeys(namespace)
        """Recent prompts' keys: a request's first keys reuse an earlier prompt's."""
        self._plans: dict[str, _LoadPlan] = {}
        self._offered: dict[str, int] = {}
        self._hit_blocks: dict[str, tuple[int, int]] = {}
        """Request -> leading blocks cached at lookup (all; the engine's own), for its hint."""
        self._requests: dict[str, EngineRequest] = {}
        self._async_loads: dict[int, str] = {}
        """Asynchronous load jobs -> their request."""
        self._plan_async: dict[str, bool] = {}
        """Requests with a load plan -> whether its load is asynchronous, as the engine was told
        (``load_async``); a plan made elsewhere (``HybridPlanner``) follows ``async_loads``."""
        self._step_requests = 0
        """Requests the engine's last step ran (``plan_step``)."""
        self._queued_work: deque[tuple[int, int, int]] = deque(maxlen=settings.steps_in_flight)
        """Tokens, prefills and requests of the steps in flight, oldest first."""
        self._no_loads: set[str] = set()
        """Requests that get no hit any more: their asynchronous load failed (the engine asks
        again before recomputing, and the same load would fail again), or the engine knew them
        before a ``reset`` (a hit would be keyed in the old generation)."""
        self.generation = 0
        """Resets so far (``reset``): part of every new request's key root."""
        self._loads: list[CopyOrder] = []
        self._jobs = JobLedger(tp_size)
        self._stats_file = None if settings.stats_path is None else StatsFile(settings.stats_path)
        self._deferred: str | None = None
        """A request whose lookup was deferred in this scheduling pass (the last one)."""
        self.hits_by_tier: dict[str, int] = {POOL_TIER: 0, **{t.name: 0 for t in config.tiers}}
        """Hit blocks of final lookups by the tier that held them (``TieredCache.origins``)."""
        self.hit_tokens_by_tier: dict[str, int] = dict.fromkeys(self.hits_by_tier, 0)
        """``PlannerCounters.hit_tokens`` by the tier they came from (what an engine's prefix cache
        hits by source count)."""
        self._deferred_since: dict[str, float] = {}
        """Requests waiting for a promotion -> when their first deferred lookup was."""
        self._hit_sources: dict[str, dict[str, int]] = {}
        """Requests with a load order -> tokens by the tier they come from, for the engine's
        prefix cache hit metrics (``take_hit_sources``)."""
        self._delta = series.DeltaTracker()
        self._waits: list[float] = []
        self._last_gauges: series.Values = {}
        self.recorder: Any = None
        """A ``TraceRecorder`` told of every request looked up."""

    # -- lookups and loads ----------------------------------------------------------------------

    def on_new_request(self, request: EngineRequest) -> None:
        self._requests[request.request_id] = request

    def matched_tokens(self, request: EngineRequest, num_computed: int) -> tuple[int | None, bool]:
        """Tokens loadable beyond ``num_computed`` (vLLM's ``get_num_new_matched_tokens``); the
        flag says whether a load is asynchronous (``PlannerSettings.load_mode``).

        ``None`` defers the request (a promotion or a shared load is in flight). The engine may
        call this many times per request; a hit pins its blocks until the allocation (or the next
        call) so a lookup of another request cannot evict them in between. Asked again with the
        same start, the previous call's pins are kept (``TieredCache.lookup_and_pin``), not
        dropped and taken again: vLLM asks every step for a request it has no room for yet.
        """
        req_id = request.request_id
        self._requests[req_id] = request
        self._plan_async.pop(req_id, None)
        old = self._plans.pop(req_id, None)
        keys = self._request_keys(request)
        if keys is None or req_id in self._no_loads:
            if old is not None:
                self._unpin(old)
            return 0, False
        bt = self.block_tokens
        limit = min((request.num_tokens - 1) // bt, len(keys))  # >= 1 token left to compute
        start = num_computed // bt
        if start >= limit:
            if old is not None:
                self._unpin(old)
            self.cache.forget(req_id)  # nothing to load: nothing to hold for it
            self.counters.engine_hit_blocks += limit
            self._hit_blocks[req_id] = (start, start)
            return 0, False
        held = 0 if old is None else self._kept_pins(old, keys, start, limit)
        if req_id not in self._deferred_since:
            self.counters.requests_looked_up += 1
        if self.recorder is not None:
            self.recorder.record(request, keys)  # once per request
        result, slots = self.cache.lookup_and_pin(keys[start:limit], req_id, held)
        if not result.final:
            self.counters.deferred_lookups += 1
            self._deferred = req_id
            self._deferred_since.setdefault(req_id, self.cache.now())
            return None, False
        self._end_wait(req_id)
        self.counters.engine_hit_blocks += start
        self._hit_blocks[req_id] = (start + result.hits, start)
        hit_keys = keys[start : start + result.hits]
        origins = self.cache.origins(hit_keys) if hit_keys else []
        for origin, n in Counter(origins).items():  # counted in C: a re-ask counts every hit
            self.hits_by_tier[origin] = self.hits_by_tier.get(origin, 0) + n
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
        left = request.num_tokens - num_computed - external
        asynchronous = load_async(self.settings.load_mode, external, left, self._step_requests)
        self._plan_async[req_id] = asynchronous
        return external, asynchronous

    def deferred_in_pass(self) -> tuple[str, float] | None:
        """A request whose lookup was deferred in this scheduling pass (since ``plan_step``), and
        when its wait began (the cache's clock, ``TieredCache.now``)."""
        req_id = self._deferred
        return None if req_id is None else (req_id, self._deferred_since.get(req_id, 0.0))

    def _kept_pins(self, old: _LoadPlan, keys: list[BlockKey], start: int, limit: int) -> int:
        """How many of the previous plan's pins a lookup of ``keys[start:limit]`` keeps: all of
        them when that plan starts there and its keys lead the lookup's (``lookup_and_pin``
        keeps them, or gives them up when it defers), else none (released now)."""
        n = len(old.keys)
        if (
            old.first_token == start * self.block_tokens
            and n <= limit - start
            and old.keys == keys[start : start + n]
        ):
            return n
        self._unpin(old)
        return 0

    def _end_wait(self, req_id: str) -> None:
        since = self._deferred_since.pop(req_id, None)
        if since is not None:
            self._waits.append(self.cache.now() - since)

    def after_alloc(
        self, request: EngineRequest, block_ids: Sequence[int], external_tokens: int
    ) -> None:
        """The engine allocated ``block_ids`` for the request, ``external_tokens`` of them to be
        loaded (vLLM's ``update_state_after_alloc``): turn its plan into a load order."""
        plan = self._plans.pop(request.request_id, None)
        asynchronous = self._plan_async.pop(request.request_id, self.settings.async_loads)
        if plan is None:
            return
        if external_tokens == 0:
            self._unpin(plan)
            return
        engine_blocks, groups, fits = self._load_targets(plan, block_ids)
        job_id = self._jobs.open(Direction.LOAD, plan.keys)
        stale = external_tokens != plan.external_tokens or not fits
        if stale:
            # The engine changed the count we gave it: do not guess which bytes it expects; have
            # the worker report every block of the range as failed so the engine recomputes them.
            self.counters.stale_plans += 1
            log.warning(
                "planned %d external tokens, the engine allocated %d in %d blocks: recomputing",
                plan.external_tokens,
                external_tokens,
                len(block_ids),
            )
        async_id = request.request_id if asynchronous else None
        if async_id is not None:
            self._async_loads[job_id] = async_id
        self._loads.append(CopyOrder(job_id, plan.slots, engine_blocks, stale, async_id, groups))
        self.counters.loads_ordered += 1
        self.counters.hit_tokens += 0 if stale else external_tokens
        if not stale:
            # The first block's tokens that the engine already holds are not loaded.
            bt = self.block_tokens
            split = {origin: n * bt for origin, n in Counter(plan.origins).items()}
            if plan.origins:
                split[plan.origins[0]] -= plan.num_computed - plan.first_token
            self._hit_sources[request.request_id] = split
            by_tier = self.hit_tokens_by_tier
            for origin, tokens in split.items():
                by_tier[origin] = by_tier.get(origin, 0) + tokens

    def _load_targets(
        self, plan: _LoadPlan, block_ids: Sequence[int]
    ) -> tuple[list[int], list[int] | None, bool]:
        """The engine block ids a plan's slots load into (``SKIP`` where the engine holds the
        position), the KV cache group of each slot (None: the one group), and whether the
        allocation takes the plan (False: the load fails and the engine recomputes those
        blocks). A hybrid adapter (``engine.hybrid``) overrides this."""
        bs = self.engine_block_size
        first = plan.first_token // bs
        computed = plan.num_computed // bs
        total = len(plan.slots) * self.blocks_per_slot
        skipped = max(0, min(total, computed - first))
        engine_blocks = [SKIP] * skipped
        engine_blocks += block_ids[first + skipped : first + total]  # slices, not a loop
        fits = len(engine_blocks) == total  # else the blocks the request has are recomputed
        return engine_blocks + [SKIP] * (total - len(engine_blocks)), None, fits

    def take_hit_sources(self, req_id: str) -> dict[str, int]:
        """Tokens of the request's load by the tier they come from (empty: no load planned)."""
        return self._hit_sources.pop(req_id, {})

    def _release_plan(self, req_id: str) -> None:
        self._plan_async.pop(req_id, None)
        plan = self._plans.pop(req_id, None)
        if plan is not None:
            self._unpin(plan)

    def _unpin(self, plan: _LoadPlan) -> None:
        self.cache.release_load(plan.keys)

    # -- stores, once per engine step -----------------------------------------------------------

    def plan_step(
        self,
        scheduled: Mapping[str, int],
        tables: BlockTableView,
        fresh_blocks: list[int] | None,
    ) -> StepOrders:
        """This step's orders: the loads planned since the last step and a store of every block
        the step fills. ``scheduled``: tokens scheduled per request; ``tables``: the requests'
        engine block ids; ``fresh_blocks``: blocks this step's scheduling handed out (None:
        unknown, see ``StepOrders``)."""
        # Requests computing more than a token this step (prefills) share the step's compute.
        prefills = sum(1 for n in scheduled.values() if n > 1)
        self._step_requests = len(scheduled)
        queued = self._queued_work
        queued.append((sum(scheduled.values()), prefills, len(scheduled)))
        # The step that runs until the next call: none while the engine's queue fills.
        self.cache.engine_step(*queued[0] if len(queued) == queued.maxlen else (0, 0, 0))
        if self._deferred is not None and not scheduled:  # a step with work frees the GIL
            self.cache.wait(DEFERRED_WAIT_S)  # steps the cache; returns when a job ended
        else:
            self.cache.step()
        self._deferred = None
        stores: list[CopyOrder] = []
        for req_id, num_scheduled in scheduled.items():
            order = self._store_order(req_id, num_scheduled, tables)
            if order is not None:
                stores.append(order)
        loads, self._loads = self._loads, []
        if self._stats_file is not None and self._stats_file.due():
            self._stats_file.offer(self.stats_snapshot(self.cache.stats()))
        return StepOrders(self.pool.handle, loads, stores, fresh_blocks)

    def _store_order(
        self, req_id: str, num_scheduled: int, tables: BlockTableView
    ) -> CopyOrder | None:
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
        block_ids = tables.get(req_id)
        bps = self.blocks_per_slot
        engine_blocks: list[int]
        reserved = len(reservation.keys)
        if reserved == len(wanted) or reservation.keys == wanted[len(wanted) - reserved :]:
            # The reserved keys are an ordered subsequence of ``wanted``: here all of it or its
            # tail (a new turn's first store: its hits are present), so their engine blocks are
            # one slice (a loop per block: 80 us for 512 blocks).
            engine_blocks = list(block_ids[(full - reserved) * bps : full * bps])
        else:
            position = {key: offered + i for i, key in enumerate(wanted)}
            engine_blocks = []
            for key in reservation.keys:
                first = position[key] * bps
                engine_blocks.extend(block_ids[first : first + bps])
        if len(engine_blocks) != len(reservation.keys) * bps:
            self.cache.complete_store(reservation.keys, ok=False)
            return None
        job_id = self._jobs.open(Direction.STORE, reservation.keys)
        self.counters.stores_ordered += 1
        return CopyOrder(job_id, reservation.slots, engine_blocks)

    # -- completions from the workers -----------------------------------------------------------

    def on_report(self, report: RankReport | None) -> list[str]:
        """Settle the jobs all ranks reported (``JobLedger``): requests whose async load ended."""
        ended: list[str] = []
        for job in self._jobs.settle(report) if report is not None else ():
            if job.direction is Direction.STORE:
                self.cache.complete_store(job.keys, ok=job.ok)
                if not job.ok:
                    self.counters.store_blocks_failed += len(job.keys)
            else:
                self.cache.complete_load(job.keys, ok=job.ok)
                owner = self._async_loads.pop(job.job_id, None)
                if owner is not None:
                    ended.append(owner)
                if not job.ok:
                    self.counters.load_blocks_failed += len(job.keys)
                    if owner is not None and owner in self._requests:
                        self._no_loads.add(owner)
        return ended

    def request_finished(self, request: EngineRequest) -> None:
        req_id = request.request_id
        self._release_plan(req_id)
        self.cache.forget(req_id)
        self._end_wait(req_id)
        self._hit_sources.pop(req_id, None)
        if self.recorder is not None:
            self.recorder.forget(req_id)
        self._hint(request)
        self._keys.pop(req_id, None)
        self._roots.pop(req_id, None)
        self._offered.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._no_loads.discard(req_id)

    def reset(self) -> None:
        """Forget every block for this engine (vLLM's ``reset_cache``, after a weight update): new
        requests key their blocks in a new generation, so nothing stored before is a hit for them;
        requests known now get no hit again and keep their old keys, so what they store (KV that
        may be the old weights') stays out of the new generation. Other engines sharing the pool
        or a tier are not affected; the old blocks leave as the eviction policy evicts them."""
        self.generation += 1
        for req_id in list(self._plans):
            self._release_plan(req_id)
        self._no_loads.update(self._requests)
        self._no_loads.update(self._keys)
        self._prefixes = PrefixKeys(self.namespace)
        self.counters.resets += 1

    def _hint(self, request: EngineRequest) -> None:
        """Tell the eviction policy what the engine knows of a finished request: its prompt's
        blocks, the leading ones cached at its lookup and the tokens it generated."""
        req_id = request.request_id
        keys = self._keys.get(req_id)
        found = self._hit_blocks.pop(req_id, None)
        if not keys or found is None:
            return  # never looked up (or not cacheable): nothing was stored for it
        hits, engine = found
        prompt = keys[: getattr(request, "num_prompt_tokens", 0) // self.block_tokens]
        output = getattr(request, "num_output_tokens", None)
        hint = RequestHint(
            min(hits, len(prompt)), output if isinstance(output, int) else None, engine
        )
        self.cache.hint_request(prompt, hint)

    # -- keys -----------------------------------------------------------------------------------

    def key_scope(self, request: EngineRequest) -> KeyScope | None:
        """What the request's keys depend on besides its tokens; None: its KV does not follow
        from token ids (e.g. multimodal inputs), so it is never cached. Engine adapters override
        this; asked once per request."""
        return PLAIN

    def _request_keys(self, request: EngineRequest) -> list[BlockKey] | None:
        """Keys of the request's full kvtier blocks (cached, extended as tokens arrive); None
        for a request that is not cached (``key_scope``)."""
        req_id = request.request_id
        if req_id not in self._keys:
            scope = self.key_scope(request)
            if scope is None:
                self._keys[req_id] = None
                return None
            self._keys[req_id] = []
            self._roots[req_id] = chain_root(
                self.namespace, scope.adapter, scope.salt, self.generation
            )
        keys = self._keys[req_id]
        if keys is None:
            return None
        tokens = request.all_token_ids
        bt = self.block_tokens
        have = len(keys)
        full = len(tokens) // bt
        if full > have:
            cut = tokens[have * bt : full * bt]
            if have:
                keys.extend(chain_keys(self.namespace, cut, keys[-1]))
            else:  # a new prompt: an earlier prompt's keys may cover its start
                keys = self._keys[req_id] = self._prefixes.keys(cut, self._roots[req_id])
        return keys

    # -- reporting ------------------------------------------------------------------------------

    def take_events(self) -> list[CacheEvent]:
        return self.cache.take_events()

    def stats(self) -> dict[str, Any]:
        return self.stats_snapshot(self.cache.stats())()

    def stats_snapshot(self, snapshot: CacheStats) -> Snapshot:
        """What ``stats()`` returns, as a call another thread may make: it reads only copies
        taken here (``snapshot`` is the cache's own copy), so the step pays for the copies and
        the stats file's thread for the dict (``to_dict`` is most of the cost)."""
        connector = {name: getattr(self.counters, name) for name in PlannerCounters.__slots__}
        hits, hit_tokens = dict(self.hits_by_tier), dict(self.hit_tokens_by_tier)
        jobs, plans = len(self._jobs), len(self._plans)

        def build() -> dict[str, Any]:
            out = snapshot.to_dict()
            out["connector"] = connector
            out["hits_by_tier"] = hits
            out["hit_tokens_by_tier"] = hit_tokens
            out["jobs_in_flight"] = jobs
            out["pinned_plans"] = plans
            return out

        return build

    def take_stats(self) -> series.Payload | None:
        """What changed since the last call, as a :mod:`kvtier.series` payload (None: nothing).
        The engine asks once per step."""
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
        if series.is_empty(payload):
            return None
        if self._stats_file is not None:
            # The step's end, once per step: the stats file gets the newest counters even when
            # no step follows (StatsFile writes at most once a second, the last one too).
            self._stats_file.offer(self.stats_snapshot(snapshot))
        return payload

    def close(self) -> None:
        for req_id in list(self._plans):
            self._release_plan(req_id)
        if self.recorder is not None:
            self.recorder.close()
        if self._stats_file is not None:
            # Written before the tiers close (up to job_timeout_s): vLLM kills an engine process
            # still shutting down 5 s after it asked it to stop.
            self._stats_file.offer(self.stats_snapshot(self.cache.stats()), now=True)
        self.cache.close()
        if self._stats_file is not None:
            self._stats_file.close(self.stats_snapshot(self.cache.stats()))
        self.pool.close()
