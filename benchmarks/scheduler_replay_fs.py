"""kvtier's fs tier in the scheduler replay (``scheduler_replay.py``, configuration
``kvtier_fs``): the real ``FsTier`` on a temporary directory, with its time emulated.

``ReplayFsTier`` is an ``FsTier`` (its files, index, capacity and eviction, header and checksum)
that does each job's I/O inside ``submit`` (no I/O threads: ``threads`` = 0) and holds the job's
report back until the emulated clock reaches the job's end in ``FsModel``: ``threads`` servers
taking a job's blocks one at a time, reads before writes (the real tier queues reads in its
workers' first line and a write lets queued reads run between its blocks), first come first
served within each kind, ``read_ms`` / ``write_ms`` per block and ``job_ms`` per job
(``FsTiming``, set with ``--fs``).
A report's ``JobResult.busy_s`` is the model's time from the job's first block to its last (the
real tier's measure), so the promotion rules' cost model (``kvtier.cache.promotion``) sees
emulated times. A block a write has not finished in emulated time is not visible to ``lookup``
yet, as with the real tier (a file is renamed into place once written). Nothing depends on real
thread timing.

The tier's capacity is given in the grid's bytes (``--fs-gib``, a real block is
``scheduler_replay_engine.BLOCK_BYTES``) and scaled to as many of the replay's one-layer blocks.
The cache's clock is the emulated one (``Emulation.clock``), and ``TieredCache.wait`` (what the
planner calls when a step has nothing to schedule and a lookup waits) advances the emulated CPU
to the next job's end instead of sleeping.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import inspect
import math
import shutil
import tempfile
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import scheduler_replay_engine as replay

from kvtier.keys import BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import JobResult, TierJob, TierJobKind

try:
    from kvtier.tiers.fs.tier import FsTier
except ImportError:  # kvtier before the fs tier became a package (replaying a measured commit)
    from kvtier.tiers.fs import FsTier  # type: ignore[attr-defined,no-redef]
from kvtier.tiers.payload import HEADER_BYTES


@dataclass(slots=True)
class FsTiming:
    """The fs tier's service times (milliseconds of the grid's blocks)."""

    read_ms: float = 0.25
    """One block read by one I/O thread (fitted: see ``docs/vllm.md``, kvtier + fs in the
    replay)."""
    write_ms: float = 8.0
    """One block written by one I/O thread (fitted)."""
    job_ms: float = 0.0
    """Added once per job (its first block's start)."""
    kept_ms: float = 0.02
    """A written block the tier already holds (``Put.KEPT``: an index touch, no file)."""
    threads: int = 4
    """I/O threads (the fs tier's default)."""
    engine_ms: float = 0.1
    """The engine thread's time per block a job moves (file blocks, not kept ones), charged when
    the job is submitted: the tier's threads taking the GIL from the scheduler (fitted to the
    grid's wall time and tokens/s)."""


@dataclass(slots=True)
class _Job:
    job_id: int
    reading: bool
    submitted: float
    blocks: int
    kept: frozenset[int] = frozenset()
    """Indexes of a write's blocks the tier already held: ``kept_ms`` each."""
    started: int = 0
    done: int = 0
    first: float | None = None
    end: float = 0.0
    ok: list[bool] = field(default_factory=list)


@dataclass(slots=True)
class FsModel:
    """The fs tier's queue on the emulated clock (seconds): ``threads`` servers taking one block
    at a time, the oldest read job's next block before any write job's."""

    timing: FsTiming
    reads: deque[_Job] = field(default_factory=deque)
    writes: deque[_Job] = field(default_factory=deque)
    free: list[float] = field(default_factory=list)
    """Heap of the servers' free times."""
    running: list[tuple[float, int, _Job]] = field(default_factory=list)
    """Heap of (end, sequence, job) of blocks in service."""
    finished: list[_Job] = field(default_factory=list)
    busy_s: float = 0.0
    """Server time spent, all jobs (reads and writes)."""
    read_busy_s: float = 0.0
    _seq: int = 0

    def __post_init__(self) -> None:
        self.free = [0.0] * max(1, self.timing.threads)

    def submit(self, job: _Job) -> None:
        (self.reads if job.reading else self.writes).append(job)

    def advance(self, now: float) -> None:
        """Start every block a server can start by ``now`` (a block started runs to its end) and
        retire the blocks that ended by ``now``."""
        t = self.timing
        while self.reads or self.writes:
            at = max(self.free[0], self._earliest())
            if at > now:
                break
            job = self._pick(at)
            heapq.heappop(self.free)
            per_block = (t.read_ms if job.reading else t.write_ms) / 1e3
            if job.started in job.kept:
                per_block = t.kept_ms / 1e3
            start = at + (t.job_ms / 1e3 if job.first is None else 0.0)
            if job.first is None:
                job.first = at
            end = start + per_block
            self.busy_s += end - at
            if job.reading:
                self.read_busy_s += end - at
            heapq.heappush(self.free, end)
            self._seq += 1
            heapq.heappush(self.running, (end, self._seq, job))
            job.started += 1
            if job.started == job.blocks:
                (self.reads if job.reading else self.writes).popleft()
        self._retire(now)

    def _earliest(self) -> float:
        heads = [q[0].submitted for q in (self.reads, self.writes) if q]
        return min(heads)

    def _pick(self, at: float) -> _Job:
        if self.reads and self.reads[0].submitted <= at:
            return self.reads[0]
        return self.writes[0]

    def _retire(self, now: float) -> None:
        running = self.running
        while running and running[0][0] <= now:
            end, _, job = heapq.heappop(running)
            job.done += 1
            if job.done == job.blocks:
                job.end = end
                self.finished.append(job)

    def next_end(self) -> float | None:
        """When the next block in service ends (None: nothing in service)."""
        return self.running[0][0] if self.running else None

    def take_finished(self) -> list[_Job]:
        out, self.finished = self.finished, []
        return out


DEFAULT_FS_GIB = 24.3
"""The grid's fs capacity (``fs_gib`` of the H100 rows: 24.1-24.6 GiB)."""
TIER_KIND = "scheduler_replay_fs:ReplayFsTier"


def parse_timing(text: str) -> FsTiming:
    """``read_ms=1,write_ms=4,threads=4``: an ``FsTiming`` with those fields changed."""
    timing = FsTiming()
    for item, name, value in replay.field_settings(text, FsTiming, "--fs"):
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"--fs {item!r}: not a number") from None
        if number < 0 or (name == "threads" and number < 1):
            raise ValueError(f"--fs {item!r}: out of range")
        setattr(timing, name, int(number) if name == "threads" else number)
    return timing


