"""The grid of ``benchmarks/vllm_gpu_bench.py --grid``: points, what to run, time and disk.

A point is a number of conversations in flight and a host pool size (key ``16x4``). At each point
every configuration runs in a fresh engine, and its row is merged into the JSON file as soon as it
finishes (with its date, the commit and the machine), so a grid can be spread over several
invocations. What runs is decided per point and configuration (:func:`plan_point`):

* ``--skip-done`` skips a configuration already recorded without error for the same workload
  (same request sequence and engine settings: ``workload.digest``) and the same commit (a
  variant, ``kvtier_fs+tiers.0.write=on_evict``, is a configuration of its own: its label is
  its key in the file);
  ``--reuse-baselines`` also keeps vLLM's own configurations (``none``, ``native``,
  ``native_fs``) recorded at another commit, since kvtier's code does not move them;
* ``--rerun 16x4,32x2`` runs those points again all the same;
* ``none`` (vLLM alone) does not depend on the host pool: a usable ``none`` row of the same
  workload at another host size is copied (``copied_from``) instead of run again.

``--gpus N`` runs N points at once, one per GPU, in lockstep: a configuration starts at all of
them together, so what it shares the host with is the same configuration at another point
(recorded in its row as ``alongside``), and the fs tiers split the disk's safe size. A
configuration with an fs tier runs at one point at a time: two engines' fs tiers on one disk
slow each other (on a two-H200 host kvtier + fs at 16x4 read 40% less and queued writes past
its 10 s limit beside 16x8's).

``--max-minutes`` stops before a round of points whose estimate does not fit in what is left,
and before a configuration of a started round that would end past it; estimates come from the
rows already in the file (same model and GPU: a configuration's process time less its timed
run, plus seconds per prompt token), else from ``PRIORS``.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import config_variants as variants

BASELINES = frozenset({"none", "native", "native_fs"})
"""vLLM's own configurations: kvtier's code does not move their figures."""
DEFAULT_CONCURRENCY = (4, 8, 16, 32)
DEFAULT_HOST_GIB = (2.0, 4.0, 8.0)
DEFAULT_REQUESTS = {4: 80, 8: 160, 16: 240, 32: 320}
"""Requests per point (the issue's table: 160 at 8 in flight, 240 at 16, 320 at 32)."""
RESERVE_GIB = 8.0
RESERVE_SHARE = 0.15
"""The fs tiers leave the larger of 8 GiB and 15% of the disk free."""


class GridError(ValueError):
    """A bad grid argument (one line, for the command line)."""


# -- points -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, order=True)
class GridPoint:
    concurrency: int
    host_gib: float

    @property
    def key(self) -> str:
        return f"{self.concurrency}x{self.host_gib:g}"


def parse_point(text: str) -> GridPoint:
    """``16x4`` -> 16 conversations in flight, 4 GiB host pool."""
    match = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+(?:\.\d+)?)\s*", text)
    if match is None:
        raise GridError(f"grid point {text!r}: expected CONCURRENCYxHOST_GIB, e.g. 16x4")
    point = GridPoint(int(match.group(1)), float(match.group(2)))
    if point.concurrency < 1 or point.host_gib <= 0:
        raise GridError(f"grid point {text!r}: concurrency and host GiB must be positive")
    return point


def parse_points(text: str) -> list[GridPoint]:
    return [parse_point(part) for part in text.split(",") if part.strip()]


