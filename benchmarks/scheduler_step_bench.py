"""The connector's scheduler-side time per engine step, without an engine or a GPU.

Drives kvtier's ``Planner`` the way vLLM's scheduler does (``matched_tokens`` for every waiting
request each step until it is scheduled, ``after_alloc``, ``plan_step``, the workers' reports,
``take_stats`` and ``take_events`` each step, ``request_finished``), with the copies reported done
at once, so what is timed is kvtier's own work on the scheduler thread: lookups, pins, store
reservations, the ledger, stats and the tiers' threads competing for the GIL.

Workload: ``--concurrency`` multi-turn conversations in flight (each turn re-sends the previous
prompt plus ``--turn-blocks`` new blocks), at most ``--running`` of them running, the others
waiting, ``--prefill-blocks`` blocks computed per step. By default every waiting request is
asked every step (``matched_tokens``), as if vLLM's KV cache were full for each of them. With
``--gpu-blocks`` the waiting queue is walked as vLLM's scheduler walks it: in order, stopping
before asking when the running requests are at ``--running`` or the step's tokens are spent,
skipping a deferred request, and stopping after asking the first whose blocks do not fit in
the GPU's ``--gpu-blocks`` (vLLM's ``allocate_slots`` failed: it is asked again next step).
Prints p50/p90/p99/max of the time per step, each hook's share of the slowest steps (the
steps at or above p99, and the time of each hook there: what makes the tail), the functions that
took it (``--profile``: cProfile per step, the tail steps' profiles summed apart from the whole
run's), and writes JSON. ``--repeat`` runs the workload that many times on fresh planners and
pools them (129 steps per run at the defaults: one run's p99 is its second slowest step).

Cache events are recorded only with ``--events``, as the vLLM connector records them only when
vLLM publishes KV events (``compat.kv_events_enabled``).

``--steady N`` is for a shared VM, where other processes make one run's CPU time per step
swing by a third: the workload runs N times, each the same work step by step (the cache's
clock advances 5 ms per engine step whatever the host does, and ``--fs`` puts a tier there
whose jobs cost nothing and end at the next step: no thread, no timing in any decision), and
each step's time is its least over the runs, what the step costs without interference. The
runs' hit, promoted and loaded blocks must agree (checked).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import gc
import io
import json
import pstats
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import engine_threads

from kvtier.cache import factory
from kvtier.config import load_config
from kvtier.engine import planner as planner_module
from kvtier.engine.orders import RankReport
from kvtier.engine.planner import Planner
from kvtier.engine.planner_settings import PlannerSettings
from kvtier.keys import BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import JobResult, Tier, TierJob, TierJobKind

BLOCK_TOKENS = 16
FULL_DISK_MIN_FREE = "1024TiB"
"""``--fs-full``'s fs ``min_free``: less room than that on any disk, as on a full one."""


@dataclass
class Request:
    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.all_token_ids)


