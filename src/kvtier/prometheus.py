"""kvtier's series (:mod:`kvtier.series`) in a ``prometheus-client`` registry, for engines other
than vLLM and for ``kvtier simulate --metrics-port``. Needs the optional extra
``kvtier[prometheus]``.

    exporter = PrometheusExporter()            # the default registry, or registry=...
    exporter.update(cache.stats())             # as often as you like: counters grow by the change
    server = serve(9400)                       # http://127.0.0.1:9400/metrics
    server.close()                             # addr="0.0.0.0" serves other hosts too

The names are the catalogue's (``kvtier_hit_blocks_total{tier="fs"}``, ...); vLLM exposes the
same series as ``vllm:kvtier_...``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

from kvtier import series
from kvtier.errors import KVTierError
from kvtier.extras import install_hint
from kvtier.metrics import CacheStats
from kvtier.metrics_server import (
    DEFAULT_ADDR,
    DEFAULT_IDLE_TIMEOUT_S,
    DEFAULT_MAX_CONNECTIONS,
    MetricsServer,
    ServerLimits,
)


class PrometheusMissing(KVTierError):
    """prometheus-client is not installed."""


def _client() -> Any:
    try:
        import prometheus_client
    except ImportError:
        raise PrometheusMissing(
            "kvtier's Prometheus exporter needs prometheus-client: " + install_hint("prometheus")
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


def serve(
    port: int,
    registry: Any = None,
    addr: str = DEFAULT_ADDR,
    *,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
) -> MetricsServer:
    """Serve ``/metrics`` on ``addr:port`` from a daemon thread; returns the server (``port`` 0
    picks a free one: ``server.server_port``; ``server.close()`` stops it).

    ``addr`` is loopback unless given (``0.0.0.0`` or ``::`` for every host). At most
    ``max_connections`` are served at once (more are refused and counted); a connection that
    has not sent its request within ``idle_timeout_s`` is closed (see kvtier.metrics_server).
    ``ExporterError``, one line, when the address is bad or the port is taken."""
    client = _client()
    limits = ServerLimits(addr, port, max_connections, idle_timeout_s)
    chosen = client.REGISTRY if registry is None else registry
    return MetricsServer(
        limits, lambda: bytes(client.generate_latest(chosen)), client.CONTENT_TYPE_LATEST
    )


class ReplayMetrics:
    """``kvtier simulate --metrics-port``: the replay's cache stats in a registry of their own,
    served within ``limits`` while the replay runs and ``hold`` seconds after it."""

    EVERY = 20
    """Requests between two updates (and one after the last)."""

    def __init__(self, limits: ServerLimits) -> None:
        client = _client()  # a clear error without prometheus-client
        self.registry = client.CollectorRegistry()
        self.exporter = PrometheusExporter(self.registry)
        self.server = serve(
            limits.port,
            self.registry,
            limits.addr,
            max_connections=limits.max_connections,
            idle_timeout_s=limits.idle_timeout_s,
        )
        self.requests = 0
        self.cache: Any = None
        print(f"metrics     {self.server.url}", file=sys.stderr, flush=True)

    def after_request(self, cache: Any) -> None:
        self.cache = cache
        self.requests += 1
        if self.requests % self.EVERY == 0:
            self.exporter.update(cache.stats())

    def hold(self, seconds: float) -> None:
        if self.cache is not None:
            self.exporter.update(self.cache.stats())
        try:
            if seconds > 0:
                time.sleep(seconds)
        finally:
            self.server.close()
        counts = self.server.counts
        if counts.refused or counts.timed_out:
            print(
                f"metrics     {counts.served} scrapes served, {counts.refused} connections "
                f"refused (over {self.server.limits.max_connections}), {counts.timed_out} "
                "timed out",
                file=sys.stderr,
            )
