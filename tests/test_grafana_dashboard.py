"""docs/grafana-kvtier.json: valid JSON, and every series its panels query is one kvtier
exports, under the name it has on a real ``/metrics`` page."""

from __future__ import annotations

import json
import re
from pathlib import Path

from support import require

prometheus_client = require.importorskip("prometheus_client", "extras")

from kvtier import series  # noqa: E402
from kvtier.prometheus import PrometheusExporter  # noqa: E402

DASHBOARD = Path(__file__).resolve().parents[1] / "docs" / "grafana-kvtier.json"
NAME = re.compile(r"\$\{prefix\}([a-zA-Z_:][a-zA-Z0-9_:]*)")


def exposed_names() -> set[str]:
    """Sample names on a /metrics page of an exporter with every label value seen once."""
    registry = prometheus_client.CollectorRegistry()
    exporter = PrometheusExporter(registry)
    payload = series.empty_payload()
    for s in series.SERIES:
        labels = series.label_values(s, ["fs"]) or ["x"]
        part = {"counter": "counters", "gauge": "gauges", "histogram": "histograms"}[s.kind.value]
        for label in labels:
            payload[part].setdefault(s.name, {})[label] = [0.1] if part == "histograms" else 1
    exporter.observe(payload)
    text = prometheus_client.generate_latest(registry).decode()
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line[:1] != "#"}


def test_dashboard_queries_only_series_that_exist() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(dashboard["panels"]) >= 10 and exprs
    names = exposed_names()
    used: set[str] = set()
    for expr in exprs:
        found = NAME.findall(expr)
        assert found, f"a query without a kvtier series: {expr}"
        # Every metric in a query goes through the prefix variable (vllm: or none).
        assert "kvtier_" not in NAME.sub("", expr), expr
        for name in found:
            assert name in names, f"{name} is not exported (query: {expr})"
            used.add(name)
    prefix = next(v for v in dashboard["templating"]["list"] if v["name"] == "prefix")
    assert prefix["query"] == "vllm:"
    # The dashboard covers every family of the catalogue.
    covered = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in used}
    missing = {s.name for s in series.SERIES} - covered
    assert not missing, f"series without a panel: {sorted(missing)}"


def test_a_misspelt_series_is_caught() -> None:
    assert "kvtier_hit_block_total" not in exposed_names()
    assert "kvtier_hit_blocks_total" in exposed_names()
