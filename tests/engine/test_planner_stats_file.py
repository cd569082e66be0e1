"""``vllm.stats_path``: the planner hands its stats to a writer thread once a second, so neither a
slow disk nor anything planted next to the file may block the engine's step, be written through
or read what it says."""

from __future__ import annotations

import json
import os
import stat
import threading
from pathlib import Path

import pytest

from kvtier.config import load_config
from kvtier.engine import stats_file
from kvtier.engine.planner import Planner, PlannerSettings
from kvtier.keys import Namespace
from kvtier.stats_report import read_snapshot


def stats_planner(tmp_path: Path, stats_path: Path) -> Planner:
    """A planner of a small pool whose stats go to ``stats_path``."""
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    config = load_config({"model": "toy", "pool": {"size": 16 * 1024, "shm_dir": str(shm)}})
    ns = Namespace(model="toy", dtype="uint8", block_tokens=4)
    settings = PlannerSettings(stats_path=str(stats_path))
    return Planner(config, settings, ns, 1024, 4, 1)


def step_in_time(planner: Planner, seconds: float = 5.0) -> None:
    """One engine step, which must end within ``seconds`` (a blocked step fails the test)."""
    done = threading.Event()

    def step() -> None:
        planner.plan_step({}, {}, None)  # type: ignore[arg-type]
        done.set()

    threading.Thread(target=step, daemon=True).start()
    assert done.wait(seconds), "plan_step() blocked"


def test_a_fifo_at_the_old_temp_name_does_not_block_the_step(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    os.mkfifo(tmp_path / "stats.json.tmp")
    planner = stats_planner(tmp_path, path)
    try:
        step_in_time(planner)
    finally:
        planner.close()  # writes the last snapshot
    assert read_snapshot(path)["cache"]["lookups"] == 0


def test_a_planted_temp_link_is_not_written_through(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("keep")
    path = tmp_path / "stats.json"
    (tmp_path / "stats.json.tmp").symlink_to(victim)
    planner = stats_planner(tmp_path, path)
    try:
        step_in_time(planner)
    finally:
        planner.close()
    assert victim.read_text() == "keep"
    assert "cache" in json.loads(path.read_text())


def test_the_stats_file_is_private_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    old = os.umask(0o022)
    try:
        planner = stats_planner(tmp_path, path)
        planner.close()
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_stats_path_that_cannot_be_written_is_logged_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "missing" / "stats.json"
    planner = stats_planner(tmp_path, path)
    try:
        step_in_time(planner)
    finally:
        planner.close()
    assert "cannot write kvtier stats" in caplog.text
    assert "Traceback" not in caplog.text


def test_a_slow_stats_write_does_not_delay_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: the file was encoded and written on the step (milliseconds on a busy disk, a p99
    spike of the connector's time per step)."""
    release = threading.Event()
    written: list[bytes] = []

    def slow_write(path: object, data: bytes, max_bytes: int) -> None:
        release.wait(10)
        written.append(data)

    monkeypatch.setattr(stats_file, "write_atomic", slow_write)
    planner = stats_planner(tmp_path, tmp_path / "stats.json")
    try:
        step_in_time(planner, seconds=1.0)
        step_in_time(planner, seconds=1.0)
        assert written == []
    finally:
        release.set()
        planner.close()
    assert json.loads(written[-1])["cache"]["lookups"] == 0
