"""kvtier's metric series, one catalogue for every exporter (vLLM's ``/metrics``, a
``prometheus-client`` registry, the Grafana dashboard in ``docs/``).

Exporters move *payloads* (:class:`Payload`): counter increments, gauge values and histogram
samples, each keyed by series name and one label value (``""`` for unlabelled series). Payloads
are plain dicts of str, numbers and lists, so they cross vLLM's process boundaries (pickle and
msgpack) unchanged, and merge by summing counters, keeping the latest gauges and concatenating
samples (:func:`merge`): per engine step, over tensor-parallel workers, over a log interval.

A source of cumulative counters (``TieredCache.stats()``, the vLLM connector's own counters)
becomes a payload of increments through :class:`DeltaTracker`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvtier.events import POOL_TIER
from kvtier.metrics import CacheStats


class Kind(Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    """Without prefix: vLLM exposes ``vllm:`` + name, a plain registry ``name``; prometheus-client
    adds ``_total`` to counters."""
    kind: Kind
    doc: str
    label: str | None = None
    """The one label besides the exporter's own (vLLM: ``model_name``, ``engine``)."""
    buckets: tuple[float, ...] = ()


def _c(name: str, doc: str, label: str | None = None) -> Series:
    return Series(name, Kind.COUNTER, doc, label)


def _g(name: str, doc: str, label: str | None = None) -> Series:
    return Series(name, Kind.GAUGE, doc, label)


def _h(name: str, doc: str) -> Series:
    return Series(name, Kind.HISTOGRAM, doc, None, LATENCY_BUCKETS)


SERIES: tuple[Series, ...] = (
    # Lookups and hits (blocks of block.tokens tokens).
    _c("kvtier_lookups", "kvtier lookups answered finally (a deferred request counts once more)."),
    _c("kvtier_pending_lookups", "kvtier lookups answered 'ask again' (promotion in flight)."),
    _c("kvtier_lookup_blocks", "Blocks looked up in final kvtier answers."),
    _c(
        "kvtier_hit_blocks",
        "Looked-up blocks found, by the tier that held them (pool: already in the host pool; "
        "a secondary tier: promoted from it).",
        "tier",
    ),
    _c("kvtier_promotions", "Blocks whose promotion from a secondary tier into the pool started."),
    _c("kvtier_promotion_failures", "Promotions that failed (the lookup became a miss)."),
    _c(
        "kvtier_promotions_declined",
        "Blocks found in a tier and not promoted: over the promotion budget, or expected to be "
        "read later than the engine would compute them.",
    ),
    # Loads and stores between the engine and the pool.
    _c("kvtier_loaded_blocks", "Blocks copied from the pool into the engine."),
    _c("kvtier_load_failed_blocks", "Blocks whose load failed (the engine recomputes them)."),
    _c("kvtier_stored_blocks", "Blocks copied from the engine into the pool."),
    _c(
        "kvtier_store_skipped_blocks",
        "Blocks not stored: present (already in the pool), admission (not admitted yet), "
        "full (pool full of pinned blocks).",
        "reason",
    ),
    _c("kvtier_store_failed_blocks", "Stores whose copy failed (the slot was released)."),
    _c("kvtier_evictions", "Blocks evicted, by tier (pool or a secondary tier).", "tier"),
    # Secondary tiers.
    _c("kvtier_read_bytes", "Bytes read from a secondary tier (promotions).", "tier"),
    _c("kvtier_written_bytes", "Bytes written to a secondary tier (cascade writes).", "tier"),
    _c("kvtier_read_blocks", "Blocks read from a secondary tier.", "tier"),
    _c("kvtier_written_blocks", "Blocks written to a secondary tier.", "tier"),
    _c("kvtier_errors", "I/O or server errors of a secondary tier (blocks).", "tier"),
    _c(
        "kvtier_corrupt_blocks",
        "Payloads whose header or checksum did not match (dropped, never served).",
        "tier",
    ),
    _c("kvtier_rejected_blocks", "Blocks a tier did not write (full, unhealthy, too big).", "tier"),
    _c("kvtier_tier_timeouts", "Tier jobs that timed out, by tier.", "tier"),
    _c("kvtier_cascade_writes", "Blocks whose copy to a secondary tier started."),
    _c("kvtier_cascade_failures", "Cascade writes that failed."),
    _c(
        "kvtier_cascade_skipped",
        "Blocks not written to a tier: its writes paused, or copies held their share of the pool.",
    ),
    # The pool.
    _g("kvtier_pool_slots", "Host pool capacity in blocks."),
    _g("kvtier_pool_used_slots", "Host pool slots holding a block or reserved for one."),
    _g("kvtier_pool_pinned_slots", "Host pool blocks pinned by loads or cascade writes."),
    _g(
        "kvtier_prefill_tokens_per_second",
        "A request's prefill rate, as the promotion cost rules measure it (0: not yet).",
    ),
    _g(
        "kvtier_tier_read_tokens_per_second",
        "Tokens per second a tier reads, as the promotion cost rules measure it (0: not yet).",
        "tier",
    ),
    # The engine connector.
    _c("kvtier_requests_looked_up", "Engine requests looked up in kvtier."),
    _c(
        "kvtier_deferred_lookups",
        "Engine lookups deferred while a promotion from a secondary tier ran.",
    ),
    _c("kvtier_hit_tokens", "Prompt tokens loaded from kvtier instead of computed."),
    _c(
        "kvtier_engine_hit_blocks",
        "Blocks the engine's own prefix cache held at kvtier's lookups (not looked up).",
    ),
    _g("kvtier_jobs_in_flight", "Engine copy jobs ordered and not yet reported by every worker."),
    _h(
        "kvtier_promotion_wait_seconds",
        "Time an engine request waited for promotions (first deferred lookup to final answer).",
    ),
    # Worker-side copies (summed over tensor-parallel ranks).
    _c(
        "kvtier_copy_bytes",
        "Bytes copied between engine KV and the pool, by direction.",
        "direction",
    ),
    _c(
        "kvtier_copy_seconds",
        "Seconds spent copying between engine KV and the pool, by direction (rate of "
        "kvtier_copy_bytes over rate of this: copy throughput).",
        "direction",
    ),
    _c("kvtier_copy_jobs", "Copy jobs run, by direction.", "direction"),
    _c("kvtier_copy_failed_jobs", "Copy jobs that failed, by direction.", "direction"),
    _h(
        "kvtier_load_seconds",
        "Time a worker took to copy a step's loads from the pool into engine KV (one sample "
        "per engine step with loads and tensor-parallel rank).",
    ),
)
BY_NAME: dict[str, Series] = {s.name: s for s in SERIES}

