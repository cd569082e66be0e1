"""Where the CPU of the benchmark's own process goes during a timed run, thread by thread.

The GPU benchmark runs vLLM's engine in its own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``):
the main thread schedules, runs the model and calls the connector's scheduler-side hooks, and
kvtier's copy and tier threads run beside it. With an fs tier the hooks took 1.4-1.6x the CPU of
the pool alone's on an H200, and a separate process writing as much only 1.1x: whether the
engine's thread then waits for the interpreter's lock (its voluntary context switches) or loses
its core (involuntary ones), and how much CPU the tier's threads take, tells the cause apart.

``sample()`` reads ``/proc/self/task``: each thread's CPU time (``schedstat``'s nanoseconds
where the kernel keeps them, else ``stat``'s clock ticks) and the main thread's context switches;
``usage(before, after)`` is the difference, CPU seconds per thread name (a Python thread's name
less its trailing number, ``kvtier-fs-3`` -> ``kvtier-fs``; a thread Python did not start, the
kernel's ``comm``). Threads that ended between the samples are not counted.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
from dataclasses import dataclass
from typing import Any

TASKS = "/proc/self/task"
_NUMBERED = re.compile(r"[-_ ]?\d+$")
_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Sample:
    cpu_s: dict[int, float]
    """Thread id -> CPU seconds so far."""
    names: dict[int, str]
    voluntary: int
    """The main thread's voluntary context switches so far (it blocked: a lock, I/O, a sleep)."""
    involuntary: int
    """The main thread's involuntary ones (the kernel gave its core to another thread)."""


def group_name(name: str) -> str:
    """``kvtier-fs-3`` -> ``kvtier-fs``: threads of one pool counted together."""
    return _NUMBERED.sub("", name.strip()) or name.strip()


def _read(path: str) -> str | None:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read()
    return None


def thread_cpu_s(tid: int) -> float | None:
    """A thread's CPU seconds (user and system); None when it is gone."""
    schedstat = _read(f"{TASKS}/{tid}/schedstat")
    if schedstat:
        return int(schedstat.split()[0]) / 1e9
    stat = _read(f"{TASKS}/{tid}/stat")
    if stat is None:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime


def switches(tid: int) -> tuple[int, int]:
    """A thread's (voluntary, involuntary) context switches; zeros when it is gone."""
    counts = {"voluntary_ctxt_switches": 0, "nonvoluntary_ctxt_switches": 0}
    for line in (_read(f"{TASKS}/{tid}/status") or "").splitlines():
        key, _, value = line.partition(":")
        if key in counts:
            counts[key] = int(value)
    return counts["voluntary_ctxt_switches"], counts["nonvoluntary_ctxt_switches"]


def sample() -> Sample:
    python_names = {t.native_id: t.name for t in threading.enumerate() if t.native_id}
    cpu: dict[int, float] = {}
    names: dict[int, str] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir(TASKS):
            tid = int(entry)
            seconds = thread_cpu_s(tid)
            if seconds is None:
                continue
            cpu[tid] = seconds
            comm = (_read(f"{TASKS}/{tid}/comm") or "?").strip()
            names[tid] = python_names.get(tid, comm)
    main = threading.main_thread().native_id or os.getpid()
    voluntary, involuntary = switches(main)
    return Sample(cpu, names, voluntary, involuntary)


def usage(before: Sample, after: Sample, seconds: float) -> dict[str, Any]:
    """The timed run's share: the main thread's CPU seconds and context switches (and per
    second of the run), and CPU seconds per thread name, most first."""
    main = threading.main_thread().native_id or os.getpid()
    by_name: dict[str, float] = {}
    for tid, cpu in after.cpu_s.items():
        if tid == main:
            continue
        name = group_name(after.names.get(tid, "?"))
        by_name[name] = by_name.get(name, 0.0) + cpu - before.cpu_s.get(tid, 0.0)
    voluntary = after.voluntary - before.voluntary
    involuntary = after.involuntary - before.involuntary
    per_s = 1.0 / seconds if seconds > 0 else 0.0
    return {
        "main_cpu_s": round(after.cpu_s.get(main, 0.0) - before.cpu_s.get(main, 0.0), 3),
        "main_voluntary_switches": voluntary,
        "main_involuntary_switches": involuntary,
        "main_voluntary_per_s": round(voluntary * per_s, 1),
        "main_involuntary_per_s": round(involuntary * per_s, 1),
        "others_cpu_s": {
            name: round(s, 3) for name, s in sorted(by_name.items(), key=lambda x: -x[1]) if s > 0
        },
    }


def pin_apart(others: list[threading.Thread]) -> None:
    """The calling thread alone on the first CPU, ``others`` on the rest: their CPU time then
    cannot take its core, and what still slows it is the interpreter's lock (on a 2-core
    machine the others share one core). Nothing on a 1-CPU machine."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    os.sched_setaffinity(0, {cpus[0]})
    for thread in others:
        if thread.native_id:
            with contextlib.suppress(OSError):  # ended meanwhile
                os.sched_setaffinity(thread.native_id, set(cpus[1:]))
