"""``KVTierConnector``: kvtier as a vLLM V1 KV connector (loaded via ``kv_connector_module_path``).

A thin adapter: it translates vLLM's hooks into ``SchedulerSide`` / ``WorkerSide`` calls, vLLM's
translations of ``kvtier.engine``'s ``Planner`` and ``Copier``. kvtier
is a best-effort cache: loads are done before the step's forward pass (or, with
``vllm.async_loads``, through vLLM's asynchronous path: the request waits for its blocks while
others run), stores never delay a request, and a failed load is reported to vLLM, which recomputes
those blocks (set vLLM's ``kv_load_failure_policy`` to ``"recompute"``; its default fails the
request instead).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtier.config import KVTierConfig, load_config
from kvtier.copy.options import CopyConfig
from kvtier.engine.groups import CacheGroup
from kvtier.errors import ConfigError
from kvtier.events import EventKind
from kvtier.integrations.vllm import compat, hybrid_hits
from kvtier.integrations.vllm import groups as vllm_groups
from kvtier.integrations.vllm.landed_loads import LandedLoads
from kvtier.integrations.vllm.metadata import KVTierMetadata, KVTierWorkerMetadata
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.settings import VllmSettings
from kvtier.integrations.vllm.stats import KVTierPromMetrics, KVTierStats
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.keys import Namespace

log = logging.getLogger(__name__)


def _load_config(vllm_config: Any) -> tuple[KVTierConfig, VllmSettings, CopyConfig]:
    """The kvtier config, and the sections the core config keeps as given, each parsed here once:
    ``vllm`` (this connector's) and ``copy`` (for the workers' copy backends)."""
    extra = dict(vllm_config.kv_transfer_config.kv_connector_extra_config or {})
    extra.setdefault("model", str(vllm_config.model_config.model))
    config = load_config(extra)
    if config.events and not compat.kv_events_enabled(vllm_config):
        # vLLM takes the connector's events every step and drops them unless its KV events are
        # on: recording one per stored and evicted block would only cost scheduler time.
        config = dataclasses.replace(config, events=False)
    settings = VllmSettings.parse(config.vllm, tiered=bool(config.tiers))
    queue = compat.steps_in_flight(vllm_config)
    settings = dataclasses.replace(
        settings, planner=dataclasses.replace(settings.planner, steps_in_flight=queue)
    )
    return config, settings, CopyConfig.parse_mapping(config.copy)


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """``SupportsHMA``: vLLM keeps its hybrid KV cache manager on with kvtier; hybrid models'
    groups are stored and loaded each as they are (``kvtier.engine.hybrid``)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        self.vllm_version = compat.installed_version()
        compat.check_version(self.vllm_version)
        compat.check_sleep_mode(vllm_config, self.vllm_version)
        if role == KVConnectorRole.SCHEDULER and (
            warning := compat.warn_recovery(vllm_config, self.vllm_version)
        ):
            log.warning(warning)
        config, self.settings, copy = _load_config(vllm_config)
        blocks_per_slot = self.settings.planner.blocks_per_slot
        self.layout_request = compat.layout_request(
            self.settings.kv_cache_layout, self.vllm_version
        )
        engine_block_size = int(vllm_config.cache_config.block_size)
        parallel = vllm_config.parallel_config
        self.tp_size = int(parallel.tensor_parallel_size)
        # The slot layout and the job accounting assume exactly tp_size workers, worker r holding
        # head share r of whole engine blocks. Context parallelism breaks both: prefill CP adds
        # workers (world_size = TP x PCP: more reports per job, two workers per slot part) and
        # decode CP spreads a block's tokens over ranks (vLLM's scheduler blocks then span
        # block_size x DCP tokens).
        for name in (
            "pipeline_parallel_size",
            "prefill_context_parallel_size",
            "decode_context_parallel_size",
        ):
            size = getattr(parallel, name, 1)
            if int(size) != 1:
                raise ConfigError(name, size, "1 (kvtier supports tensor parallelism only)")
        # A job settles on the summed reports of all ranks, which only executors that merge every
        # worker's output (vLLM's KVOutputAggregator: mp, ray) deliver. A torchrun-style launcher
        # runs one engine per rank, each scheduler hearing from its own worker only.
        backend = getattr(parallel, "distributed_executor_backend", None)
        if self.tp_size > 1 and backend == "external_launcher":
            raise ConfigError(
                "distributed_executor_backend",
                backend,
                "an executor that gathers every rank's output ('mp', 'ray') when TP > 1",
            )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._hit_source: dict[str, Any] = {}
        self.groups = _groups(kv_cache_config)
        if len(self.groups) > 1:
            # One tensor per block for all layers is a single group's layout (0.25.1).
            self.layout_request = compat.LayoutRequest(self.layout_request.layout, False)
        if role == KVConnectorRole.SCHEDULER:
            # 0.25.1 resumes a hybrid Mamba model where its longest group's hit ends.
            hybrid_hits.install_for(kv_cache_config)
            self._scheduler = self._make_scheduler(vllm_config, config, engine_block_size)
            self._hit_source = compat.hit_source_map(config.tiers)
            if self.settings.trace_path is not None:
                from kvtier.recorder import TraceRecorder

                self._scheduler.recorder = TraceRecorder(
                    self.settings.trace_path, self._scheduler.block_tokens
                )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = WorkerSide(
                blocks_per_slot,
                get_tensor_model_parallel_rank(),
                self.tp_size,
                copy,
                config.pool.allow_pageable,
            )

    def _make_scheduler(
        self, vllm_config: Any, config: KVTierConfig, engine_block_size: int
    ) -> SchedulerSide:
        """The scheduler half: slots sized for the group with the most layers, one namespace
        for the model (its groups named in it when there are several)."""
        if not self.groups:
            raise ConfigError("kv_cache_groups", 0, "at least one KV cache group")
        page_bytes = max(g.page_bytes for g in self.groups)
        layers = max(len(g.layers) for g in self.groups)
        if len(self.groups) > 1:
            engine_block_size = self.groups[0].block_tokens  # one size (_groups checked it)
        blocks_per_slot = self.settings.planner.blocks_per_slot
        slot_bytes = self.tp_size * layers * blocks_per_slot * page_bytes
        page_order = compat.page_order(vllm_config, self.layout_request.layout, self.vllm_version)
        namespace = _namespace(
            vllm_config,
            config,
            engine_block_size,
            layers,
            page_bytes,
            page_order,
            blocks_per_slot,
            vllm_groups.tag(self.groups),
        )
        return SchedulerSide(
            config,
            self.settings,
            namespace,
            slot_bytes,
            engine_block_size,
            self.tp_size,
            self.groups,
            LandedLoads() if compat.strands_landed_loads(self.vllm_version) else None,
        )

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """The layout ``vllm.kv_cache_layout`` names, in this release's terms: by default
        block-outermost, where a block's pages of all layers are adjacent and move as one DMA
        copy on CUDA."""
        layout = _load_config(vllm_config)[1].kv_cache_layout
        return compat.layout_request(layout, compat.installed_version()).layout

    @property
    def prefer_cross_layer_blocks(self) -> bool:
        """vLLM 0.25's way to a block-outermost layout (later releases ignore it)."""
        return self.layout_request.cross_layer

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        return True  # unregister_kv_caches / restore_kv_caches follow the remap

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped store is just a future miss

    # -- scheduler side -------------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        block_ids = blocks.get_block_ids() if num_external_tokens else ()
        self._scheduler.after_alloc_groups(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return self._scheduler.build_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        assert self._scheduler is not None
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        self._scheduler.on_worker_meta(meta if isinstance(meta, KVTierWorkerMetadata) else None)

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        self._scheduler.request_finished(request)
        return False, None

    def request_finished_all_groups(
        self, request: Any, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` with every group's blocks (what vLLM calls with ``SupportsHMA``):
        kvtier keeps no engine block past the request's end, whatever the groups."""
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    def reset_cache(self) -> bool | None:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (after a weight update): no block
        stored before is a hit for this engine again (``Planner.reset``)."""
        if self._scheduler is None:
            return None
        self._scheduler.reset()
        return True

    def take_events(self) -> Iterable[KVCacheEvent]:
        if self._scheduler is None:
            return ()
        events = self._scheduler.take_events()
        if not events:
            return ()
        grouped: dict[tuple[EventKind, str], list[bytes]] = {}
        for event in events:
            grouped.setdefault((event.kind, event.tier), []).append(event.key)
        out: list[KVCacheEvent] = []
        block_tokens = self._scheduler.block_tokens
        for (kind, tier), keys in grouped.items():
            medium = f"kvtier:{tier}"
            if kind is EventKind.STORED:
                out.append(
                    BlockStored(
                        block_hashes=list(keys),
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=block_tokens,
                        lora_id=None,
                        medium=medium,
                        lora_name=None,
                    )
                )
            else:
                out.append(BlockRemoved(block_hashes=list(keys), medium=medium))
        return out

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This step's stats: the scheduler half's counter increments, gauges and promotion
        waits, or a worker's copy stats (vLLM merges the ranks and both halves)."""
        if self._scheduler is not None:
            payload = self._scheduler.take_stats()
        elif self._worker is not None:
            payload = self._worker.take_stats()
        else:
            return None
        return None if payload is None else KVTierStats(data=payload)

    def stats_snapshot(self) -> dict[str, Any]:
        """The scheduler half's cumulative stats (what ``vllm.stats_path`` holds)."""
        assert self._scheduler is not None
        return self._scheduler.stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KVTierStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        """vLLM's prefix-cache hits by source (0.32+): the host pool (and memory tiers) as
        ``host``, fs tiers as ``disk``, Redis as ``external_unspecified``."""
        if self._scheduler is None or not num_external_tokens:
            return {}
        split = self._scheduler.take_hit_sources(request.request_id)
        out: dict[Any, int] = {}
        for tier, tokens in split.items():
            source = self._hit_source.get(tier)
            if source is not None and tokens:
                out[source] = out.get(source, 0) + tokens
        if sum(out.values()) != num_external_tokens:
            # vLLM counts what it allocated; kvtier planned otherwise (a stale plan): say so.
            return compat.unspecified_hit_source(num_external_tokens)
        return out

    # -- worker side ----------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self._worker is not None
        states = any(isinstance(t, list | tuple) for t in kv_caches.values())  # Mamba, 0.25.1
        if len(self.groups) > 1 or states:
            self._worker.register_groups(vllm_groups.group_tensors(self.groups, kv_caches))
        else:
            self._worker.register(list(kv_caches.values()))

    def register_cross_layers_kv_cache(self, kv_cache: Any, attn_backend: Any) -> None:
        assert self._worker is not None
        self._worker.register(compat.cross_layer_views(kv_cache, attn_backend))

    def unregister_kv_caches(self) -> None:
        """Before a sleep (vLLM 0.33): the KV memory goes away, so the copy backend does too."""
        if self._worker is not None:
            self._worker.suspend()

    def restore_kv_caches(self) -> None:
        if self._worker is not None:
            self._worker.resume()

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        # Called every step before anything writes KV: blocks of stores still in flight may
        # have been freed and handed to another request.
        if self._worker is not None:
            meta = kv_connector_metadata
            self._worker.fence(meta if isinstance(meta, KVTierMetadata) else None)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self._worker.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finished in start_load_kv

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # whole blocks are copied once per step in wait_for_save

    def wait_for_save(self) -> None:
        assert self._worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self._worker.save(meta)

    def build_connector_worker_meta(self) -> KVTierWorkerMetadata | None:
        return self._worker.take_meta() if self._worker is not None else None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous loads (``vllm.async_loads``) ended; kvtier sends nothing."""
        if self._worker is None:
            return None, None
        return None, self._worker.take_finished_loads() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.take_load_errors() if self._worker is not None else set()

    def shutdown(self) -> None:
        if self._scheduler is not None:
            with contextlib.suppress(Exception):
                self._scheduler.close()
            self._scheduler = None
        if self._worker is not None:
            with contextlib.suppress(Exception):
                self._worker.close()
            self._worker = None


def _groups(kv_cache_config: Any) -> list[CacheGroup]:
    """The model's KV cache groups (none where vLLM gives a worker no ``kv_cache_config``: its
    tensors are then one group's); several only with vLLM's hybrid KV cache manager on. Groups of
    different block or page sizes cannot share kvtier's blocks: such a model is refused."""
    groups = vllm_groups.describe(kv_cache_config)
    if len(groups) > 1 and (why := vllm_groups.uniform(groups)) is not None:
        raise ConfigError("kv_cache_groups", len(groups), f"groups kvtier can share ({why})")
    return groups


def _namespace(
    vllm_config: Any,
    config: KVTierConfig,
    block_size: int,
    layers: int,
    page_bytes: int,
    page_order: str | None,
    blocks_per_slot: int,
    groups_tag: str = "",
) -> Namespace:
    """Everything that decides the bytes of a block: model, dtypes, geometry, attention packing.
    A page's bytes follow the order of its dimensions (``page_order``), not where the layers and
    blocks are: block-outermost and layer-outermost layouts share slots."""
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    dtype = str(model_config.dtype) if cache_dtype == "auto" else cache_dtype
    device = str(current_platform.device_type)
    packing = f"{device}-{page_order}" if page_order else device
    if device == "cpu":
        with contextlib.suppress(Exception):
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            head = model_config.get_head_size()
            packing = f"cpu-{_get_attn_isa(model_config.dtype, block_size, head, cache_dtype)}"
    assert config.model is not None
    return Namespace(
        model=config.model,
        dtype=dtype,
        block_tokens=block_size * blocks_per_slot,
        layout=f"vllm/{packing}/engine-block-{block_size}",
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        extra=f"layers={layers};page_bytes={page_bytes};revision={model_config.revision}"
        + (f";{groups_tag}" if groups_tag else ""),
        tenant=config.tenant,
    )