Values = dict[str, dict[str, float]]
"""Series name -> label value -> number."""
Payload = dict[str, Any]
"""``{"counters": Values, "gauges": Values, "histograms": {name: {label: [samples]}}}``."""


POOL_LABELLED = frozenset({"kvtier_hit_blocks", "kvtier_evictions"})
"""Tier-labelled series that count the pool too."""


def label_values(s: Series, tiers: Sequence[str]) -> list[str]:
    """The label values a series has from the start: ``""`` when unlabelled, the configured
    tiers (and ``pool`` where it counts), both directions, every skip reason."""
    if s.label is None:
        return [""]
    if s.label == "tier":
        return [POOL_TIER, *tiers] if s.name in POOL_LABELLED else list(tiers)
    if s.label == "direction":
        return ["load", "store"]
    if s.label == "reason":
        return ["present", "admission", "full"]
    return []


def empty_payload() -> Payload:
    return {"counters": {}, "gauges": {}, "histograms": {}}


def is_empty(payload: Mapping[str, Any]) -> bool:
    return not any(payload.get(part) for part in ("counters", "gauges", "histograms"))


def merge(a: Mapping[str, Any], b: Mapping[str, Any]) -> Payload:
    """A new payload: ``a`` then ``b`` (counters summed, gauges from ``b``, samples joined)."""
    out = empty_payload()
    for part in ("counters", "gauges", "histograms"):
        target: dict[str, dict[str, Any]] = out[part]
        for source in (a, b):
            for name, labels in source.get(part, {}).items():
                slot = target.setdefault(name, {})
                for label, value in labels.items():
                    if part == "counters":
                        slot[label] = slot.get(label, 0) + value
                    elif part == "gauges":
                        slot[label] = value
                    else:
                        slot[label] = [*slot.get(label, ()), *value]
    return out


