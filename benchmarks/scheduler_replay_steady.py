#!/usr/bin/env python3
"""The connectors' scheduler-side CPU time per engine step in the scheduler replay, each step's
least over several runs: kvtier's against vLLM's native connector on a shared machine.

``scheduler_replay.py`` times every scheduler-side connector call per step
(``vllm_bench_engine.HookTimer``); on a shared 2-core VM other processes make one run's p99
swing by a third.
Here each configuration runs ``--runs`` times at each point in one work directory: kvtier's keys
depend on the model's path, so with the same directory (and the replay's fixed hash seed) every
run makes the same decisions step by step (checked: the same steps and cached tokens, else it
stops), and each step's time is its least over the runs, what the step costs without
interference (``scheduler_step_bench.py --steady`` does the same without vLLM). For
``kvtier_fs`` the fs tier's emulation, which runs inline on the scheduler thread where kvtier's
fs tier has threads of its own (its I/O and the queue model timing it), is taken out of each
step (``Recorded``). Prints per point each configuration's p50 / p90 / p99 and kvtier's ratios
to native, and writes JSON.

    PYTHONPATH=src python3 benchmarks/scheduler_replay_steady.py --vllm-path /tmp/vllm0251 \\
        --points 4x2,8x4,16x2 --configs native,kvtier,kvtier_fs --runs 6

``--workdir`` (``scheduler_replay.py``'s) fixes the directory across invocations too (the same
keys: two versions of kvtier decide alike and compare step for step); it is emptied before each
run. The JSON keeps each step's least time (``each_step_cpu_s``): with one ``--workdir`` the
steps of several invocations line up, and ``--merge`` prints and writes the least over the JSON
files it is given instead of replaying (one machine's invocations spread over time: a quiet
minute for each step).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import scheduler_replay as sr
import scheduler_replay_engine as replay
import scheduler_replay_fs as rfs
import scheduler_replay_vllm as rv
import vllm_grid as grid
import vllm_grid_report as gr


def least_per_step(runs: list[list[float]]) -> list[float]:
    """Each step's least time over runs of the same steps."""
    if len({len(run) for run in runs}) != 1:
        raise RuntimeError(f"runs took different steps: {sorted({len(r) for r in runs})}")
    return [min(times) for times in zip(*runs, strict=True)]


@dataclass(slots=True)
class Recorded:
    """A replay's connector clock and, per step, the CPU seconds its hooks spent emulating the fs
    tier: the job's I/O (``ReplayFsTier`` does it inline in ``submit``) and the queue model that
    times it (``FsModel.advance``). kvtier's real fs tier does its I/O on its own threads, and
    has no queue model, so neither is kvtier's time on the scheduler thread."""

    clock: Any = None
    io_s: dict[int, float] = field(default_factory=dict)

    def cpu(self) -> list[float]:
        """Each step's CPU seconds in the connector's hooks, less the fs tier's emulation."""
        return [cpu - self.io_s.get(i, 0.0) for i, cpu in enumerate(self.clock.cpu_steps)]

    def timed(self, method: Any) -> Any:
        """``method``, its CPU time inside a hook of the step in flight kept in ``io_s``."""

        def run(*args: Any) -> Any:
            started = time.thread_time()
            try:
                return method(*args)
            finally:
                clock = self.clock
                if clock is not None and clock._depth > 0:
                    step = len(clock.cpu_steps)
                    self.io_s[step] = self.io_s.get(step, 0.0) + time.thread_time() - started

        return run


@contextlib.contextmanager
def recording() -> Iterator[Recorded]:
    """While open, the ``HookTimer`` the replay makes (one per ``run_config``) is kept,
    with the fs tier's emulation time inside its hooks."""
    made = Recorded()

    original = sr.eng.HookTimer

    class Kept(original):  # type: ignore[misc,valid-type]
        def __init__(
            self, connector: Any, enabled: bool = False, profile_s: float | None = None
        ) -> None:
            super().__init__(connector, enabled, profile_s)
            made.clock = self

    run_blocks, advance = rfs.ReplayFsTier._run_blocks, rfs.FsModel.advance
    sr.eng.HookTimer = Kept  # type: ignore[misc,attr-defined]
    rfs.ReplayFsTier._run_blocks = made.timed(run_blocks)  # type: ignore[method-assign]
    rfs.FsModel.advance = made.timed(advance)  # type: ignore[method-assign]
    try:
        yield made
    finally:
        sr.eng.HookTimer = original  # type: ignore[misc,attr-defined]
        rfs.ReplayFsTier._run_blocks = run_blocks  # type: ignore[method-assign]
        rfs.FsModel.advance = advance  # type: ignore[method-assign]


def figures(seconds: list[float]) -> dict[str, float]:
    us = [s * 1e6 for s in seconds]
    return {f"p{q}": round(gr.percentile(us, q), 1) for q in (50, 90, 99)}


