"""The fs tier with I/O that does not return (a hung NFS server): stuck threads are bounded and
observable, other work fails fast instead of queueing behind them, close() returns in time.

The hang is injected where the tier's threads move block bytes (``fs_files.read_exact`` and
``write_all``), as a wait on an event the test releases at the end: Python cannot interrupt a real
stuck read."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from support.blocks import fill, make_keys
from support.drivers import Driver

from kvtier.tiers.base import TierJobKind
from kvtier.tiers.fs import files as fs_files
from tiers.fs.helpers import MakeTier

TIMEOUT_S = 0.3


@pytest.fixture
def hang(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """While the event is clear, every block read hangs; set at the end so threads come back."""
    release = threading.Event()
    real = fs_files.read_exact

    def stuck_read(fd: int, buffers: list[memoryview]) -> bool:
        release.wait(60)
        return real(fd, buffers)

    monkeypatch.setattr(fs_files, "read_exact", stuck_read)
    yield release
    release.set()


def _stored(make_fs: MakeTier, n: int, **options: object) -> tuple[Driver, list[bytes]]:
    tier = make_fs(threads=2, io_timeout_s=TIMEOUT_S, **options)
    drive = Driver(tier)
    keys = make_keys(n)
    for key in keys:
        assert drive.store(key)
    return drive, keys


def _reported_within(drive: Driver, jobs: list[int], seconds: float) -> set[int]:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not all(j in drive.results for j in jobs):
        drive.collect()
        time.sleep(0.005)
    return {j for j in jobs if j in drive.results}


def test_work_behind_stuck_threads_fails_fast(make_fs: MakeTier, hang: threading.Event) -> None:
    drive, keys = _stored(make_fs, 20)
    tier = drive.tier
    stuck_jobs = [drive.submit(TierJobKind.READ, [keys[i]], [i]) for i in range(2)]
    queued = [drive.submit(TierJobKind.READ, [keys[i]], [i]) for i in range(2, 12)]
    time.sleep(TIMEOUT_S * 1.5)
    assert tier.stuck_threads == 2
    # New work is refused at once (not queued behind the stuck threads)...
    for i in range(12, 16):
        fill(tier.pool, 40 + i, make_keys(1, f"new{i}")[0])
    started = time.monotonic()
    fresh = [
        drive.submit(TierJobKind.WRITE, make_keys(1, f"new{i}"), [40 + i]) for i in range(12, 16)
    ]
    assert _reported_within(drive, fresh, 0.2) == set(fresh)
    assert time.monotonic() - started < 0.2
    # ...and what queued before the threads were known stuck fails once it waited too long.
    assert _reported_within(drive, queued, TIMEOUT_S * 3) == set(queued)
    assert all(drive.results[j].ok == [False] for j in fresh + queued)
    # Only the blocks the stuck threads are in the middle of stay unreported (their slots may
    # still be written): at most one per thread.
    assert _reported_within(drive, stuck_jobs, 0.05) == set()
    assert tier.counters.errors == len(fresh) + len(queued)
    hang.set()
    assert _reported_within(drive, stuck_jobs, 5) == set(stuck_jobs)
    assert all(drive.results[j].ok == [True] for j in stuck_jobs)
    # Threads are back: the tier works again.
    assert tier.stuck_threads == 0
    assert drive.load_exact(keys[19], slot=30)


def test_one_stuck_thread_leaves_the_others_working(
    make_fs: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    drive, keys = _stored(make_fs, 4)
    release = threading.Event()
    real = fs_files.read_exact
    victim = threading.Event()

    def first_read_hangs(fd: int, buffers: list[memoryview]) -> bool:
        if not victim.is_set():
            victim.set()
            release.wait(60)
        return real(fd, buffers)

    monkeypatch.setattr(fs_files, "read_exact", first_read_hangs)
    try:
        stuck = drive.submit(TierJobKind.READ, [keys[0]], [10])
        assert victim.wait(5)
        time.sleep(TIMEOUT_S * 1.5)
        assert drive.tier.stuck_threads == 1
        for i in range(1, 4):
            assert drive.load_exact(keys[i], slot=20 + i)
        assert stuck not in drive.results
    finally:
        release.set()
    assert drive.wait(stuck) == [True]


def test_close_returns_within_its_bound_while_threads_hang(
    make_fs: MakeTier, hang: threading.Event
) -> None:
    drive, keys = _stored(make_fs, 6)
    tier = drive.tier
    stuck = [drive.submit(TierJobKind.READ, [keys[i]], [i]) for i in range(2)]
    queued = [drive.submit(TierJobKind.READ, [keys[i]], [i]) for i in range(2, 6)]
    closer = threading.Thread(target=tier.close, daemon=True)
    started = time.monotonic()
    closer.start()
    closer.join(TIMEOUT_S + 2.0)
    took = time.monotonic() - started
    try:
        assert not closer.is_alive(), "close() did not return while threads were stuck"
        assert took < TIMEOUT_S + 1.0
        # Queued work is reported (failed); blocks on stuck threads are abandoned, unreported.
        assert _reported_within(drive, queued, 0.5) == set(queued)
        assert all(drive.results[j].ok == [False] for j in queued)
        assert _reported_within(drive, stuck, 0.05) == set()
        # After close, new jobs fail at once.
        later = drive.submit(TierJobKind.READ, [keys[0]], [30])
        assert _reported_within(drive, [later], 0.2) == {later}
    finally:
        hang.set()
        closer.join(5)


def test_rescan_is_refused_while_every_thread_is_stuck(
    make_fs: MakeTier, hang: threading.Event
) -> None:
    drive, keys = _stored(make_fs, 2)
    for i in range(2):
        drive.submit(TierJobKind.READ, [keys[i]], [i])
    time.sleep(TIMEOUT_S * 1.5)
    assert drive.tier.rescan().result(timeout=0.2) == 0
