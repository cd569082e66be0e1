"""The ``vllm`` section of a kvtier config: options only the vLLM connector reads, parsed here from
the mapping the core config keeps as given (``KVTierConfig.vllm``), once per connector.

The planner's options (``blocks_per_slot``, ``store_generated``, ``async_loads``, ``stats_path``)
are parsed into the engine-neutral ``PlannerSettings`` that the scheduler side is built with.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.engine.load_mode import LoadMode
from kvtier.engine.planner_settings import PlannerSettings
from kvtier.errors import ConfigError
from kvtier.integrations.vllm.compat import LAYOUT_NAMES
from kvtier.validation import Section

ENGINE_LAYOUT = "engine"
"""``vllm.kv_cache_layout``: ask vLLM for no particular KV cache layout."""
BLOCK_OUTERMOST_LAYOUT = "BLNHC"
"""The default ``vllm.kv_cache_layout``: blocks outermost, then layers; pages as vLLM's default."""


@dataclass(frozen=True, slots=True)
class VllmSettings:
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    """``blocks_per_slot`` (vLLM blocks per kvtier block), ``store_generated``, ``async_loads``
    (``load_mode``: which loads go through vLLM's asynchronous path, where a request waits for
    its blocks while the others run) and ``stats_path`` (the scheduler's stats as JSON, each
    second and at shutdown)."""
    trace_path: str | None = None
    """Append every request looked up to this Mooncake-format trace (``kvtier simulate --trace``
    replays it); block ids are salted digests of kvtier keys (the salt in ``<path>.salt``)."""
    window_boundary_blocks: int = 0
    """Hybrid models: a sliding-window group's blocks, and a Mamba group's state, are stored at
    the end of what a request stored and every this many kvtier blocks (the boundaries a later
    request can resume from); 0: four windows (a state: one block), at least 16
    (``kvtier.engine.groups.auto_boundary_blocks``)."""
    keep_order: bool = True
    """While a lookup is deferred (a tier read in flight, say), the requests vLLM asks about
    after it in the same scheduling pass wait too, as they would behind a request vLLM cannot
    allocate: vLLM moves a deferred request aside and schedules the ones behind it, which then
    take the GPU KV cache room it needed (``SchedulerSide.matched_tokens``)."""
    kv_cache_layout: str = BLOCK_OUTERMOST_LAYOUT
    """The KV cache layout asked of vLLM (a 0.32 ``KVCacheLayout`` name, translated for older
    releases by ``compat.layout_request``), or ``engine`` to ask for none.
    The default keeps a block's pages of all layers next to each other, so that a block moves as
    one copy; vLLM uses it where every attention backend allows it and its own choice otherwise."""

    @classmethod
    def parse(cls, data: Mapping[str, Any], *, tiered: bool) -> VllmSettings:
        """The section; ``tiered``: the config has secondary tiers (``async_loads``' default)."""
        s = Section(data, "vllm")
        planner = PlannerSettings(
            blocks_per_slot=s.integer("blocks_per_slot", 1, minimum=1, maximum=1024),
            store_generated=s.boolean("store_generated", False),
            load_mode=_load_mode(s, default_load_mode(tiered)),
            stats_path=s.optional_file_path("stats_path"),
        )
        settings = cls(
            planner=planner,
            kv_cache_layout=s.string("kv_cache_layout", BLOCK_OUTERMOST_LAYOUT),
            trace_path=s.optional_file_path("trace_path"),
            keep_order=s.boolean("keep_order", True),
            window_boundary_blocks=s.integer("window_boundary_blocks", 0, minimum=0),
        )
        if settings.kv_cache_layout not in (ENGINE_LAYOUT, *LAYOUT_NAMES):
            raise ConfigError(
                "vllm.kv_cache_layout",
                settings.kv_cache_layout,
                f"{ENGINE_LAYOUT!r} or one of vLLM 0.32's layout names: {', '.join(LAYOUT_NAMES)}",
            )
        s.done()
        return settings


def default_load_mode(tiered: bool) -> LoadMode:
    """``async_loads`` when the config leaves it out: ``"auto"`` for a host pool alone,
    synchronous with secondary tiers. On an H100 (vLLM 0.25.1) the pool alone with ``"auto"``
    was at or within 3% of vLLM's CPU offloading on TTFT p50 at 4 and 8 conversations in
    flight, where synchronous loads kept the engine in lockstep (p50 1.18-1.42x at 4 in
    flight); with an fs tier, on the same H100, ``"auto"`` fixed the p50 at 4 in flight but
    failed as many of the grid's checks at the 4 and 8 in flight points (10 against 9;
    docs/vllm.md, the grid)."""
    return LoadMode.SYNC if tiered else LoadMode.AUTO


def _load_mode(s: Section, default: LoadMode) -> LoadMode:
    """``async_loads``: ``false`` (synchronous), ``true`` (asynchronous) or ``"auto"`` (per
    request, ``kvtier.engine.planner.load_async``); ``default`` when left out."""
    if not s.has("async_loads"):
        s.boolean("async_loads", False)  # read as left out: a typo's message lists it as known
        return default
    if s.data.get("async_loads") == LoadMode.AUTO.value:
        return s.choice("async_loads", LoadMode)
    try:
        return LoadMode.ASYNC if s.boolean("async_loads", False) else LoadMode.SYNC
    except ConfigError:
        raise ConfigError(
            s.field("async_loads"), s.data.get("async_loads"), "true, false or 'auto'"
        ) from None
