"""``benchmarks/scheduler_step_bench.py``'s full-disk fs tier: a real ``FsTier`` that finds no
room, so it refuses every write and holds nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.scripts import benchmark_modules

SMALL = ["--conversations", "4", "--concurrency", "2", "--turns", "2", "--turn-blocks", "4"]


def test_a_full_disk_tier_changes_no_hit_and_refuses_every_write(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with benchmark_modules("scheduler_step_bench") as (bench,):
        rows = {}
        for name, extra in (("none", []), ("full", ["--fs-full"])):
            out = tmp_path / f"{name}.json"
            assert bench.main([*SMALL, *extra, "--json", str(out)]) == 0
            rows[name] = json.loads(out.read_text())
        assert rows["full"]["args"]["fs_full"] and rows["full"]["steps"] > 0
        for figure in ("hit_blocks", "loaded_blocks", "promoted_blocks"):
            assert rows["full"][figure] == rows["none"][figure]
        assert "tier fs has no room: writes to it pause" in caplog.text
        with pytest.raises(SystemExit):
            bench.main([*SMALL, "--fs-full", "--steady", "2"])
