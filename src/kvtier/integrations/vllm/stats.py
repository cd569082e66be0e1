"""kvtier's stats in vLLM: ``KVConnectorStats`` per engine step and Prometheus series.

The path through vLLM (0.25.1 to 0.33): every worker returns its copy stats each step
(``get_kv_connector_stats``); vLLM's ``KVOutputAggregator`` merges the tensor-parallel ranks with
:meth:`KVTierStats.aggregate`, the scheduler merges in the scheduler half's stats (increments of
the manager's and the connector's counters since the previous step, the pool gauges, promotion
waits), and the result travels as ``KVTierStats.data`` (a :mod:`kvtier.series` payload) to the
front-end process. There ``build_kv_connector_stats`` rebuilds it for the periodic log line
(:meth:`KVTierStats.reduce`: a one-line summary of the interval) and ``build_prom_metrics``
records it as ``vllm:kvtier_*`` series on ``/metrics``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvtier import series
from kvtier.events import POOL_TIER

PREFIX = "vllm:"
"""vLLM's metric names start with ``vllm:`` (``vllm:kv_offload_load_bytes``, ...)."""


@dataclass
class KVTierStats(KVConnectorStats):
    """A :mod:`kvtier.series` payload: what happened in one or more engine steps."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()

    def reset(self) -> None:
        self.data: dict[str, Any] = series.empty_payload()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        if self.is_empty():
            return other
        return KVTierStats(data=series.merge(self.data, other.data))

    def is_empty(self) -> bool:
        return series.is_empty(self.data)

    def reduce(self) -> dict[str, int | float]:
        return summary(self.data)


def summary(payload: dict[str, Any]) -> dict[str, int | float]:
    """The interval in a few numbers, for vLLM's log line ("KV Transfer metrics: k=v, ...")."""
    counters: dict[str, dict[str, float]] = payload.get("counters", {})
    gauges: dict[str, dict[str, float]] = payload.get("gauges", {})

    def total(name: str) -> float:
        return sum(counters.get(name, {}).values())

    looked = total("kvtier_lookup_blocks")
    hits = counters.get("kvtier_hit_blocks", {})
    out: dict[str, int | float] = {
        "kvtier_lookup_blocks": int(looked),
        "kvtier_hit_ratio": round(sum(hits.values()) / looked, 3) if looked else 0.0,
    }
    for tier in sorted(hits, key=lambda t: (t != POOL_TIER, t)):
        out[f"kvtier_hits_{tier}"] = int(hits[tier])
    out["kvtier_hit_tokens"] = int(total("kvtier_hit_tokens"))
    out["kvtier_stored_blocks"] = int(total("kvtier_stored_blocks"))
    for direction in ("load", "store"):
        moved = counters.get("kvtier_copy_bytes", {}).get(direction, 0)
        seconds = counters.get("kvtier_copy_seconds", {}).get(direction, 0)
        out[f"kvtier_{direction}_GiB"] = round(moved / 2**30, 3)
        out[f"kvtier_{direction}_GiB_per_s"] = round(moved / seconds / 2**30, 3) if seconds else 0.0
    used = gauges.get("kvtier_pool_used_slots", {}).get("")
    slots = gauges.get("kvtier_pool_slots", {}).get("")
    if used is not None and slots:
        out["kvtier_pool_used"] = round(used / slots, 3)
    failures = (
        total("kvtier_load_failed_blocks")
        + total("kvtier_store_failed_blocks")
        + total("kvtier_errors")
        + total("kvtier_corrupt_blocks")
        + total("kvtier_promotion_failures")
    )
    out["kvtier_failures"] = int(failures)
    return out


def _tier_names(vllm_config: Any) -> list[str]:
    """The secondary tiers' names in the connector's config (best effort: the connector itself
    validates the config)."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    extra = getattr(transfer, "kv_connector_extra_config", None) or {}
    tiers = extra.get("tiers") if isinstance(extra, dict) else None
    names: list[str] = []
    for i, tier in enumerate(tiers if isinstance(tiers, list) else []):
        if isinstance(tier, dict):
            names.append(str(tier.get("name") or tier.get("kind") or f"tier{i}"))
    return names


class KVTierPromMetrics(KVConnectorPromMetrics):
    """Every series of :data:`kvtier.series.SERIES` as ``vllm:<name>``, labelled like vLLM's own
    (``model_name``, ``engine``) plus the series' label (``tier``, ``direction``, ``reason``)."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._metrics: dict[str, Any] = {}
        self._bound: dict[tuple[int, str, str], Any] = {}
        for s in series.SERIES:
            names = [*labelnames, *([s.label] if s.label else [])]
            kwargs: dict[str, Any] = {
                "name": PREFIX + s.name,
                "documentation": s.doc,
                "labelnames": names,
            }
            if s.kind is series.Kind.COUNTER:
                cls = self._counter_cls
            elif s.kind is series.Kind.GAUGE:
                cls = self._gauge_cls
                kwargs["multiprocess_mode"] = "mostrecent"
            else:
                cls = self._histogram_cls
                kwargs["buckets"] = list(s.buckets)
            try:
                metric = cls(**kwargs)
            except TypeError:  # a Gauge class without multiprocess_mode
                kwargs.pop("multiprocess_mode", None)
                metric = cls(**kwargs)
            self._metrics[s.name] = metric
            # Known series show up at 0 before the first step (dashboards, rate()).
            for label in series.label_values(s, _tier_names(vllm_config)):
                for engine in per_engine_labelvalues:
                    self._child(s.name, engine, label)

    def _child(self, name: str, engine: int, label: str) -> Any:
        key = (engine, name, label)
        child = self._bound.get(key)
        if child is None:
            values = [*self.per_engine_labelvalues[engine], *([label] if label else [])]
            child = self._bound[key] = self._metrics[name].labels(*values)
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for name, labels in data.get("counters", {}).items():
            if name in self._metrics:
                for label, value in labels.items():
                    if value > 0:
                        self._child(name, engine_idx, label).inc(value)
        for name, labels in data.get("gauges", {}).items():
            if name in self._metrics:
                for label, value in labels.items():
                    self._child(name, engine_idx, label).set(value)
        for name, labels in data.get("histograms", {}).items():
            if name in self._metrics:
                for label, values in labels.items():
                    child = self._child(name, engine_idx, label)
                    for value in values:
                        child.observe(value)
