"""``benchmarks/disk_writer.py``: the process that writes files beside the GPU benchmark's engine.
Its pacing and its bound on a fake clock, then the real process: what it writes, its summary,
its stop (asked for, after a failed run, or its parent gone) and what it leaves behind."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType

import pytest
from support.scripts import REPO, benchmark_modules

WRITER = REPO / "benchmarks" / "disk_writer.py"
MIB = 1 << 20
WAIT_S = 60.0
"""How long a test waits for something the writer is sure to do: a bound, never a measurement."""


@pytest.fixture(scope="module")
def dw() -> Iterator[ModuleType]:
    with benchmark_modules("disk_writer") as (module,):
        yield module


def held_bytes(directory: Path) -> int:
    """Bytes of the files in ``directory`` now (a file renamed away meanwhile counts as 0)."""
    total = 0
    for path in directory.iterdir():
        try:
            total += path.stat().st_size
        except FileNotFoundError:
            continue
    return total


def wait_for(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {WAIT_S:g} s for {what}")
        time.sleep(0.01)


@dataclass(slots=True)
class FakeTime:
    """A clock that moves only when the writer sleeps."""

    now: float = 0.0
    sleeps: list[float] = field(default_factory=list)

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_the_writer_paces_whole_blocks_over_a_bounded_set_of_names(
    dw: ModuleType, tmp_path: Path
) -> None:
    plan = dw.Plan.of(tmp_path, 10.0, 1, 4, threads=1)  # 1 MiB at 10 MB/s: a block per 0.105 s
    assert plan.names == 3  # three final names and the temp file: 4 MiB
    fake = FakeTime()
    first: list[int] = []

    def stopped() -> bool:
        assert held_bytes(tmp_path) <= 4 * MIB
        return fake.now >= 1.0

    clock = dw.Clock(stopped, fake.clock, fake.sleep)
    tally = dw.pace(plan, clock, lambda: first.append(held_bytes(tmp_path)))
    assert first == [MIB]  # told once, with its first block written
    # Due at 0, 0.105, ..., 0.944 s: ten blocks in the first second, in sleeps of POLL_S at most.
    assert (tally.files, tally.bytes, tally.error) == (10, 10 * MIB, None)
    assert max(fake.sleeps) <= dw.POLL_S
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w0-0.kvb", "w0-1.kvb", "w0-2.kvb"]
    dw.remove_files(plan)
    assert not any(tmp_path.iterdir())
    summary = dw.summary_of(tally, 2.0)
    assert summary == {"bytes": 10 * MIB, "files": 10, "seconds": 2.0, "mbps": 5.2}


def test_a_stalled_writer_catches_up_a_little_not_in_a_burst(
    dw: ModuleType, tmp_path: Path
) -> None:
    plan = dw.Plan.of(tmp_path, 1000.0, 1, 4, threads=1)  # a block due every 1.05 ms
    times = itertools.chain([0.0], itertools.repeat(5.0))  # the first block took 5 s
    checks = itertools.count()
    clock = dw.Clock(lambda: next(checks) >= 300, lambda: next(times), lambda _s: None)
    tally = dw.pace(plan, clock)
    # Two blocks, then CATCH_UP_S of the schedule (96 blocks), not the 4,768 due in 5 s; the
    # remaining checks find nothing due.
    assert tally.files == 2 + 96


@pytest.mark.parametrize(
    ("mbps", "block", "keep", "threads"),
    [(0.0, 2, 8, 1), (10.0, 2, 3, 1), (10.0, 0, 8, 1), (10.0, 2, 12, 4), (10.0, 2, 8, 0)],
)
def test_a_plan_needs_a_rate_and_room_for_two_blocks_a_thread(
    dw: ModuleType, tmp_path: Path, mbps: float, block: int, keep: int, threads: int
) -> None:
    with pytest.raises(ValueError, match="room for two blocks a thread"):
        dw.Plan.of(tmp_path, mbps, block, keep, threads=threads)
    assert dw.Plan.of(tmp_path, 10.0, 2, 16, threads=4).names == 1


def test_blocks_from_a_source_buffer_in_turn_each_once_before_any_again(
    dw: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = dw.Plan.of(tmp_path, 10.0, 1, 8, threads=2, source_mib=5, checksum=True)
    assert (plan.source_bytes, plan.checksum) == (5 * MIB, True)
    numbered = memoryview(b"".join(bytes([i]) * MIB for i in range(5)))  # MiB i holds byte i
    picked = [plan.block_of(numbered, thread, turn) for turn in range(3) for thread in range(2)]
    assert [block[0] for block in picked] == [0, 1, 2, 3, 4, 0]
    assert {len(block) for block in picked} == {MIB}
    source = dw.source_buffer(plan.source_bytes)
    assert len(source) == 5 * MIB and len(set(source[:4096].tobytes())) > 200  # random bytes
    hashed: list[bytes] = []
    real = dw.xxhash.xxh3_128_digest

    def spy(data: memoryview) -> bytes:
        hashed.append(data.tobytes())
        return real(data)

    monkeypatch.setattr(dw.xxhash, "xxh3_128_digest", spy)
    tally = dw.Tally()
    dw.write_next(plan, numbered, 1, tally)  # thread 1's first turn: the second MiB
    assert hashed == [bytes([1]) * MIB] and tally.files == 1
    assert (tmp_path / "w1-0.kvb").read_bytes() == bytes([1]) * MIB
    with pytest.raises(ValueError, match="--source-mib 1: at least a block"):
        dw.Plan.of(tmp_path, 10.0, 2, 16, threads=1, source_mib=1)
    plain = dw.Plan.of(tmp_path, 10.0, 1, 8, threads=2)
    assert (plain.source_bytes, plain.checksum) == (0, False)


def writer_command(directory: Path, *extra: str) -> list[str]:
    """200 MB/s in 1 MiB blocks from two threads, each with two names and a temp file: 6 MiB."""
    command = [sys.executable, str(WRITER), str(directory), "--mbps", "200", "--block-mib", "1"]
    return [*command, "--keep-mib", "6", "--threads", "2", *extra]


def start_writer(directory: Path, *extra: str) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(writer_command(directory, *extra), stdout=subprocess.PIPE)
    assert process.stdout is not None
    assert json.loads(process.stdout.readline()) == {"ready": process.pid}
    return process


def test_the_writer_process_stays_in_its_bound_stops_on_terminate_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    directory, summary_file = tmp_path / "beside", tmp_path / "summary.json"
    process = start_writer(directory, "--summary", str(summary_file))
    try:
        seen: set[str] = set()

        def cycled() -> bool:
            assert held_bytes(directory) <= 6 * MIB
            seen.update(p.name for p in directory.iterdir() if p.suffix == ".kvb")
            return len(seen) == 4

        wait_for(cycled, "both threads to use both their names")
        assert seen == {"w0-0.kvb", "w0-1.kvb", "w1-0.kvb", "w1-1.kvb"}
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=WAIT_S)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 0
    line = out.decode().strip().splitlines()[-1]
    summary = json.loads(line)
    assert summary["bytes"] >= 4 * MIB and summary["bytes"] == summary["files"] * MIB
    assert summary["seconds"] > 0 and summary["mbps"] > 0
    assert summary_file.read_text() == line + "\n"
    assert directory.is_dir() and not any(directory.iterdir())


ORPHANING = """
import os, subprocess, sys, time
writer = subprocess.Popen([*sys.argv[1:], "--parent", str(os.getpid())], stdout=subprocess.PIPE)
writer.stdout.readline()
print(writer.pid, flush=True)
time.sleep(600)
"""
"""A parent that starts the writer (naming itself, as ``BesideWriter`` does), waits until it is
ready, says its id and waits to be killed."""


def gone(pid: int) -> bool:
    """Whether ``pid`` has exited (reaped, or a zombie its new parent has not reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_an_orphaned_writer_stops_and_cleans_up(tmp_path: Path) -> None:
    """A benchmark killed outright sends its writer no signal: the writer sees its parent gone."""
    directory, summary_file = tmp_path / "beside", tmp_path / "summary.json"
    command = writer_command(directory, "--summary", str(summary_file))
    parent = subprocess.Popen([sys.executable, "-c", ORPHANING, *command], stdout=subprocess.PIPE)
    assert parent.stdout is not None
    writer = int(parent.stdout.readline())
    try:
        wait_for(lambda: any(directory.iterdir()), "the first block")
        parent.kill()
        parent.wait()
        wait_for(summary_file.exists, "the orphan's summary")
        wait_for(lambda: gone(writer), "the orphan to exit")
    finally:
        parent.kill()
        parent.wait()
        if not gone(writer):
            os.kill(writer, signal.SIGKILL)
    assert json.loads(summary_file.read_text())["bytes"] > 0
    assert not any(directory.iterdir())


def test_a_failing_run_still_stops_the_writer_and_removes_its_directory(
    dw: ModuleType, tmp_path: Path
) -> None:
    directory = tmp_path / "beside"
    writer = dw.BesideWriter(directory, 100.0, block_mib=1, keep_mib=8)  # four threads
    processes = []
    with pytest.raises(RuntimeError, match="engine failed"), writer:
        processes.append(writer._process)
        wait_for(lambda: any(directory.iterdir()), "the first block")
        raise RuntimeError("engine failed")
    assert processes[0].poll() == 0  # stopped, its summary given
    assert not directory.exists()
    row = writer.row()
    assert row["mbps_asked"] == 100.0 and row["bytes"] > 0 and row["seconds"] > 0
    assert set(row) == {"mbps_asked", "bytes", "seconds", "mbps"}


def test_a_writer_reading_a_large_source_and_hashing_says_so_in_the_row(
    dw: ModuleType, tmp_path: Path
) -> None:
    directory = tmp_path / "beside"
    writer = dw.BesideWriter(directory, 100.0, source_mib=6, checksum=True, block_mib=1, keep_mib=8)
    command = writer.command()
    at = command.index("--source-mib")
    assert command[at + 1] == "6" and "--checksum" in command and "--fsync" not in command
    with writer:
        wait_for(lambda: held_bytes(directory) >= 4 * MIB, "four blocks")
    row = writer.row()
    assert row["bytes"] >= 4 * MIB and "error" not in row
    assert (row["source_mib"], row["checksum"]) == (6, True) and "fsync" not in row
    assert not directory.exists()


def test_a_writer_that_cannot_write_says_why_in_the_row(dw: ModuleType, tmp_path: Path) -> None:
    directory = tmp_path / "beside"
    (directory / "w1.tmp").mkdir(parents=True)  # where its second thread's temp files go
    with dw.BesideWriter(directory, 100.0, block_mib=1, keep_mib=8) as writer:
        # One thread's error stops them all: the writer ends on its own, its summary given.
        assert writer._process.wait(timeout=WAIT_S) == 1
    assert not directory.exists()
    row = writer.row()
    assert row["bytes"] >= MIB and row["error"].startswith("FileExistsError:")


def test_a_writer_that_cannot_start_fails_the_run_and_leaves_nothing(
    dw: ModuleType, tmp_path: Path
) -> None:
    directory = tmp_path / "beside"
    writer = dw.BesideWriter(directory, 100.0, fsync=True, block_mib=2, keep_mib=2)
    with pytest.raises(RuntimeError, match="did not start: the writer exited with 2"), writer:
        pytest.fail("the block ran without a writer")
    assert writer._process is None and not directory.exists()
    assert writer.row() == {
        "mbps_asked": 100.0,
        "error": "the writer exited with 2, no summary",
        "fsync": True,
    }
