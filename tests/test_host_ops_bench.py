"""``benchmarks/host_ops_bench.py``: every figure measured, and each host's row added to the
file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.scripts import benchmark_modules


def test_each_run_adds_its_host_to_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with benchmark_modules("host_ops_bench") as (bench,):
        monkeypatch.setattr(bench, "KEYS", 1_000)
        monkeypatch.setattr(bench, "PASSES", 1)
        out = tmp_path / "hosts.json"
        assert bench.main(["--json", str(out)]) == 0
        assert bench.main(["--json", str(out)]) == 0
    hosts = json.loads(out.read_text())["hosts"]
    assert len(hosts) == 2
    for host in hosts:
        assert host["cpus"] >= 1 and host["python"].count(".") == 2
        assert set(host["ns_per_op"]) >= {"dict get", "blake2b chain block", "os.stat"}
        assert all(ns > 0 for ns in host["ns_per_op"].values())
