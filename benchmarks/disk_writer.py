"""Write files beside a benchmark's engine, from a process of their own.

kvtier's fs tier writes from I/O threads inside the engine's process; this script writes the same
way (a block-sized temp file, then ``os.replace`` to its final name; no fsync, kvtier's default)
at a paced rate from a separate OS process. Beside an engine without an fs tier
(``vllm_gpu_bench.py --configs kvtier,kvtier+beside.write_mbps=1000``) it loads the host as
those writes do (copies into the page cache, memory bandwidth, caches) without sharing the
engine's GIL; whatever then slows the engine is the writes' effect on the host.

Until stopped (SIGTERM or SIGINT, or its parent gone: ``--parent``, the process that started it,
is its parent no more), it writes ``--block-mib`` files into DIR at about ``--mbps`` MB/s (10**6
bytes; whole blocks, paced with sleeps) from ``--threads`` threads (4, as kvtier's fs tier has)
on one schedule, reusing a bounded set of names so that DIR never holds more than ``--keep-mib``
of them (each thread's temp file included). Then it removes its files and prints a one-line JSON
summary: bytes written, seconds, achieved MB/s (``--summary FILE`` gets it too).
Its first line, once its signal handlers are set and its first block is written (or failed), is
``{"ready": PID}``: a run started after it runs beside a writer already writing (however short
the run), and a stop sent after it always gets a summary.

By default every block is the same bytes (a buffer that stays in the CPU's caches); kvtier's
fs tier writes each block from its own pool slot and hashes it first. ``--source-mib N`` takes
the blocks in turn from an N MiB buffer (larger than the caches, as the pool is) and
``--checksum`` hashes each (xxh3-128, the fs tier's) before writing it: the host then reads as
much memory as the fs tier makes it read.

With ``--fsync`` each file is synced before its rename (kvtier's ``fsync`` option). Without it a
file is replaced within ``--keep-mib`` / ``--mbps`` seconds (about 1 s at 1 GiB and 1000 MB/s),
before the kernel writes dirty pages back (30 s by default), so the disk may see little of it;
kvtier's fs tier keeps its files, and the kernel writes them back.

Usage: python3 benchmarks/disk_writer.py DIR --mbps N [--block-mib 2] [--keep-mib 1024]
[--threads 4] [--source-mib N] [--checksum] [--fsync] [--summary FILE] [--parent PID]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import xxhash

from kvtier.tiers.fs.files import write_all

BLOCK_MIB = 2
THREADS = 4
"""Writing threads (in this process): kvtier's fs tier's ``threads`` default. Asked for 1000 MB/s
over 1 GiB of names on a 2-vCPU VM, one thread wrote 250-520 MB/s, four 920 MB/s."""
KEEP_MIB = 1024
"""The default bound on DIR. The GPU benchmark's disk guard stops a run when the free space falls
below half the fs tiers' reserve (``vllm_grid.disk_floor_bytes``: at least 4 GiB), and kvtier's
fs tier stops at the reserve, so 1 GiB beside a full tier stays clear of the floor."""
POLL_S = 0.05
"""The longest sleep between checks for a stop."""
CATCH_UP_S = 0.1
"""After a stall, at most this much of the schedule is caught up at full speed."""
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class Plan:
    """What to write: where, how fast, in what blocks, over how many names, from how many
    threads."""

    directory: Path
    mbps: float
    block_bytes: int
    names: int
    """Final names per thread, reused in turn; each thread also has its temp file."""
    threads: int = 1
    fsync: bool = False
    source_bytes: int = 0
    """The blocks come in turn from a buffer this large (0: one block's, written again and
    again)."""
    checksum: bool = False
    """Each block hashed before it is written, as kvtier's fs tier does."""

    @classmethod
    def of(
        cls,
        directory: Path,
        mbps: float,
        block_mib: int,
        keep_mib: int,
        *,
        threads: int = THREADS,
        fsync: bool = False,
        source_mib: int = 0,
        checksum: bool = False,
    ) -> Plan:
        """ValueError when the rate is not above 0, ``keep_mib`` holds less than two blocks
        a thread (a final name and a temp file), or a source buffer is smaller than a block."""
        if not mbps > 0 or block_mib < 1 or threads < 1 or keep_mib < 2 * block_mib * threads:
            raise ValueError(
                f"--mbps {mbps} --block-mib {block_mib} --keep-mib {keep_mib} --threads "
                f"{threads}: need a rate above 0 and room for two blocks a thread"
            )
        if source_mib and source_mib < block_mib:
            raise ValueError(f"--source-mib {source_mib}: at least a block (--block-mib)")
        names = (keep_mib // block_mib - threads) // threads
        source = (source_mib // block_mib) * (block_mib << 20)
        return cls(directory, mbps, block_mib << 20, names, threads, fsync, source, checksum)

    def block_of(self, source: memoryview, thread: int, turn: int) -> memoryview:
        """The thread's block for this turn: the threads' turns go through the source buffer
        in order, each block once before any again."""
        blocks = len(source) // self.block_bytes
        at = (turn * self.threads + thread) % blocks * self.block_bytes
        return source[at : at + self.block_bytes]

    def final(self, thread: int, turn: int) -> Path:
        return self.directory / f"w{thread}-{turn % self.names}.kvb"

    def temp(self, thread: int) -> Path:
        return self.directory / f"w{thread}.tmp"


@dataclass(slots=True)
class Tally:
    files: int = 0
    bytes: int = 0
    error: str | None = None


@dataclass(slots=True)
class Schedule:
    """When the next block is due, shared by the threads: whichever is free writes it, as
    kvtier's I/O threads take the next task."""

    interval: float
    due: float
    lock: threading.Lock = field(default_factory=threading.Lock)

    def take(self, now: float) -> float:
        """The next block's due time, the one after it set. A writer slower than the rate
        writes back to back; a stall is not made up in a burst, at most ``CATCH_UP_S`` of it."""
        with self.lock:
            due = self.due
            self.due = max(due + self.interval, now - CATCH_UP_S)
            return due


def write_block(plan: Plan, data: memoryview, thread: int, turn: int) -> None:
    """As kvtier's fs tier writes a block: a new temp file, then renamed over the final name."""
    temp = plan.temp(thread)
    fd = os.open(temp, _CREATE, 0o600)
    try:
        write_all(fd, [data])  # kvtier's own (writev until written)
        if plan.fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temp, plan.final(thread, turn))


def write_next(plan: Plan, source: memoryview, thread: int, tally: Tally) -> None:
    """The thread's next block, counted; an OSError (a full disk) is kept as its error."""
    data = plan.block_of(source, thread, tally.files)
    if plan.checksum:
        xxhash.xxh3_128_digest(data)
    try:
        write_block(plan, data, thread, tally.files)
    except OSError as exc:
        tally.error = f"{type(exc).__name__}: {exc}"
        return
    tally.files += 1
    tally.bytes += plan.block_bytes


@dataclass(frozen=True, slots=True)
class Clock:
    """Time as the threads see it (a fake one in tests) and the stop they watch."""

    stopped: Callable[[], bool]
    now: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep

    def wait(self, until: float) -> bool:
        """Sleep until ``until``, in steps of ``POLL_S`` at most; False when stopped first."""
        while not self.stopped():
            now = self.now()
            if now >= until:
                return True
            self.sleep(min(until - now, POLL_S))
        return False


@dataclass(frozen=True, slots=True)
class Shared:
    """What the writing threads share: the bytes their blocks come from, the schedule, the
    clock, and a flag that the first error sets (a full disk would fail the others too: all
    stop)."""

    source: memoryview
    schedule: Schedule
    clock: Clock
    failed: threading.Event = field(default_factory=threading.Event)


def keep_writing(plan: Plan, thread: int, tally: Tally, shared: Shared) -> None:
    """One thread's blocks, each when the schedule says, until stopped or an error."""
    clock = shared.clock
    while not shared.failed.is_set() and clock.wait(shared.schedule.take(clock.now())):
        write_next(plan, shared.source, thread, tally)
        if tally.error is not None:
            shared.failed.set()


def source_buffer(size: int) -> memoryview:
    """``size`` bytes of random data, every page written (resident, as a pool's slots are): one
    random MiB repeated, which no filesystem here compresses or deduplicates by block."""
    data = bytearray(size)
    pattern = os.urandom(min(size, 1 << 20))
    for at in range(0, size, len(pattern)):
        data[at : at + len(pattern)] = pattern[: size - at]
    return memoryview(data)


def pace(plan: Plan, clock: Clock, on_first: Callable[[], None] = lambda: None) -> Tally:
    """Write a block, call ``on_first``, then write blocks from ``plan.threads`` threads on one
    schedule of ``plan.mbps`` until stopped or an OSError, kept in the tally."""
    interval = plan.block_bytes / (plan.mbps * 1e6)
    schedule = Schedule(interval, clock.now() + interval)  # the first block is written now
    shared = Shared(source_buffer(max(plan.source_bytes, plan.block_bytes)), schedule, clock)
    tallies = [Tally() for _ in range(plan.threads)]
    write_next(plan, shared.source, 0, tallies[0])
    on_first()
    if tallies[0].error is not None:
        return tallies[0]
    workers = [
        threading.Thread(target=keep_writing, args=(plan, t, tallies[t], shared))
        for t in range(plan.threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    error = next((t.error for t in tallies if t.error is not None), None)
    return Tally(sum(t.files for t in tallies), sum(t.bytes for t in tallies), error)


def remove_files(plan: Plan) -> None:
    """This writer's names only: DIR may hold something else. One that cannot go is left to the
    caller (``BesideWriter`` removes DIR): the summary still comes."""
    for thread in range(plan.threads):
        paths = [plan.temp(thread), *(plan.final(thread, n) for n in range(plan.names))]
        for path in paths:
            with contextlib.suppress(OSError):
                path.unlink()


def summary_of(tally: Tally, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {
        "bytes": tally.bytes,
        "files": tally.files,
        "seconds": round(seconds, 3),
        "mbps": round(tally.bytes / seconds / 1e6, 1) if seconds > 0 else 0.0,
    }
    if tally.error is not None:
        out["error"] = tally.error
    return out


@dataclass(slots=True)
class StopFlag:
    """Set by SIGTERM or SIGINT: the handler only sets it, and the loop stops between blocks
    (an exception raised in a handler could land between a temp file and its rename)."""

    requested: bool = False

    def install(self) -> StopFlag:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, _sig: int, _frame: Any) -> None:
        self.requested = True


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("directory", type=Path)
    p.add_argument("--mbps", type=float, required=True, help="MB/s (10**6 bytes) to write")
    p.add_argument("--block-mib", type=int, default=BLOCK_MIB)
    p.add_argument("--keep-mib", type=int, default=KEEP_MIB, help="most MiB in DIR at once")
    p.add_argument("--threads", type=int, default=THREADS, help="writing threads")
    p.add_argument("--fsync", action="store_true", help="sync each file before its rename")
    p.add_argument(
        "--source-mib", type=int, default=0, help="blocks in turn from a buffer this large"
    )
    p.add_argument("--checksum", action="store_true", help="hash each block before writing it")
    p.add_argument("--summary", type=Path, default=None, help="also write the summary here")
    p.add_argument(
        "--parent", type=int, default=None, help="stop once it is not our parent (default: ours)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        plan = Plan.of(
            args.directory,
            args.mbps,
            args.block_mib,
            args.keep_mib,
            threads=args.threads,
            fsync=args.fsync,
            source_mib=args.source_mib,
            checksum=args.checksum,
        )
    except ValueError as exc:
        p.error(str(exc))
    flag = StopFlag().install()
    # Named by the parent that started it, a parent gone before this line is seen too.
    parent = args.parent or os.getppid()
    plan.directory.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        # A parent killed outright sends no signal: an orphan must not write on.
        clock = Clock(lambda: flag.requested or os.getppid() != parent)
        tally = pace(plan, clock, on_first=lambda: say(json.dumps({"ready": os.getpid()})))
    finally:
        remove_files(plan)
    line = json.dumps(summary_of(tally, time.monotonic() - started))
    if args.summary is not None:
        args.summary.write_text(line + "\n")
    say(line)
    return 0 if tally.error is None else 1


def say(line: str) -> None:
    """Print ``line``; an orphan's stdout may be a pipe nobody reads any more."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        # Python's own flush at exit would fail again, and print a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


# -- the benchmark's side -----------------------------------------------------------------------


def read_line(stream: IO[bytes], timeout_s: float) -> bytes:
    """A line from ``stream`` (a pipe), or b"" when none came within ``timeout_s``."""
    readable, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline() if readable else b""


def last_json(text: bytes) -> dict[str, Any] | None:
    lines = text.decode(errors="replace").strip().splitlines()
    with contextlib.suppress(ValueError, IndexError):
        data = json.loads(lines[-1])
        return data if isinstance(data, dict) else None
    return None


@dataclass(slots=True)
class BesideWriter:
    """This script in a process of its own for the span of a ``with`` block: started (and
    ready) on entry, stopped on exit however the block ends, ``directory`` then removed.
    ``summary`` holds the writer's summary, or an ``error`` where it gave none."""

    directory: Path
    mbps: float
    fsync: bool = False
    source_mib: int = 0
    checksum: bool = False
    block_mib: int = BLOCK_MIB
    keep_mib: int = KEEP_MIB
    threads: int = THREADS
    ready_s: float = 30.0
    stop_s: float = 30.0
    summary: dict[str, Any] = field(default_factory=dict)
    _process: subprocess.Popen[bytes] | None = field(default=None, init=False, repr=False)

    def command(self) -> list[str]:
        return [
            sys.executable, str(Path(__file__).resolve()), str(self.directory),
            "--mbps", repr(self.mbps), "--block-mib", str(self.block_mib),
            "--keep-mib", str(self.keep_mib), "--threads", str(self.threads),
            "--parent", str(os.getpid()), "--source-mib", str(self.source_mib),
            *(["--fsync"] if self.fsync else []), *(["--checksum"] if self.checksum else []),
        ]  # fmt: skip

    def start(self) -> None:
        """Start the writer and wait for its ready line; RuntimeError (writer stopped) without
        one within ``ready_s``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        process = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        self._process = process
        assert process.stdout is not None
        if not read_line(process.stdout, self.ready_s):
            self.stop()
            raise RuntimeError(f"the disk writer did not start: {self.summary.get('error')}")

    def stop(self) -> dict[str, Any]:
        """Stop the writer (killed after ``stop_s``), keep its summary, remove ``directory``."""
        process, self._process = self._process, None
        if process is not None:
            process.terminate()
            try:
                out, _ = process.communicate(timeout=self.stop_s)
            except subprocess.TimeoutExpired:
                process.kill()
                out, _ = process.communicate()
            found = last_json(out)
            if found is None or "bytes" not in found:
                found = {"error": f"the writer exited with {process.returncode}, no summary"}
            self.summary = found
        shutil.rmtree(self.directory, ignore_errors=True)
        return self.summary

    def row(self) -> dict[str, Any]:
        """The benchmark row's ``beside_write``: the rate asked for and what was written (and
        how, where not the default)."""
        kept = ("bytes", "seconds", "mbps", "error")
        out = {"mbps_asked": self.mbps, **{k: self.summary[k] for k in kept if k in self.summary}}
        how = {"fsync": self.fsync, "source_mib": self.source_mib, "checksum": self.checksum}
        return {**out, **{k: v for k, v in how.items() if v}}

    def __enter__(self) -> BesideWriter:
        self.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


if __name__ == "__main__":
    sys.exit(main())