class HookTimes:
    """CPU time of the scheduler thread in each planner hook within the current step (seconds),
    kept per step. CPU time, not wall time: on a shared VM a step's wall time is mostly other
    processes' (a dict store measured 10 ms once); the engine host's is its own work."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] = {}

    def call(self, hook: str, fn: Callable[..., Any], *args: Any) -> Any:
        started = time.thread_time()
        try:
            return fn(*args)
        finally:
            took = time.thread_time() - started
            self.current[hook] = self.current.get(hook, 0.0) + took

    def end_step(self) -> None:
        self.steps.append(self.current)
        self.current = {}


def summary(us: list[float]) -> dict[str, float]:
    return {
        "p50": round(percentile(us, 50), 1),
        "p90": round(percentile(us, 90), 1),
        "p99": round(percentile(us, 99), 1),
        "max": round(max(us), 1),
        "mean": round(statistics.fmean(us), 1),
    }


def tail_breakdown(steps_us: list[float], hooks: list[dict[str, float]]) -> dict[str, Any]:
    """Mean CPU microseconds per hook over every step and over the steps at or above p99 (of
    ``steps_us``, the steps' CPU time), and the slowest steps with their hooks: which hook makes
    the tail."""
    threshold = percentile(steps_us, 99)
    names = sorted({name for step in hooks for name in step})
    tail = [i for i, us in enumerate(steps_us) if us >= threshold]

    def mean_us(indices: list[int]) -> dict[str, float]:
        return {
            name: round(statistics.fmean(hooks[i].get(name, 0.0) for i in indices) * 1e6, 1)
            for name in names
        }

    slowest = sorted(range(len(steps_us)), key=steps_us.__getitem__, reverse=True)[:5]
    return {
        "mean_us": mean_us(list(range(len(steps_us)))),
        "p99_steps": len(tail),
        "p99_mean_us": mean_us(tail),
        "slowest": [
            {
                "step_us": round(steps_us[i], 1),
                **{k: round(v * 1e6, 1) for k, v in sorted(hooks[i].items())},
            }
            for i in slowest
        ],
    }


class NullTier(Tier):
    """``--steady``'s tier: it holds keys only; its jobs cost nothing and end at the next poll,
    so every run decides the same (a real tier's threads and timings make runs differ)."""

    def __init__(self, name: str, namespace: Namespace, pool: HostPool) -> None:
        super().__init__(name, namespace, pool)
        self.stored: set[BlockKey] = set()
        self.pending: list[TierJob] = []

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        stored = self.stored
        return [key in stored for key in keys]

    def is_empty(self) -> bool:
        return not self.stored

    def submit(self, job: TierJob) -> None:
        self.pending.append(job)

    def poll(self) -> list[JobResult]:
        for job in self.pending:
            if job.kind is TierJobKind.WRITE:
                self.stored.update(job.keys)
            self._finish(job.job_id, [key in self.stored for key in job.keys])
        self.pending = []
        return super().poll()

    def close(self) -> None:
        self.pending = []


class StepClock:
    """``--steady``'s clock: 5 ms per engine step, whatever the host does."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def steady_planner(clock: StepClock) -> contextlib.ExitStack:
    """While open, a planner built gets a cache on ``clock`` and ``NullTier`` s for its tiers."""
    stack = contextlib.ExitStack()
    build = functools.partial(factory.build_cache, clock=clock)
    stack.enter_context(mock.patch.object(planner_module, "build_cache", build))
    null = lambda tier, namespace, pool, field: NullTier(tier.name, namespace, pool)  # noqa: E731
    stack.enter_context(mock.patch.object(factory, "build_tier", null))
    return stack


class Tables(dict[str, list[int]]):
    def get(self, req_id: str) -> list[int]:  # type: ignore[override]
        return super().get(req_id, [])


def conversations(n: int, turns: int, turn_blocks: int, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt: list[int] = []
        conv = []
        for _ in range(turns):
            prompt = prompt + [rng.randrange(1, 1 << 30) for _ in range(turn_blocks * BLOCK_TOKENS)]
            conv.append(list(prompt))
        out.append(conv)
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def thread_switches() -> int:
    """Times the calling thread blocked so far (voluntary context switches: waits for the GIL
    or a lock another thread holds). Counted by the kernel, so other processes on a shared VM
    do not add to it as they add to wall time."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw


def run(
    args: argparse.Namespace, workdir: Path, profiles: list[cProfile.Profile], hooks: HookTimes
) -> tuple[list[tuple[float, float, int]], dict[str, Any]]:
    """One pass of the workload: each step's wall and CPU seconds and the times the scheduler
    thread blocked in it, and the planner's stats."""
    tiers = []
    if args.fs or args.fs_full:
        fs = {"kind": "fs", "path": str(workdir / "fs"), "capacity": "4GiB"}
        tiers.append({**fs, "threads": args.fs_threads})
    if args.fs_full:  # more free space asked for than any disk has: every write is refused
        tiers[0]["min_free"] = FULL_DISK_MIN_FREE
    config = load_config(
        {
            "model": "bench",
            "pool": {"size": args.pool_blocks * args.block_bytes, "shm_dir": str(workdir)},
            "tiers": tiers,
            "events": args.events,
        }
    )
    ns = Namespace(model="bench", dtype="bf16", block_tokens=BLOCK_TOKENS)
    stats_path = str(workdir / "stats.json") if args.stats_file else None
    settings = PlannerSettings(stats_path=stats_path)
    clock = StepClock()
    with steady_planner(clock) if args.steady else contextlib.nullcontext():
        planner = Planner(config, settings, ns, args.block_bytes, BLOCK_TOKENS, 1)
    if args.pin:  # the scheduler thread alone on a core, kvtier's threads on the others
        engine_threads.pin_apart(
            [t for t in threading.enumerate() if t is not threading.current_thread()]
        )
    convs = conversations(args.conversations, args.turns, args.turn_blocks, seed=1)
    pending = list(range(len(convs)))
    turn = [0] * len(convs)
    active: dict[str, tuple[int, Request]] = {}
    waiting: list[str] = []
    tables = Tables()
    held = 0  # GPU blocks of the running requests
    next_block = 0
    counter = 0
    steps: list[tuple[float, float, int]] = []

    def submit(conv: int) -> None:
        nonlocal counter
        req = Request(f"r{counter}", convs[conv][turn[conv]])
        counter += 1
        active[req.request_id] = (conv, req)
        waiting.append(req.request_id)
        hooks.call("on_new_request", planner.on_new_request, req)

    while pending and len(active) < args.concurrency:
        submit(pending.pop(0))
    hooks.current = {}
    # The workload's prompts (a million ints, built up front) are not the engine's: left young,
    # the first collections inside the timed steps traversed them (8 ms, a third of the p99).
    gc.collect()
    while active:
        clock.now += 0.005
        started, cpu_started = time.perf_counter(), time.thread_time()
        switches = thread_switches()
        profiler = None
        if args.profile:
            # Wall time shows waits for the GIL or a tier's lock too; CPU time only the work.
            timer = time.thread_time if args.profile_cpu else time.perf_counter
            profiler = cProfile.Profile(timer)
        if profiler is not None:
            profiler.enable()
        scheduled: dict[str, int] = {}
        budget = args.prefill_blocks * BLOCK_TOKENS
        left = budget
        if args.gpu_blocks:  # vLLM schedules the running requests first: what they take is gone
            left -= sum(
                req.num_tokens - req.num_computed_tokens
                for req_id, (_, req) in active.items()
                if req_id not in waiting
            )
        for req_id in list(waiting):
            conv, req = active[req_id]
            full = len(active) - len(waiting) >= args.running
            if args.gpu_blocks and (left <= 0 or full):
                break  # vLLM stops before asking the connector
            matched, _ = hooks.call("matched_tokens", planner.matched_tokens, req, 0)
            if matched is None:
                continue  # deferred: skipped this step
            need = -(-req.num_tokens // BLOCK_TOKENS)
            if args.gpu_blocks:
                if held + need > args.gpu_blocks:
                    break  # no GPU blocks for it: asked again next step
            elif budget <= 0 or full:
                continue  # asked again next step
            waiting.remove(req_id)
            held += need
            left -= req.num_tokens - matched
            req.num_computed_tokens = matched
            req.blocks = list(range(next_block, next_block + need))
            next_block += need
            tables[req_id] = req.blocks
            hooks.call("after_alloc", planner.after_alloc, req, req.blocks, matched)
        for req_id, (_, req) in active.items():
            if req_id in waiting or budget <= 0:
                continue
            todo = min(req.num_tokens - req.num_computed_tokens, budget)
            if todo > 0:
                scheduled[req_id] = todo
                budget -= todo
        orders = hooks.call("plan_step", planner.plan_step, scheduled, tables, None)
        report = RankReport(
            {o.job_id: 1 for o in (*orders.loads, *orders.stores)},
            {},
        )
        hooks.call("on_report", planner.on_report, report)
        hooks.call("take_stats", planner.take_stats)
        hooks.call("take_events", planner.take_events)
        for req_id, n in scheduled.items():
            conv, req = active[req_id]
            req.num_computed_tokens += n
            if req.num_computed_tokens >= req.num_tokens:
                hooks.call("request_finished", planner.request_finished, req)
                held -= len(req.blocks)
                del active[req_id]
                tables.pop(req_id, None)
                turn[conv] += 1
                if turn[conv] < args.turns:
                    submit(conv)
                elif pending:
                    submit(pending.pop(0))
        if profiler is not None:
            profiler.disable()
            profiles.append(profiler)
        wall, cpu = time.perf_counter() - started, time.thread_time() - cpu_started
        steps.append((wall, cpu, thread_switches() - switches))
        hooks.end_step()
        time.sleep(args.forward_ms / 1000)  # the forward pass: tier threads run meanwhile
    stats = planner.stats()
    planner.close()
    return steps, stats


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """``--repeat`` passes of the workload, each on a fresh planner: the steps pooled (with
    ``--steady``, each step's least time over as many runs)."""
    if args.steady:
        return measure_steady(args)
    profiles: list[cProfile.Profile] = []
    hooks = HookTimes()
    steps: list[tuple[float, float, int]] = []
    hit = promoted = loaded = 0
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            run_steps, stats = run(args, Path(tmp), profiles, hooks)
        steps += run_steps
        hit += stats["cache"]["hit_blocks"]
        promoted += stats["cache"]["promoted_blocks"]
        loaded += stats["cache"]["loaded_blocks"]
    us = [wall * 1e6 for wall, _, _ in steps]
    cpu_us = [cpu * 1e6 for _, cpu, _ in steps]
    blocked = [float(n) for _, _, n in steps]
    out: dict[str, Any] = {
        "steps": len(us),
        "step_us": summary(us),
        "step_cpu_us": summary(cpu_us),
        "step_blocked": summary(blocked),
        "hit_blocks": hit,
        "promoted_blocks": promoted,
        "loaded_blocks": loaded,
        "hooks": tail_breakdown(cpu_us, hooks.steps),
    }
    if profiles:
        threshold = percentile(cpu_us, 99)
        tail = [p for p, us in zip(profiles, cpu_us, strict=True) if us >= threshold]
        out["profile"] = (
            f"== every step ({len(profiles)}), by cumulative time\n"
            + profile_text(profiles, "cumulative", 25)
            + f"\n== the steps at or above p99 ({len(tail)}), by own time\n"
            + profile_text(tail, "tottime", 25)
        )
    return out


def measure_steady(args: argparse.Namespace) -> dict[str, Any]:
    """``--steady`` runs of the same work step by step: each step's least wall and CPU time and
    each hook's least CPU time over the runs."""
    runs: list[tuple[list[tuple[float, float, int]], HookTimes]] = []
    decided: set[tuple[int, int, int]] = set()
    for _ in range(args.steady):
        hooks = HookTimes()
        with tempfile.TemporaryDirectory() as tmp:
            run_steps, stats = run(args, Path(tmp), [], hooks)
        runs.append((run_steps, hooks))
        c = stats["cache"]
        decided.add((c["hit_blocks"], c["promoted_blocks"], c["loaded_blocks"]))
    if len(decided) != 1 or len({len(steps) for steps, _ in runs}) != 1:
        raise RuntimeError(f"--steady runs decided differently: {sorted(decided)}")
    n = len(runs[0][0])
    us = [min(steps[i][0] for steps, _ in runs) * 1e6 for i in range(n)]
    cpu_us = [min(steps[i][1] for steps, _ in runs) * 1e6 for i in range(n)]
    names = {name for _, hooks in runs for step in hooks.steps for name in step}
    least = [
        {name: min(hooks.steps[i].get(name, 0.0) for _, hooks in runs) for name in names}
        for i in range(n)
    ]
    ((hit, promoted, loaded),) = decided
    return {
        "steps": n,
        "runs": args.steady,
        "step_us": summary(us),
        "step_cpu_us": summary(cpu_us),
        "hit_blocks": hit,
        "promoted_blocks": promoted,
        "loaded_blocks": loaded,
        "hooks": tail_breakdown(cpu_us, least),
        # Each step's, for the least over several invocations (written with --json only).
        "each_step": {"cpu_us": cpu_us, "hooks_s": least},
    }


def profile_text(profiles: list[cProfile.Profile], order: str, lines: int) -> str:
    text = io.StringIO()
    stats = pstats.Stats(profiles[0], stream=text)
    for more in profiles[1:]:
        stats.add(more)
    stats.sort_stats(order).print_stats(lines)
    return text.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--conversations", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--running", type=int, default=8, help="requests vLLM runs at once")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--turn-blocks", type=int, default=100)
    parser.add_argument("--prefill-blocks", type=int, default=512)
    parser.add_argument("--pool-blocks", type=int, default=1536)
    parser.add_argument("--block-bytes", type=int, default=4096)
    parser.add_argument("--forward-ms", type=float, default=2.0)
    parser.add_argument(
        "--gpu-blocks",
        type=int,
        default=0,
        help="walk the waiting queue as vLLM does, with this many GPU blocks (0: ask every "
        "waiting request every step)",
    )
    parser.add_argument("--fs", action="store_true", help="an fs tier behind the pool")
    parser.add_argument("--fs-threads", type=int, default=4, help="the fs tier's I/O threads")
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the scheduler thread alone on the first CPU, kvtier's threads on the others",
    )
    parser.add_argument(
        "--fs-full",
        action="store_true",
        help="an fs tier on a disk it finds full (it refuses every write and holds nothing)",
    )
    parser.add_argument("--stats-file", action="store_true", help="vllm.stats_path set")
    parser.add_argument(
        "--events", action="store_true", help="record cache events (vLLM's KV events on)"
    )
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--profile-cpu", action="store_true", help="profile CPU time (default: wall time)"
    )
    parser.add_argument("--repeat", type=int, default=1, help="passes of the workload, pooled")
    parser.add_argument(
        "--steady",
        type=int,
        default=0,
        help="this many runs of the same work (a simulated clock, a tier without cost): each "
        "step's least time",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.fs_full and args.steady:
        parser.error("--fs-full needs the real fs tier: not with --steady")
    result = measure(args)
    profile = result.pop("profile", None)
    each = result.pop("each_step", None)
    print(json.dumps(result, indent=1))
    if profile:
        print(profile)
    if args.json:
        written = {"args": vars(args), **result, **({"each_step": each} if each else {})}
        Path(args.json).write_text(json.dumps(written, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
