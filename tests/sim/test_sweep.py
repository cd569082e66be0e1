"""``kvtier simulate --sweep``: replay at several pool sizes next to the offline optimum and the
ceiling; table, JSON and PNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import require

from kvtier.cli import main
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.sim.sweep import auto_sizes, parse_sizes, sweep
from kvtier.sim.trace import bundled_trace_path


def test_replay_never_beats_the_optimum_and_a_pool_for_everything_meets_the_ceiling() -> None:
    config = load_config({"eviction": "lru"})
    result = sweep(config, bundled_trace_path(), [50, 400, 100_000], limit=300)
    assert result.requests == 300 and result.unit.startswith("pool sizes in blocks")
    small, mid, everything = result.points
    for p in result.points:
        assert p.hit_ratio <= p.optimal_hit_ratio + 1e-12 <= result.ceiling + 1e-12
    assert small.hit_ratio < mid.hit_ratio < everything.hit_ratio
    assert small.optimal_hit_ratio < mid.optimal_hit_ratio
    assert everything.evictions == 0 and small.evictions > 0
    assert everything.hit_ratio == pytest.approx(result.ceiling)
    assert everything.optimal_hit_ratio == pytest.approx(result.ceiling)


def test_a_tier_sweep_varies_only_that_tier(tmp_path: Path) -> None:
    config = load_config(
        {"eviction": "lru", "tiers": [{"kind": "fs", "path": str(tmp_path), "capacity": "1GiB"}]}
    )
    result = sweep(config, bundled_trace_path(), [20, 4000], limit=300, tier="fs", pool_blocks=50)
    assert result.tier == "fs" and result.fixed_pool_blocks == 50
    assert "pool fixed at 50 blocks" in result.unit
    small, large = result.points
    assert small.pool_blocks == 20 and large.pool_blocks == 4000
    assert small.hit_ratio < large.hit_ratio
    assert small.evictions > 0  # the fs tier's own evictions: it holds 20 blocks
    for p in result.points:  # the optimum of one cache as large as pool + tier bounds both
        assert p.hit_ratio <= p.optimal_hit_ratio + 1e-12
    with pytest.raises(ConfigError, match="--sweep-tier"):
        sweep(config, bundled_trace_path(), [10], limit=10, tier="nope", pool_blocks=5)
    unbounded = load_config({"tiers": [{"kind": "redis", "url": "redis://127.0.0.1:1/0"}]})
    with pytest.raises(ConfigError, match="a tier with a capacity"):
        sweep(unbounded, bundled_trace_path(), [10], limit=10, tier="redis", pool_blocks=5)


def test_every_size_starts_cold_with_a_persistent_tier(tmp_path: Path) -> None:
    # An fs tier keeps its blocks across processes: a second sweep (or the next size) must not
    # find the blocks the first one stored, or the curve would climb past the ceiling.
    config = load_config(
        {"eviction": "lru", "tiers": [{"kind": "fs", "path": str(tmp_path), "capacity": "1TiB"}]}
    )
    first = sweep(config, bundled_trace_path(), [30], limit=300, tier="fs", pool_blocks=20)
    again = sweep(config, bundled_trace_path(), [30], limit=300, tier="fs", pool_blocks=20)
    assert first.points == again.points
    assert first.points[0].hit_ratio <= first.ceiling
    assert list(tmp_path.iterdir()) == []  # the point's blocks were removed


def test_sizes() -> None:
    assert parse_sizes("auto") is None
    assert parse_sizes("400, 100,400") == [100, 400]
    for bad in ("", "0,10", "ten"):
        with pytest.raises(ConfigError, match="--sweep"):
            parse_sizes(bad)
    sizes = auto_sizes(43924)
    assert len(sizes) == 8 and sizes[-1] == 43924 and sizes[0] == 43924 >> 7


def test_cli_prints_the_table_and_writes_json(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    out_json = tmp_path / "sweep.json"
    args = ["simulate", "--sweep", "100,1000", "--limit", "200", "--no-progress"]
    assert main([*args, "--sweep-json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "optimum" in out and "ceiling" in out and "blocks of block.bytes" in out
    data = json.loads(out_json.read_text())
    assert [p["pool_blocks"] for p in data["points"]] == [100, 1000]
    assert data["ceiling"] >= data["points"][1]["optimal_hit_ratio"]


def test_an_unwritable_sweep_json_is_one_error_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Before: a FileNotFoundError traceback after the replay."""
    missing = tmp_path / "no-such-dir" / "sweep.json"
    args = ["simulate", "--sweep", "100", "--limit", "50", "--no-progress"]
    assert main([*args, "--sweep-json", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: cannot write") and "Traceback" not in err


def test_png(tmp_path: Path) -> None:
    require.importorskip("matplotlib", "extras")
    png = tmp_path / "sweep.png"
    args = ["simulate", "--sweep", "100,1000", "--limit", "100", "--no-progress"]
    assert main([*args, "--sweep-png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_png_without_matplotlib_is_a_clear_error(tmp_path: Path) -> None:
    stub = tmp_path / "matplotlib"
    stub.mkdir()
    (stub / "__init__.py").write_text("raise ImportError('no matplotlib here')\n")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtier",
            "simulate",
            "--sweep",
            "50",
            "--limit",
            "20",
            "--no-progress",
            "--sweep-png",
            str(tmp_path / "x.png"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    # Checked before the sweep starts: no replay ran, so no table was printed (it was, before).
    assert proc.stdout == ""
    assert "-m pip install 'matplotlib>=3.7'" in proc.stderr, proc.stderr
    assert "pip install '.[plot]'" in proc.stderr and "Traceback" not in proc.stderr