@dataclass(frozen=True, slots=True)
class FsSetup:
    """The emulated fs tier of ``kvtier_fs``: its speeds and the grid's capacity."""

    timing: FsTiming = field(default_factory=FsTiming)
    gib: float = DEFAULT_FS_GIB

    def describe(self) -> dict[str, float]:
        return {**dataclasses.asdict(self.timing), "gib": self.gib}


class Emulation:
    """The emulated time of one replayed ``kvtier_fs`` configuration: the machine's clock for
    the cache, the fs tiers built under it, and waits that move the clock instead of sleeping."""

    def __init__(self, machine: Any, setup: FsSetup, workdir: Path) -> None:
        self.machine = machine
        """``scheduler_replay_engine.Machine``: its ``cpu`` (milliseconds) is the clock."""
        self.setup = setup
        self.workdir = workdir
        self.tiers: list[ReplayFsTier] = []
        self.draining = False
        """At shutdown: every held report is released at once."""
        self.waited_ms = 0.0
        """Emulated time the engine thread spent in ``TieredCache.wait``."""
        self.paths: list[str] = []
        """The fs tiers' directories (``remove``)."""

    def clock(self) -> float:
        return float(self.machine.cpu) / 1e3

    def set_clock(self, seconds: float) -> None:
        """Moves the machine's clock to ``seconds``: at least there once read back (``ms / 1e3``
        can round below what ``seconds * 1e3`` came from, and a wait for a job ending exactly
        then would never see it end)."""
        ms = seconds * 1e3
        while ms / 1e3 < seconds:
            ms = math.nextafter(ms, math.inf)
        self.machine.cpu = max(self.machine.cpu, ms)

    def tier_configs(self) -> list[dict[str, Any]]:
        """The kvtier config's ``tiers``: one fs tier in a new directory under ``workdir``."""
        path = tempfile.mkdtemp(prefix="fs-", dir=self.workdir)
        self.paths.append(path)
        capacity = int(self.setup.gib * (1 << 30))
        return [{"kind": TIER_KIND, "name": "fs", "path": path, "capacity": capacity}]

    def remove(self) -> None:
        """Delete the fs tiers' directories, once the engine shut down: each holds up to the
        tier's capacity (24.3 GiB by default), and replays sharing a ``--workdir`` had left 41
        GiB behind after ten runs, till the disk was full and the fs tier refused every write."""
        for path in self.paths:
            shutil.rmtree(path, ignore_errors=True)
        self.paths.clear()

    def next_end(self) -> float | None:
        ends = [e for e in (t.model.next_end() for t in self.tiers) if e is not None]
        return min(ends, default=None)

    def wait(self, cache: Any, timeout_s: float) -> bool:
        """``TieredCache.wait`` on the emulated clock: step until a job ended, moving the CPU's
        clock to the next block's end, at most ``timeout_s`` on."""
        deadline = self.clock() + timeout_s
        while True:
            if cache.step():
                return True
            end = self.next_end()
            now = self.clock()
            if end is None or now >= deadline:
                return False
            to = min(max(end, now), deadline)
            self.waited_ms += (to - now) * 1e3
            self.set_clock(to)

    def summary(self) -> dict[str, float]:
        """What the row records of the model: server seconds (reads, all) and the waits."""
        out = {"wait_ms": round(self.waited_ms, 1)}
        for tier in self.tiers:
            out["read_busy_s"] = round(tier.model.read_busy_s, 3)
            out["busy_s"] = round(tier.model.busy_s, 3)
        return out