def add_counter(payload: Payload, name: str, value: float, label: str = "") -> None:
    if value:
        labels = payload["counters"].setdefault(name, {})
        labels[label] = labels.get(label, 0) + value


def add_sample(payload: Payload, name: str, value: float, label: str = "") -> None:
    payload["histograms"].setdefault(name, {}).setdefault(label, []).append(value)


def cache_counters(stats: CacheStats, hits_by_tier: Mapping[str, int] | None = None) -> Values:
    """Cumulative counter values of a ``TieredCache.stats()`` snapshot.

    ``hits_by_tier``: hit blocks by the tier that held them, where the caller counted them
    (an engine connector, from ``TieredCache.origins``); without it, pool hits are all hits minus
    promoted blocks and a secondary tier's hits are the blocks promoted from it."""
    c = stats.cache
    if hits_by_tier is None:
        promoted = sum(stats.promoted.values())
        hits_by_tier = {POOL_TIER: max(c.hit_blocks - promoted, 0), **stats.promoted}
    out: Values = {
        "kvtier_lookups": {"": c.lookups - c.pending_lookups},
        "kvtier_pending_lookups": {"": c.pending_lookups},
        "kvtier_lookup_blocks": {"": c.lookup_blocks},
        "kvtier_hit_blocks": dict(hits_by_tier),
        "kvtier_promotions": {"": c.promotions},
        "kvtier_promotion_failures": {"": c.promotion_failures},
        "kvtier_promotions_declined": {"": c.promotions_declined},
        "kvtier_loaded_blocks": {"": c.loaded_blocks},
        "kvtier_load_failed_blocks": {"": c.load_failed},
        "kvtier_stored_blocks": {"": c.stored_blocks},
        "kvtier_store_skipped_blocks": {
            "present": c.store_skipped_present,
            "admission": c.store_skipped_admission,
            "full": c.store_skipped_full,
        },
        "kvtier_store_failed_blocks": {"": c.store_failed},
        "kvtier_evictions": {POOL_TIER: c.pool_evictions},
        "kvtier_cascade_writes": {"": c.cascade_writes},
        "kvtier_cascade_failures": {"": c.cascade_failures},
        "kvtier_cascade_skipped": {"": c.cascade_skipped},
    }
    per_tier = (
        ("kvtier_read_bytes", "read_bytes"),
        ("kvtier_written_bytes", "write_bytes"),
        ("kvtier_read_blocks", "read_blocks"),
        ("kvtier_written_blocks", "write_blocks"),
        ("kvtier_errors", "errors"),
        ("kvtier_corrupt_blocks", "corrupt"),
        ("kvtier_rejected_blocks", "rejected"),
        ("kvtier_tier_timeouts", "timeouts"),
        ("kvtier_evictions", "evictions"),
    )
    for name, tier in stats.tiers.items():
        for series, attr in per_tier:
            out.setdefault(series, {})[name] = getattr(tier, attr)
    return out


def pool_gauges(stats: CacheStats) -> Values:
    return {
        "kvtier_pool_slots": {"": stats.pool_slots},
        "kvtier_pool_used_slots": {"": stats.pool_used},
        "kvtier_pool_pinned_slots": {"": stats.pool_pinned},
        "kvtier_prefill_tokens_per_second": {"": round(stats.prefill_tokens_per_s or 0.0)},
        "kvtier_tier_read_tokens_per_second": {
            name: round(stats.read_tokens_per_s.get(name, 0.0)) for name in stats.tiers
        },
    }


class DeltaTracker:
    """Turns cumulative counter values into increments since the previous call."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: Values = {}

    def delta(self, cumulative: Values) -> Values:
        out: Values = {}
        last = self._last
        for name, labels in cumulative.items():
            seen = last.setdefault(name, {})
            for label, value in labels.items():
                diff = value - seen.get(label, 0)
                if diff:
                    out.setdefault(name, {})[label] = diff
                    seen[label] = value
        return out


def check_payload(payload: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` for a series the catalogue does not have, or of the wrong kind."""
    kinds = {"counters": Kind.COUNTER, "gauges": Kind.GAUGE, "histograms": Kind.HISTOGRAM}
    for part, kind in kinds.items():
        for name in payload.get(part, {}):
            series = BY_NAME.get(name)
            if series is None or series.kind is not kind:
                raise ValueError(f"unknown kvtier {kind.value} series {name!r}")