def run_point(
    point: sr.Point, spec: sr.ConfigSpec, args: argparse.Namespace, workdir: Path
) -> dict[str, Any]:
    """``args.runs`` replays of one configuration at one point, each in ``workdir`` emptied."""
    cpu_runs: list[list[float]] = []
    decided: set[tuple[int, int]] = set()
    fs = rfs.FsSetup(rfs.parse_timing(args.fs), args.fs_gib)
    cost, hold = replay.parse_cost(args.cost), sr.parse_hold(args.hold)
    for _ in range(args.runs):
        shutil.rmtree(workdir, ignore_errors=True)
        workdir.mkdir(parents=True)
        settings = sr.settings_of(args, workdir)
        with recording() as recorded:
            row, _ = sr.run_config(point, spec, settings, cost, workdir, hold, fs)
        cpu_runs.append(recorded.cpu())
        decided.add((len(cpu_runs[-1]), int(row["prompt_tokens_cached"])))
        print(f"  {point.key} {spec.label}: {row['replay_s']} s", file=sys.stderr, flush=True)
    if len(decided) != 1:
        raise RuntimeError(f"{point.key} {spec.label}: runs decided differently: {decided}")
    ((steps, cached),) = decided
    least = least_per_step(cpu_runs)
    return {
        "steps": steps,
        "prompt_tokens_cached": cached,
        "runs": args.runs,
        "connector_step_cpu_us": figures(least),
        # Each step's, for the least over several invocations (same --workdir: same steps).
        "each_step_cpu_s": least,
    }


def point_lines(key: str, rows: dict[str, dict[str, Any]]) -> list[str]:
    out = [f"== {key}: connector CPU per step, each step's least of its runs (us)"]
    native = rows.get("native", {}).get("connector_step_cpu_us")
    for label, row in rows.items():
        f = row["connector_step_cpu_us"]
        text = f"  {label:12s} p50 {f['p50']:7,.0f}  p90 {f['p90']:7,.0f}  p99 {f['p99']:7,.0f}"
        if native is not None and label != "native":
            ratios = " / ".join(f"{f[q] / native[q]:.2f}x" for q in ("p50", "p90", "p99"))
            text += f"  ({ratios} native)"
        out.append(text + f"  cached {row['prompt_tokens_cached']:,}")
    return out


def merge(paths: list[Path]) -> dict[str, Any]:
    """The least of each step over invocations' JSON (same points, configurations, steps)."""
    files = [json.loads(path.read_text()) for path in paths]
    out = {key: value for key, value in files[0].items() if key != "points"}
    out["merged"] = [str(path) for path in paths]
    out["points"] = {}
    for key, rows in files[0]["points"].items():
        merged = {}
        for label, row in rows.items():
            runs = [f["points"][key][label] for f in files]
            if len({(r["steps"], r["prompt_tokens_cached"]) for r in runs}) != 1:
                raise RuntimeError(f"{key} {label}: the invocations decided differently")
            least = least_per_step([r["each_step_cpu_s"] for r in runs])
            merged[label] = {
                **row,
                "runs": sum(r["runs"] for r in runs),
                "connector_step_cpu_us": figures(least),
                "each_step_cpu_s": least,
            }
        out["points"][key] = merged
    return out


def main(argv: list[str] | None = None) -> int:
    p = sr.parser()
    p.description = (__doc__ or "").split("\n\n")[0]
    p.set_defaults(points="4x2,8x4,16x2", configs="native,kvtier")
    p.add_argument("--runs", type=int, default=4, help="replays per configuration and point")
    p.add_argument("--merge", type=Path, nargs="+", default=None, help="JSON files to merge")
    args = p.parse_args(argv)
    if args.merge:
        merged = merge(args.merge)
        for key, rows in merged["points"].items():
            print("\n".join(point_lines(key, rows)))
        if args.json is not None:
            args.json.write_text(json.dumps(merged, indent=1) + "\n")
        return 0
    specs = [sr.parse_config(c) for c in args.configs.split(",") if c.strip()]
    table = grid.parse_requests(args.requests)
    points = [
        sr.Point(g.key, g.concurrency, g.host_gib, grid.requests_for(g.concurrency, table))
        for g in grid.parse_points(args.points)
    ]
    out: dict[str, Any] = {
        "vllm": rv.use_vllm(args.vllm_path),
        "date": grid.now_utc(),
        "commit": grid.git_commit(sr.REPO),
        "runs": args.runs,
        "points": {},
    }
    with tempfile.TemporaryDirectory(prefix="kvtier-replay-") as tmp:
        workdir = args.workdir or Path(tmp) / "work"
        for point in points:
            rows = {spec.label: run_point(point, spec, args, workdir) for spec in specs}
            out["points"][point.key] = rows
            print("\n".join(point_lines(point.key, rows)), flush=True)
        if args.workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sr.fixed_hash_seed()
    sys.exit(main())
