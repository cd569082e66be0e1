"""The file chaos soak: a vLLM-like engine loop drives the planner (a stats snapshot offered on
every step, written by the stats file's thread; every request recorded to a trace) while another
thread plants FIFOs and symbolic links (to a file of someone else's, to ``/dev/zero``) at the
stats file, its old temp name, the trace and its salt, and the engine restarts its recorder on
them every 40 requests.

Asserted: no wrong payload is ever loaded into the engine's blocks, nothing hangs, no engine call
(``matched_tokens``, ``plan_step``, a recorder start, the final ``close``, which waits for the
last stats write) takes ``MAX_CALL_S`` or more, no file a link pointed to is ever written, and
once the faults stop the stats file is a private snapshot and the trace replays. A recorder start
on a planted FIFO or link is refused with ``ConfigError`` (counted), never a hang. Length
``KVTIER_CHAOS_FILES_S`` seconds (3 by default), seed ``KVTIER_CHAOS_SEED``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import stat
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from kvtier.config import load_config
from kvtier.engine.orders import SKIP, RankReport, StepOrders
from kvtier.engine.planner import Planner
from kvtier.engine.planner_settings import PlannerSettings
from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.recorder import TraceRecorder, salt_path
from kvtier.sim.trace import read_trace
from kvtier.stats_report import read_snapshot

SOAK_S = float(os.environ.get("KVTIER_CHAOS_FILES_S", "3"))
SEED = int(os.environ.get("KVTIER_CHAOS_SEED", "20261124"))
MAX_CALL_S = 2.0
"""A hang detector: an open that blocks on a planted FIFO never returns. Steps take milliseconds
alone; in the full suite on a 2-core VM, right after the 120 s main soak in the same process, one
plan_step took 0.58 s once (a collection of that soak's garbage, or the machine): no hang."""
BS = 4  # engine block size = kvtier block tokens (one engine block per slot)
SLOT_BYTES = 256
POOL_SLOTS = 48
ENGINE_BLOCKS = 64
PROMPTS = 6
PROMPT_BLOCKS = 10

T = TypeVar("T")


@dataclass(slots=True)
class Report:
    steps: int = 0
    loaded_blocks: int = 0
    wrong_payloads: int = 0
    hangs: int = 0
    max_call_s: float = 0.0
    max_call: str = ""
    recorder_starts: int = 0
    recorder_refused: int = 0
    faults: Counter[str] = field(default_factory=Counter)

    def timed(self, name: str, fn: Callable[[], T]) -> T:
        start = time.perf_counter()
        try:
            return fn()
        finally:
            spent = time.perf_counter() - start
            if spent > self.max_call_s:
                self.max_call_s, self.max_call = spent, name

    def print(self) -> None:
        print(f"\nfile chaos: seed {SEED}, {SOAK_S:.0f} s, {self.steps} engine steps")
        for name, count in sorted(self.faults.items()):
            print(f"    {count:6d}  {name}")
        print(
            f"  loaded blocks {self.loaded_blocks}, wrong payloads {self.wrong_payloads}, hangs "
            f"{self.hangs}, slowest {self.max_call_s * 1000:.1f} ms ({self.max_call}); recorder "
            f"started {self.recorder_starts}, refused {self.recorder_refused}"
        )


@dataclass
class Request:
    """What the planner reads of an engine request."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    max_tokens: float = 8

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.all_token_ids)


def block_bytes(tokens: list[int], index: int) -> bytes:
    """The KV of block ``index``: a function of every token up to its end, as real KV is."""
    prefix = b"".join(t.to_bytes(4, "little") for t in tokens[: (index + 1) * BS])
    digest = hashlib.blake2b(prefix, digest_size=32).digest()
    return digest * (SLOT_BYTES // len(digest))


class Tables(dict[str, list[int]]):
    """The engine's block tables (``BlockTableView``)."""

    def get(self, req_id: str) -> list[int]:  # type: ignore[override]
        return super().get(req_id, [])


class Engine:
    """One rank: its KV blocks, copies the planner's orders and checks every loaded block."""

    def __init__(self, planner: Planner, report: Report) -> None:
        self.planner = planner
        self.report = report
        self.blocks = [bytearray(SLOT_BYTES) for _ in range(ENGINE_BLOCKS)]
        self.tables = Tables()

    def run(self, request: Request) -> None:
        """Lookup, allocation, one step that loads, computes and stores, then the finish."""
        planner, report = self.planner, self.report
        matched, _ = report.timed("matched_tokens", lambda: planner.matched_tokens(request, 0))
        external = matched or 0
        blocks = list(range(-(-request.num_tokens // BS)))
        self.tables[request.request_id] = blocks
        planner.after_alloc(request, blocks, external)
        request.num_computed_tokens = external
        scheduled = {request.request_id: request.num_tokens - external}
        orders = report.timed("plan_step", lambda: planner.plan_step(scheduled, self.tables, None))
        report.steps += 1
        done = self._load(orders, request)
        for i in range(external // BS, len(blocks)):  # the forward pass
            self.blocks[blocks[i]][:] = block_bytes(request.all_token_ids, i)
        pool = planner.pool
        for order in orders.stores:
            for slot, engine_block in zip(order.slots, order.engine_blocks, strict=True):
                pool.view(slot)[:] = self.blocks[engine_block]
            done[order.job_id] = 1
        planner.on_report(RankReport(done=done))
        request.num_computed_tokens = request.num_tokens
        planner.request_finished(request)
        del self.tables[request.request_id]

    def _load(self, orders: StepOrders, request: Request) -> dict[int, int]:
        done: dict[int, int] = {}
        for order in orders.loads:
            if not order.fail:
                for slot, engine_block in zip(order.slots, order.engine_blocks, strict=True):
                    if engine_block != SKIP:
                        self.blocks[engine_block][:] = self.planner.pool.view(slot)
                        want = block_bytes(request.all_token_ids, engine_block)
                        self.report.loaded_blocks += 1
                        self.report.wrong_payloads += self.blocks[engine_block] != want
            done[order.job_id] = 1
        return done


class Planter:
    """Plants a FIFO or a link at one of the file names, from its own thread."""

    def __init__(self, rng: random.Random, report: Report, names: list[Path], victim: Path):
        self.rng = rng
        self.report = report
        self.names = names
        self.victim = victim
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="file-planter", daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(self.rng.uniform(0.002, 0.02)):
            self.plant(self.rng.choice(self.names), self.rng.choice(["fifo", "link", "zero"]))

    def plant(self, path: Path, kind: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        try:
            if kind == "fifo":
                os.mkfifo(path)
            else:
                path.symlink_to(self.victim if kind == "link" else Path("/dev/zero"))
        except FileExistsError:  # the engine wrote the name meanwhile: no fault this time
            return
        self.report.faults[f"{kind} at {path.name}"] += 1

    def heal(self) -> None:
        for path in self.names:
            if path.is_symlink() or (path.exists() and not path.is_file()):
                path.unlink()


def start_recorder(trace: Path, report: Report) -> TraceRecorder | None:
    """A restarted engine's recorder: refused (None) on a planted FIFO or link, never a hang."""
    report.recorder_starts += 1
    try:
        return report.timed("TraceRecorder()", lambda: TraceRecorder(trace, BS))
    except ConfigError as exc:
        assert "vllm.trace_path" in str(exc)
        report.recorder_refused += 1
        return None


def soak(planner: Planner, trace: Path, planter: Planter, report: Report) -> None:
    rng = random.Random(SEED)
    prompts = [[rng.randrange(1 << 30) for _ in range(PROMPT_BLOCKS * BS)] for _ in range(PROMPTS)]
    engine = Engine(planner, report)
    deadline = time.monotonic() + SOAK_S
    i = 0
    while time.monotonic() < deadline:
        if i % 40 == 0:  # the engine restarts its recorder on whatever the planter left
            if planner.recorder is not None:
                planner.recorder.close()
            planner.recorder = start_recorder(trace, report)
        base = rng.choice(prompts)[: rng.randrange(1, PROMPT_BLOCKS) * BS]
        tail = [rng.randrange(1 << 30) for _ in range(rng.randrange(1, BS + 3))]
        engine.run(Request(f"r{i}", base + tail, max_tokens=rng.choice([8, float("nan")])))
        i += 1


def test_file_chaos_soak(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    (tmp_path / "shm").mkdir()
    files = tmp_path / "files"
    files.mkdir()
    victim = tmp_path / "victim"
    victim.write_bytes(b"not kvtier's")
    stats, trace = files / "stats.json", files / "trace.jsonl"
    names = [stats, files / "stats.json.tmp", trace, salt_path(trace)]
    config = load_config(
        {
            "model": "toy",
            "pool": {"size": POOL_SLOTS * SLOT_BYTES, "shm_dir": str(tmp_path / "shm")},
        }
    )
    namespace = Namespace(model="toy", dtype="uint8", block_tokens=BS)
    planner = Planner(config, PlannerSettings(stats_path=str(stats)), namespace, SLOT_BYTES, BS, 1)
    planner._stats_file._interval_s = 0.0  # type: ignore[union-attr]  # a snapshot every step
    report = Report()
    planter = Planter(random.Random(SEED + 1), report, names, victim)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            soak(planner, trace, planter, report)
        except BaseException as exc:  # handed to the test
            errors.append(exc)

    engine_thread = threading.Thread(target=run, name="engine", daemon=True)
    planter.thread.start()
    engine_thread.start()
    engine_thread.join(SOAK_S + 30)
    planter.stop.set()
    planter.thread.join(5)
    if engine_thread.is_alive():
        report.hangs += 1
    else:
        planter.heal()
        if planner.recorder is not None:
            planner.recorder.close()
        planner.recorder = start_recorder(trace, report)  # nothing planted now: records
        Engine(planner, report).run(Request("last", list(range(3 * BS + 1))))
        planner.recorder.close()
        # Writes the stats file a last time, waiting for its writer thread: a writer stuck on
        # a planted FIFO would hold close for its whole bound.
        report.timed("close", planner.close)
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    assert capture is not None
    with capture.global_and_fixture_disabled():
        report.print()
    if errors:
        raise errors[0]
    assert report.hangs == 0
    assert report.wrong_payloads == 0
    assert report.max_call_s < MAX_CALL_S, (report.max_call, report.max_call_s)
    assert victim.read_bytes() == b"not kvtier's"
    assert read_snapshot(stats)["cache"]["lookups"] >= report.steps
    assert stat.S_IMODE(stats.stat().st_mode) == 0o600
    assert len(read_trace(trace)) >= 1
    assert report.loaded_blocks > 0 and report.steps > 0
    assert sum(report.faults.values()) >= SOAK_S * 20
    assert report.recorder_refused > 0
