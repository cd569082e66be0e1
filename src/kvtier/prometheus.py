"""kvtier's series (:mod:`kvtier.series`) in a ``prometheus-client`` registry, for engines other
than vLLM and for ``kvtier simulate --metrics-port``. Needs the optional extra
``kvtier[prometheus]``.

    exporter = PrometheusExporter()            # the default registry, or registry=...
    exporter.update(cache.stats())             # as often as you like: counters grow by the change
    serve(9400)                                # http://HOST:9400/metrics

The names are the catalogue's (``kvtier_hit_blocks_total{tier="fs"}``, ...); vLLM exposes the
same series as ``vllm:kvtier_...``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvtier import series
from kvtier.errors import KVTierError
from kvtier.metrics import CacheStats


class PrometheusMissing(KVTierError):
    """prometheus-client is not installed."""


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise PrometheusMissing(
            "kvtier's Prometheus exporter needs prometheus-client: pip install 'kvtier[prometheus]'"
        ) from None
    return prometheus_client


class PrometheusExporter:
    """Every catalogue series registered in ``registry`` (default: prometheus-client's)."""

    def __init__(self, registry: Any = None) -> None:
        client = _client()
        self.registry = client.REGISTRY if registry is None else registry
        self._metrics: dict[str, Any] = {}
        self._delta = series.DeltaTracker()
        for s in series.SERIES:
            labels = [s.label] if s.label else []
            if s.kind is series.Kind.COUNTER:
                metric = client.Counter(s.name, s.doc, labels, registry=self.registry)
            elif s.kind is series.Kind.GAUGE:
                metric = client.Gauge(s.name, s.doc, labels, registry=self.registry)
            else:
                metric = client.Histogram(
                    s.name, s.doc, labels, registry=self.registry, buckets=s.buckets
                )
            self._metrics[s.name] = metric

    def update(self, stats: CacheStats) -> None:
        """Record a ``TieredCache.stats()`` snapshot: counters grow by what changed since the
        previous one, gauges take its values."""
        payload = series.empty_payload()
        payload["counters"] = self._delta.delta(series.cache_counters(stats))
        payload["gauges"] = series.pool_gauges(stats)
        self.observe(payload)

    def observe(self, payload: Mapping[str, Any]) -> None:
        """Record a payload (increments, gauge values, histogram samples)."""
        series.check_payload(payload)
        for name, labels in payload.get("counters", {}).items():
            for label, value in labels.items():
                if value > 0:
                    self._child(name, label).inc(value)
        for name, labels in payload.get("gauges", {}).items():
            for label, value in labels.items():
                self._child(name, label).set(value)
        for name, labels in payload.get("histograms", {}).items():
            for label, values in labels.items():
                child = self._child(name, label)
                for value in values:
                    child.observe(value)

    def _child(self, name: str, label: str) -> Any:
        metric = self._metrics[name]
        return metric.labels(label) if series.BY_NAME[name].label else metric


def serve(port: int, registry: Any = None, addr: str = "0.0.0.0") -> Any:
    """Serve ``/metrics`` on ``addr:port`` from a daemon thread; returns the server (``port`` 0
    picks a free one: ``server.server_port``)."""
    client = _client()
    server, _thread = client.start_http_server(
        port, addr=addr, registry=client.REGISTRY if registry is None else registry
    )
    return server