CURRENT: Emulation | None = None
"""The emulation the next ``ReplayFsTier`` is built under (``emulated``)."""


@contextlib.contextmanager
def emulated(emulation: Emulation | None) -> Iterator[None]:
    """While the engine is built: its kvtier cache runs on ``emulation``'s clock (the planner's
    ``build_cache`` is given it) and waits on it, and ``ReplayFsTier`` s join it."""
    global CURRENT
    if emulation is None:
        yield
        return
    import kvtier.engine.planner as planner

    original = planner.build_cache

    takes_clock = "clock" in inspect.signature(original).parameters

    def build(*args: Any, **kwargs: Any) -> Any:
        if takes_clock:
            pool, cache = original(*args, **kwargs, clock=emulation.clock)
        else:  # an older kvtier (replaying a measured commit): the same clocks, set after
            pool, cache = original(*args, **kwargs)
            for part in (cache, *vars(cache).values()):
                if callable(getattr(part, "_clock", None)):
                    part._clock = emulation.clock
        cache.wait = lambda timeout_s: emulation.wait(cache, timeout_s)
        return pool, cache

    CURRENT, planner.build_cache = emulation, build
    try:
        yield
    finally:
        CURRENT, planner.build_cache = None, original


def tier_counters(stats: dict[str, Any]) -> dict[str, int]:
    """The grid's kvtier_fs figures of a stats snapshot (empty without an fs tier)."""
    fs = stats.get("tiers", {}).get("fs")
    if fs is None:
        return {}
    cache, connector = stats["cache"], stats["connector"]
    return {
        "promoted_blocks": int(cache["promoted_blocks"]),
        "promotions_declined": int(cache["promotions_declined"]),
        "store_skipped_full": int(cache["store_skipped_full"]),
        "deferred_lookups": int(connector["deferred_lookups"]),
        "tier_read_blocks": int(fs["read_blocks"]),
        "tier_read_jobs": int(fs["read_jobs"]),
        "tier_write_blocks": int(fs["write_blocks"]),
        "tier_evictions": int(fs["evictions"]),
    }


