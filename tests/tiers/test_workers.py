from __future__ import annotations

import logging
import threading
import time

import pytest

from kvtier.tiers.workers import Line, WorkerPool


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


def test_expire_with_nothing_due_does_not_wait_for_the_pool_lock() -> None:
    """A tier's ``poll`` (every engine step) calls ``expire``; the I/O threads take the pool's
    lock for every task. With no task queued too long and no thread newly stuck it returns
    without the lock; once something is due it still fails it."""
    pool = WorkerPool("t", 1, stuck_after_s=0.2)
    release = threading.Event()
    results: list[str] = []
    try:
        assert pool.submit(lambda: release.wait(30) and None, lambda: None, "busy")
        assert pool.submit(lambda: _record(results, "ran"), lambda: _record(results, "failed"))
        finished: list[int] = []
        with pool._cond:  # a thread of the pool taking a task
            other = threading.Thread(target=lambda: finished.append(pool.expire()))
            other.start()
            other.join(5)
            done = not other.is_alive()
        other.join()
        assert done and finished == [0], "expire waited for the pool's lock"
        time.sleep(0.3)
        assert pool.expire() == 1  # the queued task waited too long
        assert results == ["failed"]
    finally:
        release.set()
    assert pool.close(5) == []


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


def test_first_tasks_go_ahead_and_run_between_the_steps_of_a_long_task() -> None:
    pool = WorkerPool("t", 1, stuck_after_s=10)
    release = threading.Event()
    order: list[str] = []

    def long_task() -> None:
        for step in range(2):
            release.wait(5)
            order.append(f"long{step}")
            pool.run_first()

    assert pool.submit(long_task, lambda: None, "long")
    time.sleep(0.05)  # the long task is running
    assert pool.submit(lambda: _record(order, "normal"), lambda: None)
    assert pool.submit(lambda: _record(order, "first"), lambda: None, line=Line.FIRST)
    release.set()
    assert pool.close(5) == []
    # The FIRST task waited one step of the long task, the NORMAL one all of it.
    assert order == ["long0", "first", "long1", "normal"]


def test_aside_tasks_never_wait_behind_busy_threads() -> None:
    pool = WorkerPool("t", 1, stuck_after_s=10, aside_threads=1)
    release = threading.Event()
    ran = threading.Event()
    try:
        assert pool.submit(lambda: release.wait(30) and None, lambda: None, "busy")
        assert pool.submit(ran.set, lambda: None, "check", Line.ASIDE)
        assert ran.wait(5)
    finally:
        release.set()
    assert pool.close(5) == []
    without = WorkerPool("t", 1, stuck_after_s=10)
    assert not without.submit(lambda: None, lambda: None, "check", Line.ASIDE)  # nobody to take it
    assert without.close(5) == []


class _State:
    made: list[_State] = []

    def __init__(self) -> None:
        self.closed = False
        _State.made.append(self)

    def close(self) -> None:
        self.closed = True


def test_thread_state_is_made_on_first_use_and_closed_with_its_thread() -> None:
    _State.made.clear()
    pool = WorkerPool("t", 2, stuck_after_s=10, thread_state=_State)
    seen: list[object] = []
    done = threading.Event()

    def task() -> None:
        seen.append(pool.state())
        seen.append(pool.state())  # the same object on the same thread
        done.set()

    assert pool.submit(lambda: None, lambda: None)  # never asks: makes nothing
    assert pool.submit(task, lambda: None)
    assert done.wait(5)
    assert seen[0] is seen[1] and len(_State.made) == 1 and not _State.made[0].closed
    assert pool.close(5) == []
    assert _State.made[0].closed
    with pytest.raises(RuntimeError):
        WorkerPool("t", 1, stuck_after_s=10).state()


def test_close_cuts_off_running_tasks_then_waits_its_grace() -> None:
    pool = WorkerPool("t", 1, stuck_after_s=10)
    release = threading.Event()
    results: list[str] = []
    assert pool.submit(lambda: release.wait(30) and None, lambda: None, "slow command")
    assert pool.submit(lambda: _record(results, "ran"), lambda: _record(results, "failed"))
    started = time.monotonic()
    # The cut-off makes the running task return; the queued one still runs within the grace.
    assert pool.close(0.2, cut_off=release.set, grace_s=5) == []
    assert 0.2 <= time.monotonic() - started < 2
    assert results == ["ran"]


def test_close_abandons_what_a_cut_off_did_not_stop() -> None:
    pool = WorkerPool("t", 1, stuck_after_s=10)
    release = threading.Event()
    cut: list[bool] = []
    try:
        assert pool.submit(lambda: release.wait(30) and None, lambda: None, "deaf")
        started = time.monotonic()
        assert pool.close(0.1, cut_off=lambda: cut.append(True), grace_s=0.2) == ["deaf"]
        assert cut == [True] and time.monotonic() - started < 1
    finally:
        release.set()


def test_a_task_that_ends_wakes_no_idle_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each wake-up takes the GIL (from the engine's thread too) to find nothing to do: tasks
    run one at a time on a pool of four wake one thread each, not every idle one."""
    wakeups = [0]

    class CountingCondition(threading.Condition):
        def wait(self, timeout: float | None = None) -> bool:
            woken = super().wait(timeout)
            if threading.current_thread().name.startswith("t-"):  # not the test's Events
                wakeups[0] += 1
            return woken

    monkeypatch.setattr("kvtier.tiers.workers.threading.Condition", CountingCondition)
    pool = WorkerPool("t", 4, stuck_after_s=5)
    try:
        time.sleep(0.05)  # every thread waiting
        tasks = 50
        for _ in range(tasks):
            done = threading.Event()
            assert pool.submit(done.set, lambda: None)
            assert done.wait(5)
            time.sleep(0.002)  # the thread back to waiting before the next task
        assert wakeups[0] <= tasks + 4  # four times as many when a task's end woke them all
    finally:
        assert pool.close(5) == []


def test_copies_of_a_task_are_queued_at_once_and_each_runs() -> None:
    pool = WorkerPool("t", 2, stuck_after_s=5)
    ran: list[str] = []
    all_ran = threading.Event()

    def task() -> None:
        ran.append(threading.current_thread().name)
        if len(ran) == 3:
            all_ran.set()

    try:
        assert pool.submit(task, lambda: ran.append("failed"), "copies", copies=3)
        assert all_ran.wait(5)
    finally:
        assert pool.close(5) == []
    assert len(ran) == 3 and all(name.startswith("t-") for name in ran)
    assert not pool.submit(task, lambda: None, copies=2)  # closed: none queued
    assert len(ran) == 3
