"""``vllm.stats_path``: the planner hands its stats to a writer thread once a second, so neither a
slow disk nor anything planted next to the file may block the engine's step, be written through
or read what it says."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from kvtier.config import load_config
from kvtier.engine import stats_file
from kvtier.engine.planner import Planner
from kvtier.engine.planner_settings import PlannerSettings
from kvtier.keys import Namespace, keys_from_hashes
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


def _file_shows(path: Path, lookups: int, seconds: float) -> bool:
    """Whether the stats file shows ``lookups`` within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists() and read_snapshot(path)["cache"]["lookups"] == lookups:
            return True
        time.sleep(0.05)
    return False


def test_the_last_steps_reach_the_file_when_no_step_follows(tmp_path: Path) -> None:
    """Before: a snapshot was taken only at a step one second after the last one, so the steps
    of a burst that ended within that second never reached the file while the engine idled
    (after 8 requests to vLLM's API server the file read 5 lookups, /metrics 153 blocks)."""
    path = tmp_path / "stats.json"
    planner = stats_planner(tmp_path, path)
    try:
        step_in_time(planner)  # the first step's snapshot is written at once
        assert _file_shows(path, 0, 5.0)
        keys = keys_from_hashes(planner.namespace, [1, 2, 3])
        for _ in range(3):  # three steps of a burst, each ending as vLLM ends a step
            planner.cache.lookup(keys)
            assert planner.take_stats() is not None
        # No step follows: the file still gets the newest counters, within the interval.
        assert _file_shows(path, 3, stats_file.INTERVAL_S + 3.0)
    finally:
        planner.close()
    assert read_snapshot(path)["cache"]["lookups"] == 3


def test_close_writes_the_stats_before_the_tiers_close(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM kills an engine process still shutting down 5 s after it asked it to stop; closing
    the tiers may take up to job_timeout_s. Before: the file was written only after them."""
    path = tmp_path / "stats.json"
    planner = stats_planner(tmp_path, path)
    planner.cache.lookup(keys_from_hashes(planner.namespace, [7]))
    seen_while_closing: list[bool] = []
    close_tiers = planner.cache.close

    def slow_close() -> None:
        seen_while_closing.append(_file_shows(path, 1, 5.0))
        close_tiers()

    monkeypatch.setattr(planner.cache, "close", slow_close)
    planner.close()
    assert seen_while_closing == [True]
    assert read_snapshot(path)["cache"]["lookups"] == 1


def test_snapshots_are_built_off_the_step_from_copies(tmp_path: Path) -> None:
    """The step copies the counters; the dict is built later, on the writer's thread, and
    shows the counters as they were when the snapshot was taken."""
    planner = stats_planner(tmp_path, tmp_path / "stats.json")
    try:
        snapshot = planner.stats_snapshot(planner.cache.stats())
        planner.cache.lookup(keys_from_hashes(planner.namespace, [1]))
        planner.counters.requests_looked_up += 1
        built = snapshot()
        assert built["cache"]["lookups"] == 0 and built["connector"]["requests_looked_up"] == 0
        assert planner.stats()["cache"]["lookups"] == 1
        assert set(built) == set(planner.stats())
    finally:
        planner.close()
