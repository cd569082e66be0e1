"""``benchmarks/engine_threads.py``: the CPU of the benchmark's process, thread by thread, and
the main thread's context switches, over a stretch of work."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from types import ModuleType

import pytest
from support.scripts import benchmark_modules


@pytest.fixture(scope="module")
def et() -> Iterator[ModuleType]:
    with benchmark_modules("engine_threads") as (module,):
        yield module


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_threads_of_one_pool_count_together(et: ModuleType) -> None:
    assert et.group_name("kvtier-fs-3") == "kvtier-fs"
    assert et.group_name("copy_12") == "copy"
    assert et.group_name("MainThread") == "MainThread"
    assert et.group_name("7") == "7"


def test_the_main_threads_cpu_and_switches_and_threads_gone_meanwhile(et: ModuleType) -> None:
    before = et.sample()
    started = time.perf_counter()
    brief = threading.Thread(target=spin, args=(0.1,), name="kvtier-test-brief-1")
    brief.start()
    for _ in range(20):
        time.sleep(0.005)  # the main thread blocks: a voluntary switch each
    spin(0.05)
    brief.join()
    after = et.sample()
    seconds = time.perf_counter() - started
    out = et.usage(before, after, seconds)
    assert 0.05 <= out["main_cpu_s"] < seconds
    assert out["main_voluntary_switches"] >= 20
    assert out["main_voluntary_per_s"] == pytest.approx(
        out["main_voluntary_switches"] / seconds, abs=0.1
    )
    assert "kvtier-test-brief" not in out["others_cpu_s"]  # it ended before the second sample


def test_busy_threads_alive_at_both_samples_are_counted_by_name(et: ModuleType) -> None:
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            spin(0.01)

    threads = [threading.Thread(target=busy, name=f"kvtier-test-spin-{i}") for i in (1, 2)]
    for thread in threads:
        thread.start()
    before = et.sample()
    time.sleep(0.3)
    after = et.sample()
    stop.set()
    for thread in threads:
        thread.join()
    out = et.usage(before, after, 0.3)
    # Two threads spinning for 0.3 s (on however many cores the machine has: at least one's).
    assert out["others_cpu_s"]["kvtier-test-spin"] >= 0.15
    assert out["main_cpu_s"] < 0.15  # the main thread slept
    assert list(out["others_cpu_s"]) == sorted(
        out["others_cpu_s"], key=lambda n: -out["others_cpu_s"][n]
    )


def test_cpu_from_stat_where_the_kernel_keeps_no_schedstat(
    et: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    tid = threading.get_native_id()
    spin(0.05)
    precise = et.thread_cpu_s(tid)
    real = et._read
    monkeypatch.setattr(
        et, "_read", lambda path: None if path.endswith("schedstat") else real(path)
    )
    ticks = et.thread_cpu_s(tid)
    assert precise is not None and ticks is not None
    assert abs(ticks - precise) < 0.05  # clock ticks: 10 ms apart
    assert et.thread_cpu_s(2**22 + 7) is None  # no such thread


def test_pin_apart_gives_the_caller_the_first_cpu_and_the_others_the_rest(
    et: ModuleType,
) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: nothing to pin apart")
    ready, done = threading.Event(), threading.Event()
    other = threading.Thread(target=lambda: (ready.set(), done.wait(5)))
    other.start()
    try:
        assert ready.wait(5)
        seen: dict[str, set[int]] = {}

        def pin_and_look() -> None:
            et.pin_apart([other])
            seen["caller"] = os.sched_getaffinity(0)
            seen["other"] = os.sched_getaffinity(other.native_id or 0)

        caller = threading.Thread(target=pin_and_look)  # this thread's CPUs stay as they are
        caller.start()
        caller.join(5)
        assert seen == {"caller": {cpus[0]}, "other": set(cpus[1:])}
    finally:
        done.set()
        other.join(5)
