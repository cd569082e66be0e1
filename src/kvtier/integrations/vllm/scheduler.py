"""The connector's scheduler half: kvtier's ``Planner`` fed from vLLM's requests and scheduler
outputs.

Lookups, load plans, store orders, the job ledger and the stats are engine-neutral
(``kvtier.engine.planner``); what is vLLM's is here: which requests are cacheable and what their
keys depend on (``key_scope``: multimodal inputs and prompt embeddings are not cached, a LoRA
adapter and a cache salt start their own key chains), the block tables and freshly allocated
blocks read from each step's ``SchedulerOutput``, and the step orders as vLLM's metadata class.
"""

from __future__ import annotations

from typing import Any

from kvtier.config import KVTierConfig
from kvtier.engine.planner import PLAIN, KeyScope, Planner
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.settings import VllmSettings
from kvtier.keys import Namespace


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


class SchedulerSide(Planner):
    """The ``Planner`` under vLLM's scheduler hooks (``KVTierConnector`` calls these)."""

    def __init__(
        self,
        config: KVTierConfig,
        settings: VllmSettings,
        namespace: Namespace,
        slot_bytes: int,
        engine_block_size: int,
        tp_size: int,
    ) -> None:
        super().__init__(
            config, settings.planner, namespace, slot_bytes, engine_block_size, tp_size
        )
        self._tables = BlockTables()

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
        orders = self.plan_step(
            scheduler_output.num_scheduled_tokens, self._tables, fresh_blocks(scheduler_output)
        )
        return KVTierMetadata(orders.pool, orders.loads, orders.stores, orders.fresh_blocks)

    def on_worker_meta(self, meta: KVTierWorkerMetadata | None) -> None:
        """vLLM's ``update_connector_output``: the workers' merged reports."""
        self.on_report(meta)

    def request_finished(self, request: Any) -> None:
        super().request_finished(request)
        self._tables.drop(request.request_id)
