"""``benchmarks/scheduler_replay_steady.py``: each step's least connector time over replays that
decide alike, and its table (no vLLM needed)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest
from support.scripts import benchmark_modules


@pytest.fixture(scope="module")
def steady() -> Iterator[ModuleType]:
    with benchmark_modules("scheduler_replay_steady") as (module,):
        yield module


def test_each_step_keeps_its_least_time(steady: ModuleType) -> None:
    assert steady.least_per_step([[3.0, 1.0, 5.0], [2.0, 4.0, 5.5]]) == [2.0, 1.0, 5.0]
    with pytest.raises(RuntimeError, match="different steps"):
        steady.least_per_step([[1.0, 2.0], [1.0]])


def test_the_table_gives_kvtiers_ratios_to_native(steady: ModuleType) -> None:
    rows = {
        "native": {
            "connector_step_cpu_us": {"p50": 100.0, "p90": 400.0, "p99": 1000.0},
            "prompt_tokens_cached": 10,
        },
        "kvtier": {
            "connector_step_cpu_us": {"p50": 50.0, "p90": 400.0, "p99": 1200.0},
            "prompt_tokens_cached": 12,
        },
    }
    lines = steady.point_lines("8x4", rows)
    assert lines[0].startswith("== 8x4")
    assert lines[2].endswith("(0.50x / 1.00x / 1.20x native)  cached 12")
    assert "native)" not in lines[1]
    assert steady.figures([0.001, 0.002, 0.003]) == {"p50": 2000.0, "p90": 3000.0, "p99": 3000.0}


def test_the_replay_makes_its_timer_as_usual_while_recording(steady: ModuleType) -> None:
    """Before: the kept timer took no ``profile_s``, which the replay passes: every steady run
    stopped with a TypeError."""

    class Connector:
        def build_connector_meta(self) -> None:
            pass

    with steady.recording() as made:
        timer = steady.sr.eng.HookTimer(Connector(), enabled=True, profile_s=None)
        assert made.clock is timer
        timer.close()


def test_the_emulated_fs_io_inside_a_step_is_taken_out(steady: ModuleType) -> None:
    class Clock:
        cpu_steps = [0.004, 0.010, 0.002]

    recorded = steady.Recorded(Clock(), {1: 0.007})
    assert recorded.cpu() == pytest.approx([0.004, 0.003, 0.002])


def test_the_fs_queue_model_inside_a_hook_is_taken_out_too(
    steady: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before, only the emulated I/O was: the queue model timing it (``FsModel.advance``, 150-460
    us of a slow 8x4 step) counted as kvtier's time, which the real fs tier does not spend."""
    rfs = steady.rfs

    def busy(model: Any, now: float) -> None:  # the queue model's work
        started = time.thread_time()
        while time.thread_time() - started < 0.003:
            pass

    monkeypatch.setattr(rfs.FsModel, "advance", busy)

    class Connector:
        def build_connector_meta(self) -> None:
            rfs.FsModel.advance(None, 0.0)

    conn = Connector()
    with steady.recording() as made:
        timer = steady.sr.eng.HookTimer(conn, enabled=True)
        conn.build_connector_meta()
        rfs.FsModel.advance(None, 0.0)  # between steps: no step's
        conn.build_connector_meta()
    timer.close()
    assert rfs.FsModel.advance is busy  # put back
    assert sorted(made.io_s) == [0, 1] and min(made.io_s.values()) >= 0.003
    assert all(cpu < 0.002 for cpu in made.cpu())  # the steps did nothing else


def test_invocations_merge_step_by_step(steady: ModuleType, tmp_path: Any) -> None:
    def invocation(name: str, native: list[float], kvtier: list[float], cached: int = 7) -> Any:
        def row(each: list[float]) -> dict[str, Any]:
            return {
                "steps": len(each),
                "prompt_tokens_cached": cached,
                "runs": 2,
                "connector_step_cpu_us": steady.figures(each),
                "each_step_cpu_s": each,
            }

        path = tmp_path / name
        doc = {"vllm": "0.25.1", "points": {"4x2": {"native": row(native), "kvtier": row(kvtier)}}}
        path.write_text(json.dumps(doc))
        return path

    a = invocation("a.json", [0.001, 0.004], [0.002, 0.001])
    b = invocation("b.json", [0.003, 0.002], [0.001, 0.005])
    merged = steady.merge([a, b])
    assert merged["vllm"] == "0.25.1" and merged["merged"] == [str(a), str(b)]
    kvtier = merged["points"]["4x2"]["kvtier"]
    assert kvtier["each_step_cpu_s"] == [0.001, 0.001] and kvtier["runs"] == 4
    assert merged["points"]["4x2"]["native"]["each_step_cpu_s"] == [0.001, 0.002]
    with pytest.raises(RuntimeError, match="decided differently"):
        steady.merge([a, invocation("c.json", [0.001, 0.004], [0.002, 0.001], cached=8)])
