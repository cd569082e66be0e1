"""kvtier's series in a prometheus-client registry, and ``kvtier simulate --metrics-port``
scraped over HTTP while it runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from support import require

prometheus_client = require.importorskip("prometheus_client", "extras")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvtier import series  # noqa: E402
from kvtier.config import load_config  # noqa: E402
from kvtier.prometheus import PrometheusExporter  # noqa: E402
from kvtier.sim.simulate import simulate  # noqa: E402
from kvtier.sim.trace import bundled_trace_path  # noqa: E402


def test_exporter_follows_the_cache_counters(tmp_path: Path) -> None:
    registry = prometheus_client.CollectorRegistry()
    exporter = PrometheusExporter(registry)
    config = load_config(
        {
            "pool": {"size": "8MiB"},
            "tiers": [{"kind": "fs", "path": str(tmp_path), "capacity": "64GiB"}],  # 1,024 blocks
        }
    )
    seen: list[object] = []

    def observe(cache: object) -> None:
        stats = cache.stats()  # type: ignore[attr-defined]
        exporter.update(stats)
        seen.append(stats)

    result = simulate(config, bundled_trace_path(), pool_blocks=50, limit=150, on_request=observe)
    last = seen[-1]
    value = registry.get_sample_value
    assert value("kvtier_lookup_blocks_total") == last.cache.lookup_blocks  # type: ignore[attr-defined]
    assert value("kvtier_stored_blocks_total") == last.cache.stored_blocks  # type: ignore[attr-defined]
    assert value("kvtier_pool_slots") == 50
    hits = sum(value("kvtier_hit_blocks_total", {"tier": t}) or 0 for t in ("pool", "fs"))
    assert hits == last.cache.hit_blocks > 0  # type: ignore[attr-defined]
    assert value("kvtier_hit_blocks_total", {"tier": "fs"}) == last.promoted["fs"]  # type: ignore[attr-defined]
    assert value("kvtier_written_blocks_total", {"tier": "fs"}) > 0
    assert value("kvtier_evictions_total", {"tier": "pool"}) == result.tiers[0].evictions
    # Counters never go back: a second identical snapshot adds nothing.
    exporter.update(last)  # type: ignore[arg-type]
    assert value("kvtier_lookup_blocks_total") == last.cache.lookup_blocks  # type: ignore[attr-defined]


def test_payload_with_an_unknown_series_is_refused() -> None:
    exporter = PrometheusExporter(prometheus_client.CollectorRegistry())
    bad = series.empty_payload()
    bad["counters"]["kvtier_nonsense"] = {"": 1}
    with pytest.raises(ValueError, match="kvtier_nonsense"):
        exporter.observe(bad)
    wrong_kind = series.empty_payload()
    wrong_kind["gauges"]["kvtier_lookups"] = {"": 1}
    with pytest.raises(ValueError, match="kvtier_lookups"):
        exporter.observe(wrong_kind)


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def test_simulate_serves_metrics_over_http() -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvtier",
            "simulate",
            "--limit",
            "300",
            "--pool-blocks",
            "200",
            "--metrics-port",
            "0",
            "--metrics-hold",
            "60",
            "--no-progress",
            "--json",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None and proc.stdout is not None
        line = proc.stderr.readline()
        port = re.search(r":(\d+)/metrics", line)
        assert port, line
        url = f"http://127.0.0.1:{port.group(1)}/metrics"
        lines = []
        while not lines or lines[-1] != "}\n":  # the JSON is printed, then the server holds
            lines.append(proc.stdout.readline())
            assert lines[-1], "simulate ended before printing its result"
        result = json.loads("".join(lines))
        deadline = time.monotonic() + 30
        while True:
            metrics = scrape(url)
            if metrics.get("kvtier_lookup_blocks_total{}") == result["blocks"]:
                break
            assert time.monotonic() < deadline, metrics
            time.sleep(0.2)
        hits = metrics["kvtier_hit_blocks_total{tier=pool}"]
        assert hits == result["hit_blocks"] > 0
        assert metrics["kvtier_stored_blocks_total{}"] == result["stored_blocks"]
        assert metrics["kvtier_pool_slots{}"] == 200
    finally:
        proc.kill()
        proc.wait()


def test_metrics_port_without_prometheus_client_is_a_clear_error(tmp_path: Path) -> None:
    # A stub package that fails to import, first on the path.
    stub = tmp_path / "prometheus_client"
    stub.mkdir()
    (stub / "__init__.py").write_text("raise ImportError('no prometheus here')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "kvtier", "simulate", "--limit", "5", "--metrics-port", "0"],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        timeout=60,
    )
    assert proc.returncode == 2
    assert "-m pip install 'prometheus-client>=0.17'" in proc.stderr, proc.stderr
    assert "pip install '.[prometheus]'" in proc.stderr
    assert "Traceback" not in proc.stderr