class ReplayFsTier(FsTier):
    """``FsTier`` with its I/O inside ``submit`` and its reports timed by ``FsModel``."""

    @classmethod
    def create(cls, name: str, namespace: Namespace, pool: HostPool, options: Any) -> FsTier:
        emulation = CURRENT
        if emulation is None:
            raise RuntimeError("ReplayFsTier outside an emulation (scheduler_replay_fs.CURRENT)")
        blocks = options.capacity // (replay.BLOCK_BYTES + HEADER_BYTES)
        scaled = dataclasses.replace(
            options, threads=0, capacity=max(1, blocks) * (pool.slot_bytes + HEADER_BYTES)
        )
        tier = cls(name, namespace, pool, scaled)
        tier.emulation = emulation
        tier.model = FsModel(emulation.setup.timing)
        emulation.tiers.append(tier)
        return tier

    def __init__(self, name: str, namespace: Namespace, pool: HostPool, options: Any) -> None:
        self.emulation: Emulation | None = None
        self.model = FsModel(FsTiming())
        self._jobs: dict[int, _Job] = {}
        self._unseen: dict[BlockKey, int] = {}
        """Keys a write stored for real that its emulated job has not finished: not visible."""
        self._writing: dict[int, list[BlockKey]] = {}
        self._submitting: _Job | None = None
        self._shown = 0
        """Bumped after each change of ``_unseen`` (what ``lookup`` answers: ``generation``)."""
        super().__init__(name, namespace, pool, options)

    def _now(self) -> float:
        e = self.emulation
        return float("inf") if e is None or e.draining else e.clock()

    def generation(self) -> int | None:
        """The index's changes and ``_unseen``'s (both only grow: their sum changes with either;
        a kvtier before ``Tier.generation`` never calls this)."""
        changes = super().generation()
        return None if changes is None else changes + self._shown

    def exists(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        out = super().exists(keys)
        unseen = self._unseen
        if unseen:
            out = [
                False if present and key in unseen else present
                for key, present in zip(keys, out, strict=True)
            ]
        return out

    def submit(self, job: TierJob) -> None:
        now = self._now()
        self.model.advance(now)
        reading = job.kind is TierJobKind.READ
        fresh: list[BlockKey] = []
        kept: set[int] = set()
        if not reading:
            present = super().exists(job.keys)
            for i, (key, held) in enumerate(zip(job.keys, present, strict=True)):
                if held or key in self._unseen:
                    kept.add(i)
                else:
                    fresh.append(key)
        state = _Job(job.job_id, reading, now, len(job.keys), frozenset(kept))
        self._submitting = state
        try:
            super().submit(job)  # the real I/O, inline; its report lands in state.ok
        finally:
            self._submitting = None
        if state.blocks == 0:
            state.end = now
            self.model.finished.append(state)
            return
        for key in fresh:
            self._unseen[key] = self._unseen.get(key, 0) + 1
        if fresh:
            self._shown += 1
        self._writing[job.job_id] = fresh
        self._jobs[job.job_id] = state
        engine_ms = self.model.timing.engine_ms
        if engine_ms and self.emulation is not None:
            machine = self.emulation.machine
            machine.cpu += engine_ms * (state.blocks - len(state.kept))
        self.model.submit(state)
        self.model.advance(now)

    def _finish(self, job_id: int, ok: list[bool], busy_s: float | None = None) -> None:
        state = self._submitting
        if state is None or state.job_id != job_id:
            super()._finish(job_id, ok, busy_s)
            return
        state.ok = list(ok)

    def poll(self) -> list[JobResult]:
        self.model.advance(self._now())
        for state in self.model.take_finished():
            self._jobs.pop(state.job_id, None)
            written = self._writing.pop(state.job_id, ())
            for key in written:
                left = self._unseen.get(key, 0) - 1
                if left > 0:
                    self._unseen[key] = left
                else:
                    self._unseen.pop(key, None)
            if written:
                self._shown += 1
            busy = None if state.first is None else max(0.0, state.end - state.first)
            self._done.append(JobResult(state.job_id, state.ok, busy))
        return super().poll()
