from __future__ import annotations

import logging
import threading
import time

import pytest

from kvtier.tiers.workers import WorkerPool


def _record(results: list[str], what: str) -> None:
    results.append(what)


def test_runs_tasks_on_its_threads() -> None:
    pool = WorkerPool("t", 3, stuck_after_s=5)
    done = threading.Event()
    names: list[str] = []
    results: list[str] = []

    def task() -> None:
        names.append(threading.current_thread().name)
        done.set()

    assert pool.submit(task, lambda: _record(results, "failed"), "one")
    assert done.wait(5)
    assert pool.close(5) == []
    assert names[0].startswith("t-") and results == []
    assert not pool.submit(task, lambda: None)  # closed


def test_stuck_threads_are_counted_and_new_work_refused(caplog: pytest.LogCaptureFixture) -> None:
    pool = WorkerPool("t", 2, stuck_after_s=0.1)
    release = threading.Event()
    results: list[str] = []
    try:
        for i in range(2):
            assert pool.submit(lambda: release.wait(30) and None, lambda: None, f"hang{i}")
        assert pool.submit(lambda: _record(results, "ran"), lambda: _record(results, "failed"))
        time.sleep(0.2)
        with caplog.at_level(logging.WARNING):
            assert pool.expire() == 1  # the queued task waited too long
        assert results == ["failed"]
        assert pool.stuck == 2
        assert "stuck" in caplog.text and "hang0" in caplog.text
        assert not pool.submit(lambda: _record(results, "ran"), lambda: None)
    finally:
        release.set()
    end = time.monotonic() + 5
    while pool.stuck and time.monotonic() < end:
        time.sleep(0.01)
    assert pool.stuck == 0
    assert pool.submit(lambda: _record(results, "ran"), lambda: None)
    assert pool.close(5) == []
    assert results == ["failed", "ran"]


def test_close_is_bounded_and_names_what_it_abandoned() -> None:
    pool = WorkerPool("t", 1, stuck_after_s=10)
    release = threading.Event()
    results: list[str] = []
    try:
        assert pool.submit(lambda: release.wait(30) and None, lambda: None, "stuck read")
        assert pool.submit(lambda: _record(results, "ran"), lambda: _record(results, "failed"))
        started = time.monotonic()
        assert pool.close(0.2) == ["stuck read"]
        assert time.monotonic() - started < 1.0
        assert results == ["failed"]
        assert pool.close(0.2) == ["stuck read"]  # idempotent, still bounded
    finally:
        release.set()


def test_close_lets_queued_work_finish_in_time() -> None:
    pool = WorkerPool("t", 1, stuck_after_s=10)
    results: list[str] = []
    for i in range(5):
        assert pool.submit(lambda i=i: _record(results, f"ran{i}"), lambda: None)
    assert pool.close(5) == []
    assert results == [f"ran{i}" for i in range(5)]


def test_a_failing_task_does_not_kill_its_thread() -> None:
    pool = WorkerPool("t", 1, stuck_after_s=10)
    results: list[str] = []

    def boom() -> None:
        raise RuntimeError("task failed")

    assert pool.submit(boom, lambda: None)
    assert pool.submit(lambda: _record(results, "ran"), lambda: None)
    assert pool.close(5) == []
    assert results == ["ran"]
