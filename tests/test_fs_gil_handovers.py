"""``benchmarks/fs_gil_handovers.py``: a thread stepping beside a real fs tier's writes."""

from __future__ import annotations

import json
from pathlib import Path

from support.scripts import benchmark_modules


def test_a_short_run_writes_every_block_it_submits_and_reports_each_thread_count(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out.json"
    with benchmark_modules("fs_gil_handovers") as (bench,):
        code = bench.main(
            ["--threads", "2,1", "--seconds", "0.5", "--dir", str(tmp_path), "--json", str(out)]
        )
    assert code == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["threads"] for row in rows] == [2, 1]
    for row in rows:
        assert row["blocks_submitted"] >= 50  # 200 a second for half a second, give or take
        assert row["blocks_written"] == row["blocks_submitted"]
        assert row["step_us"]["p50"] <= row["step_us"]["p99"]
    assert list(tmp_path.iterdir()) == [out]  # the tier's files are gone
