"""The connector's scheduler half: kvtier's ``Planner`` fed from vLLM's requests and scheduler
outputs.

Lookups, load plans, store orders, the job ledger and the stats are engine-neutral
(``kvtier.engine.planner``); what is vLLM's is here: which requests are cacheable and what their
keys depend on (``key_scope``: multimodal inputs and prompt embeddings are not cached, a LoRA
adapter and a cache salt start their own key chains), the block tables and freshly allocated
blocks read from each step's ``SchedulerOutput``, and the step orders as vLLM's metadata class.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.engine.groups import CacheGroup
from kvtier.engine.hybrid import HybridPlanner
from kvtier.engine.planner import PLAIN, KeyScope
from kvtier.integrations.vllm.groups import NULL_BLOCK
from kvtier.integrations.vllm.landed_loads import LandedLoads
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.settings import VllmSettings
from kvtier.keys import Namespace
from kvtier.series import Payload

STATS_INTERVAL_S = 0.1
"""vLLM asks for the connector's stats every engine step (about 100 a second under load) and
logs or exports them every few seconds. A payload took 220-400 us of the scheduler's slowest
steps on an H100 host (vLLM's own connector: under 30), so while requests are in flight one is
taken at most this often; with none in flight (the step that finished the last one), at once.
Counters are deltas and histograms lists: a skipped step's changes come in a later payload."""


HOLD_BEHIND_STEPS = 2
"""How many engine steps after a deferred request's wait began the requests behind it are held
(``vllm.keep_order``): a read that lands within two steps (vLLM asks again once a step and sees a
landed block a step later) keeps the order; a longer one, from a disk slower than the engine,
would hold every request behind it while the engine runs only the others' decodes (in the
scheduler replay with fs reads at 4 ms a block, holding for the whole wait left 16x4 and 16x2
4-6% below the tokens/s of kvtier's pool alone; docs/vllm.md)."""
HOLD_BEHIND_S = 2.0
"""The hold's bound while no step was timed, and for engines whose steps take over a second:
without ``promotion_costs``, or behind a stuck load, a wait can last ``job_timeout_s``."""


def fresh_blocks(scheduler_output: Any) -> list[int] | None:
    """Engine blocks this step's scheduling handed to requests (new requests' blocks, blocks
    added to running or resumed ones, copy-on-write targets): a block freed while a store of it
    was still running can only be written again after it shows up here. None when the output
    does not say (then the workers fence every store still running)."""
    try:
        out: list[int] = []
        for new in scheduler_output.scheduled_new_reqs:
            for group in new.block_ids:  # every KV cache group's (hybrid models: several)
                out.extend(group)
        for ids in scheduler_output.scheduled_cached_reqs.new_block_ids:
            for group in ids or ():
                out.extend(group)
        for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ():
            out.append(int(copy.dst_block_id))
    except (AttributeError, IndexError, TypeError):
        return None
    return out


class BlockTables:
    """Each request's engine block ids per KV cache group, followed from the scheduler outputs
    the way vLLM's workers follow them (every supported release carries them there): a new
    request brings its whole tables, a running one appends its new blocks, a resumed one brings
    new tables. A sliding-window group's blocks that left the window stay listed here (vLLM
    frees them without a word to the workers): ``HybridPlanner`` never reads those."""

    def __init__(self) -> None:
        self._tables: dict[str, list[list[int]]] = {}

    def update(self, scheduler_output: Any) -> None:
        for new in getattr(scheduler_output, "scheduled_new_reqs", ()):
            self._tables[new.req_id] = [list(group) for group in new.block_ids]
        cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
        if cached is None:
            return
        resumed = getattr(cached, "resumed_req_ids", ())
        for req_id, ids in zip(cached.req_ids, cached.new_block_ids, strict=False):
            if req_id in resumed:
                self._tables[req_id] = [list(group) for group in ids or ()]
            elif ids:
                tables = self._tables.setdefault(req_id, [])
                tables.extend([] for _ in range(len(ids) - len(tables)))
                for table, group in zip(tables, ids, strict=False):
                    table.extend(group)

    def get(self, req_id: str) -> list[int]:
        """The first group's table (a model with one group: its only one)."""
        return self.group(req_id, 0)

    def group(self, req_id: str, group: int) -> list[int]:
        tables = self._tables.get(req_id, ())
        return tables[group] if group < len(tables) else []

    def drop(self, req_id: str) -> None:
        self._tables.pop(req_id, None)


class SchedulerSide(HybridPlanner):
    """The planner under vLLM's scheduler hooks (``KVTierConnector`` calls these): ``Planner``
    for a model with one KV cache group, ``HybridPlanner``'s per-group keys and orders for a
    hybrid one."""

    def __init__(
        self,
        config: KVTierConfig,
        settings: VllmSettings,
        namespace: Namespace,
        slot_bytes: int,
        engine_block_size: int,
        tp_size: int,
        groups: Sequence[CacheGroup] = (),
        landed: LandedLoads | None = None,
    ) -> None:
        super().__init__(
            config, settings.planner, namespace, slot_bytes, engine_block_size, tp_size
        )
        self.set_groups(groups, settings.window_boundary_blocks, NULL_BLOCK)
        self._tables = BlockTables()
        self._stats_due = 0.0
        self.clock: Callable[[], float] = time.monotonic
        self._landed = landed
        """Landed asynchronous loads the other lookups defer to (releases that strand them)."""
        self._keep_order = settings.keep_order

    def matched_tokens(self, request: Any, num_computed: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: ``HybridPlanner``'s answer, or None (deferred)
        for a request in vLLM's skipped queue while an asynchronous load there has landed and
        vLLM has not scheduled its request (``landed_loads``), and with ``keep_order`` for every
        request asked after a deferred one in the same scheduling pass.

        vLLM moves a deferred request aside and goes on with the requests behind it, which then
        take the GPU KV cache room the deferred one needs: in the scheduler replay at 16x2 with
        the fs tier, each of the 8 slowest requests had been deferred and passed by 1-3 later
        arrivals (72 passings in all; none without kvtier). Held, the later ones wait as they
        would behind a request vLLM cannot allocate, for at most ``HOLD_BEHIND_STEPS`` engine
        steps of its wait."""
        req_id = request.request_id
        landed = self._landed
        if landed is not None and landed.defers(req_id):
            self.counters.lookups_deferred_for_landed_loads += 1
            return None, False
        answer: tuple[int | None, bool]
        if self._keep_order and self._behind_a_deferral(req_id):
            self.counters.lookups_held_in_order += 1
            answer = None, False
        else:
            answer = super().matched_tokens(request, num_computed)
        if landed is not None:  # a held request goes to vLLM's skipped queue too
            landed.answered(req_id, answer[0] is None)
        return answer

    def _behind_a_deferral(self, req_id: str) -> bool:
        """Another request's lookup was deferred in this pass less than ``HOLD_BEHIND_STEPS``
        engine steps (at most ``HOLD_BEHIND_S``) after its wait began."""
        deferred = self.deferred_in_pass()
        if deferred is None or deferred[0] == req_id:
            return False
        step_s = self.cache.engine_step_s
        hold_s = min(HOLD_BEHIND_S, HOLD_BEHIND_STEPS * step_s) if step_s else HOLD_BEHIND_S
        return self.cache.now() - deferred[1] < hold_s

    def after_alloc_groups(
        self, request: Any, block_ids: Sequence[Sequence[int]], external_tokens: int
    ) -> None:
        """vLLM's ``update_state_after_alloc`` with every group's block ids (``get_block_ids``)."""
        self.alloc_tables = block_ids
        try:
            self.after_alloc(request, block_ids[0] if block_ids else [], external_tokens)
        finally:
            self.alloc_tables = ()

    def key_scope(self, request: Any) -> KeyScope | None:
        """Requests whose KV does not follow from token ids alone (multimodal inputs, prompt
        embeddings) are never cached; a LoRA adapter's name and a cache salt scope the keys."""
        if getattr(request, "mm_features", None):
            return None
        if getattr(request, "prompt_embeds", None) is not None:
            return None
        lora = getattr(request, "lora_request", None)
        adapter = None if lora is None else getattr(lora, "lora_name", "")
        salt = getattr(request, "cache_salt", None)
        if adapter is None and not salt:
            return PLAIN
        return KeyScope(adapter, salt)

    def build_meta(self, scheduler_output: Any) -> KVTierMetadata:
        """vLLM's ``build_connector_meta``: this step's orders for every worker."""
        self._tables.update(scheduler_output)
        scheduled = scheduler_output.num_scheduled_tokens
        orders = self.plan_step(scheduled, self._tables, fresh_blocks(scheduler_output))
        if self._landed is not None:
            self._landed.after_pass(scheduled)
        return KVTierMetadata(orders.pool, orders.loads, orders.stores, orders.fresh_blocks)

    def on_worker_meta(self, meta: KVTierWorkerMetadata | None) -> None:
        """vLLM's ``update_connector_output``: the workers' merged reports."""
        ended = self.on_report(meta)
        if ended and self._landed is not None:
            self._landed.landed(ended)

    def request_finished(self, request: Any) -> None:
        super().request_finished(request)
        self._tables.drop(request.request_id)
        if self._landed is not None:
            self._landed.forget(request.request_id)

    def take_stats(self) -> Payload | None:
        """vLLM's ``get_kv_connector_stats``: ``Planner.take_stats`` at most every
        ``STATS_INTERVAL_S`` while requests are in flight."""
        now = self.clock()
        if self._requests and now < self._stats_due:
            return None
        self._stats_due = now + STATS_INTERVAL_S
        return super().take_stats()