def parse_numbers(text: str, name: str, kind: Callable[[str], float]) -> list[float]:
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise GridError(f"{name}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise GridError(f"{name}: expected positive numbers, got {text!r}")
    return values


def parse_requests(text: str) -> dict[int, int]:
    """``4:80,8:160``: requests per concurrency."""
    out: dict[int, int] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        c, sep, n = part.partition(":")
        if not sep or not c.strip().isdigit() or not n.strip().isdigit():
            raise GridError(f"--grid-requests: expected CONCURRENCY:REQUESTS,..., got {part!r}")
        out[int(c)] = int(n)
    return out


def requests_for(concurrency: int, table: dict[int, int]) -> int:
    """The table's entry, else 10 requests per conversation in flight."""
    return table.get(concurrency, 10 * concurrency)


def expand(
    concurrencies: Iterable[float], hosts: Iterable[float], selected: list[GridPoint] | None
) -> list[GridPoint]:
    """The grid's points in run order (fewest conversations first, then the smallest pool), or
    the ``selected`` ones in that order."""
    if selected:
        return sorted(set(selected))
    return sorted({GridPoint(int(c), float(h)) for c in concurrencies for h in hosts})


# -- provenance ---------------------------------------------------------------------------------


def git_commit(repo: Path) -> str:
    """``git rev-parse HEAD`` of ``repo`` (with ``+dirty`` when tracked files differ), or
    ``unknown``."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10
        )
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    commit = head.stdout.strip()
    return commit + "+dirty" if dirty.stdout.strip() else commit


def now_utc() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


# -- disk ---------------------------------------------------------------------------------------


def fs_capacity_gib(free: int, total: int) -> float:
    """What an fs tier may fill: the free space less the larger of ``RESERVE_GIB`` and
    ``RESERVE_SHARE`` of the disk (0 when that leaves nothing)."""
    reserve = max(RESERVE_GIB * (1 << 30), RESERVE_SHARE * total)
    return max(0.0, (free - reserve) / (1 << 30))


def disk_floor_bytes(total: int) -> int:
    """Free space below which a run stops (half the reserve): vLLM's fs tier has no capacity."""
    return int(max(RESERVE_GIB * (1 << 30), RESERVE_SHARE * total) / 2)


# -- JSON ---------------------------------------------------------------------------------------


def load(path: Path) -> dict[str, Any]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise GridError(f"{path}: not a JSON object")
    return data


_SCALAR_LIST = re.compile(r"\[[^\[\]{}]*\]")


def dumps(data: dict[str, Any]) -> str:
    """Indented JSON with every list of scalars on one line (a request's record is one line).
    JSON strings hold no raw newline, so joining lines inside a match never changes a value."""
    text = json.dumps(data, indent=1)

    def one_line(match: re.Match[str]) -> str:
        return "[" + re.sub(r"\s*\n\s*", " ", match.group(0)[1:-1]).strip() + "]"

    return _SCALAR_LIST.sub(one_line, text) + "\n"


def save(path: Path, data: dict[str, Any]) -> None:
    """Write atomically: an interrupted write leaves the previous file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(data))
    os.replace(tmp, path)


def merge_row(
    data: dict[str, Any],
    point: GridPoint,
    workload: dict[str, Any],
    config: str,
    row: dict[str, Any],
) -> None:
    entry = data.setdefault("points", {}).setdefault(point.key, {})
    entry["concurrency"] = point.concurrency
    entry["host_gib"] = point.host_gib
    if entry.get("workload", {}).get("digest") != workload.get("digest"):
        # A new workload at this point: rows of the old one no longer pair with the new ones.
        entry["configs"] = {}
    entry["workload"] = workload
    entry.setdefault("configs", {})[config] = row


def merge_files(data: dict[str, Any], sources: Iterable[dict[str, Any]]) -> list[str]:
    """Copy into ``data`` the rows of other grid files (a lent GPU's copy, run from a copy of
    ``data``) that ``data`` lacks or holds older (by ``date``); failed rows stay out, and so do
    the points whose workload differs from ``data``'s (their rows would not pair). Returns what
    was copied and what was left out, a line each."""
    lines: list[str] = []
    for source in sources:
        for key, point in source.get("points", {}).items():
            mine = data.get("points", {}).get(key)
            digest = point.get("workload", {}).get("digest")
            if mine is not None and mine.get("workload", {}).get("digest") != digest:
                lines.append(f"left out {key}: another workload than the file's")
                continue
            have = (mine or {}).get("configs", {})
            for config, row in sorted(point.get("configs", {}).items()):
                if not isinstance(row, dict) or "error" in row:
                    continue
                if config in have and str(have[config].get("date")) >= str(row.get("date")):
                    continue
                merge_row(data, parse_point(key), point.get("workload", {}), config, row)
                lines.append(f"merged {key} {config} ({row.get('commit')}, {row.get('date')})")
    return lines


# -- what to run --------------------------------------------------------------------------------


def new_run_id() -> str:
    return f"{os.getpid()}-{time.time_ns()}"


@dataclass(frozen=True, slots=True)
class Selection:
    """Which recorded rows stand for a run of this code (see the module docstring)."""

    commit: str
    skip_done: bool = False
    reuse_baselines: bool = False
    rerun: frozenset[str] = frozenset()
    """Point keys run again whatever the file holds."""
    run_id: str = field(default_factory=new_run_id)
    """This invocation's rows are trusted whatever the commit (an ``unknown`` one included)."""

    def trusts(self, row: Any, digest: str, config: str, point: str) -> bool:
        """Whether ``row`` (recorded for ``config``) stands for running it now at ``point``."""
        if point in self.rerun or not isinstance(row, dict) or "error" in row:
            return False
        if row.get("workload_digest") != digest:
            return False
        if row.get("run_id") == self.run_id:
            return True
        clean = self.commit != "unknown" and not self.commit.endswith("+dirty")
        same_commit = clean and row.get("commit") == self.commit
        return same_commit or (self.reuse_baselines and config in BASELINES)


def done_row(
    data: dict[str, Any], point: GridPoint, config: str, digest: str, selection: Selection
) -> dict[str, Any] | None:
    """The recorded row that makes running ``config`` at ``point`` unnecessary, if any: its own
    (with ``--skip-done``), or for ``none`` one at another host size of the same workload."""
    points: dict[str, Any] = data.get("points", {})
    if selection.skip_done:
        row = points.get(point.key, {}).get("configs", {}).get(config)
        if selection.trusts(row, digest, config, point.key):
            return dict(row)
    if config != "none":
        return None
    for key, other in sorted(points.items()):
        if key == point.key or other.get("concurrency") != point.concurrency:
            continue
        row = other.get("configs", {}).get("none")
        if selection.trusts(row, digest, config, point.key):
            copied = dict(row)
            copied["copied_from"] = key
            return copied
    return None


# -- time ---------------------------------------------------------------------------------------

PRIORS: dict[str, tuple[float, float]] = {
    "llama8b": (90.0, 60e-6),
    "tiny": (20.0, 200e-6),
}
"""Per model: engine start (plus warm-up and shutdown) in seconds, seconds per prompt token."""


@dataclass(slots=True)
class Estimator:
    """Seconds a configuration takes at a point: start-up plus seconds per prompt token, the
    medians of the rows recorded for that configuration (a variant without rows: its base's;
    else any configuration's)."""

    prior: tuple[float, float]
    samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def add(self, config: str, row: dict[str, Any]) -> None:
        if "error" in row or "copied_from" in row or not row.get("prompt_tokens"):
            return
        # A child's whole life where known (its imports and exit too: 20-40 s on an H200).
        elapsed = float(row.get("process_s") or row.get("elapsed_s") or 0.0)
        wall = float(row.get("wall_s") or 0.0)
        if elapsed <= 0 or wall <= 0:
            return
        per_token = wall / int(row["prompt_tokens"])
        self.samples.setdefault(config, []).append((max(0.0, elapsed - wall), per_token))

    def seconds(self, config: str, prompt_tokens: int) -> float:
        samples = (
            self.samples.get(config)
            or self.samples.get(variants.base_of(config))
            or [s for v in self.samples.values() for s in v]
        )
        if not samples:
            start, per_token = self.prior
        else:
            start = statistics.median(s for s, _ in samples)
            per_token = statistics.median(p for _, p in samples)
        return start + per_token * prompt_tokens


def estimator_from(data: dict[str, Any], model: str, gpu: str | None) -> Estimator:
    """An estimator fed with the file's rows of the same model name and GPU."""
    prior = PRIORS["llama8b" if "8B" in model else "tiny"]
    est = Estimator(prior)
    if data.get("model") != model:
        return est
    for point in data.get("points", {}).values():
        for config, row in point.get("configs", {}).items():
            if isinstance(row, dict) and row.get("machine", {}).get("gpu") == gpu:
                est.add(config, row)
    return est


# -- the loop -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PointWorkload:
    summary: dict[str, Any]
    """What the JSON keeps as the point's ``workload`` (``digest`` and ``prompt_tokens`` in it)."""

    @property
    def digest(self) -> str:
        return str(self.summary["digest"])

    @property
    def prompt_tokens(self) -> int:
        return int(self.summary["prompt_tokens"])


@dataclass(frozen=True, slots=True)
class Job:
    """One configuration at one point, on one lane (a GPU and a work directory of its own)."""

    point: GridPoint
    workload: PointWorkload
    config: str
    fs_gib: float
    lane: int = 0


class PointRunner(Protocol):
    """What the grid needs from the engine side (``vllm_gpu_bench``; a fake in the tests)."""

    model: str
    machine: dict[str, Any]
    """Kept in every row (``gpu`` names the card; estimates use rows of the same card)."""
    workdir: Path
    """Every lane's fs tiers live on this directory's disk."""

    def workload(self, point: GridPoint) -> PointWorkload: ...

    def clear_fs(self) -> None:
        """Delete every lane's fs tier directories."""

    def run(self, jobs: list[Job]) -> list[dict[str, Any]]:
        """The jobs at once, each on its own lane: their rows in order (``error`` in a row whose
        configuration failed)."""
        ...


@dataclass(slots=True)
class GridOptions:
    configs: list[str]
    selection: Selection
    max_minutes: float | None = None
    fs_gib: float | None = None
    """An fs capacity below the disk's safe size (None: the safe size)."""
    lanes: int = 1
    """Points run at once, one per GPU, in lockstep: each configuration starts at every point of
    the round together, so it shares the host (cores, memory) with the same configuration at
    another point, never with another configuration of its own point."""
    disk_configs: frozenset[str] = frozenset()
    """Configurations with an fs tier: run at one point at a time, each with the disk to
    itself."""

    def batches(self, jobs: list[Job]) -> list[list[Job]]:
        """The jobs of one configuration in a round, in the groups that run at once."""
        if jobs and jobs[0].config in self.disk_configs:
            return [[job] for job in jobs]
        return [jobs]


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def point_fs_gib(runner: PointRunner, options: GridOptions) -> float:
    """One lane's fs capacity: ``--fs-gib``, at most the disk's safe size over the lanes."""
    usage = shutil.disk_usage(runner.workdir)
    safe = fs_capacity_gib(usage.free, usage.total) / options.lanes
    if options.fs_gib is not None and options.fs_gib < safe:
        return options.fs_gib
    if options.fs_gib is not None:
        _log(f"fs capacity {options.fs_gib:g} GiB capped to the disk's safe {safe:.1f} GiB")
    return round(safe, 1)


@dataclass(slots=True)
class PointPlan:
    point: GridPoint
    workload: PointWorkload
    todo: list[str]


def run_grid(
    points: list[GridPoint],
    options: GridOptions,
    runner: PointRunner,
    out: Path,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """Run the points in order, ``options.lanes`` at a time, merging each configuration's row
    into ``out`` as it finishes; returns the file's data. Stops before a round of points whose
    estimate exceeds ``max_minutes``, and before a configuration of a started round that would
    end past it (the estimates learn from each row: an engine's first start in a lending
    compiles for tens of seconds)."""
    data = load(out)
    if data.get("model") not in (None, runner.model):
        raise GridError(f"{out} holds {data.get('model')!r}, not {runner.model!r}: use --json")
    data["model"] = runner.model
    est = estimator_from(data, runner.model, runner.machine.get("gpu"))
    started = clock()

    def fits(end_s: float) -> bool:
        return options.max_minutes is None or end_s <= options.max_minutes * 60

    def seconds(plans: list[PointPlan], configs: Iterable[str]) -> float:
        """The round's time: per configuration its slowest lane's, or the lanes' sum where
        they take turns."""
        total = 0.0
        for c in configs:
            each = [est.seconds(c, p.workload.prompt_tokens) for p in plans if c in p.todo]
            total += sum(each) if c in options.disk_configs else max(each, default=0.0)
        return total

    for first in range(0, len(points), options.lanes):
        plans = []
        for n, point in enumerate(points[first : first + options.lanes], first + 1):
            plan = plan_point(data, point, runner.workload(point), options)
            if plan.todo:
                plans.append(plan)
            else:
                _log(f"[{n}/{len(points)}] {point.key}: done already, skipped")
        save(out, data)  # the ``none`` rows copied
        if not plans:
            continue
        keys = ", ".join(p.point.key for p in plans)
        todo = [c for c in options.configs if any(c in p.todo for p in plans)]
        estimate = seconds(plans, todo)
        elapsed = clock() - started
        if not fits(elapsed + estimate):
            left = (options.max_minutes or 0.0) * 60 - elapsed
            what = "; ".join(f"{p.point.key}: {', '.join(p.todo)}" for p in plans)
            _log(
                f"stopping before {keys}: it needs ~{estimate / 60:.1f} min ({what}), "
                f"{max(0.0, left) / 60:.1f} min left of --max-minutes"
            )
            break
        _log(
            f"[{first + 1}/{len(points)}] {keys}: {'; '.join(', '.join(p.todo) for p in plans)}, "
            f"~{estimate / 60:.1f} min estimated, {elapsed / 60:.1f} min elapsed"
        )
        round_started = clock()
        runner.clear_fs()
        fs_gib = point_fs_gib(runner, options)
        for i, config in enumerate(todo):
            lanes = [(lane, p) for lane, p in enumerate(plans) if config in p.todo]
            if i and not fits(clock() - started + seconds([p for _, p in lanes], [config])):
                _log(f"stopping before {config} at {keys}: --max-minutes would pass")
                runner.clear_fs()
                return data
            jobs = [Job(p.point, p.workload, config, fs_gib, lane) for lane, p in lanes]
            for batch in options.batches(jobs):
                for job, row in zip(batch, runner.run(batch), strict=True):
                    sel = options.selection
                    row.update(date=now_utc(), commit=sel.commit, machine=runner.machine)
                    row.update(workload_digest=job.workload.digest, run_id=sel.run_id)
                    if len(batch) > 1:
                        row["alongside"] = [j.point.key for j in batch if j is not job]
                    merge_row(data, job.point, job.workload.summary, config, row)
                    est.add(config, row)
                save(out, data)
        runner.clear_fs()
        _log(
            f"[{first + 1}/{len(points)}] {keys}: took {(clock() - round_started) / 60:.1f} min "
            f"(estimated {estimate / 60:.1f})"
        )
    return data


def plan_point(
    data: dict[str, Any], point: GridPoint, workload: PointWorkload, options: GridOptions
) -> PointPlan:
    """What is left to run at ``point``; a ``none`` row it can copy is merged into ``data``
    instead."""
    todo = []
    for config in options.configs:
        row = done_row(data, point, config, workload.digest, options.selection)
        if row is None:
            todo.append(config)
        elif "copied_from" in row:
            merge_row(data, point, workload.summary, config, row)
    return PointPlan(point, workload, todo)
