from __future__ import annotations

import errno
import os
import random
import shutil
import stat
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import xxhash
from support.blocks import fill, make_key, make_keys, payload_for, poison
from support.drivers import Driver

from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.tiers import tier_class
from kvtier.tiers.base import JobResult, Tier, TierJob, TierJobKind
from kvtier.tiers.fs import files as fs_files
from kvtier.tiers.fs.tier import FsTier, Options
from kvtier.tiers.payload import HEADER_BYTES
from kvtier.validation import Section
from tiers.conftest import NUM_SLOTS, SLOT_BYTES

FILE_BYTES = HEADER_BYTES + SLOT_BYTES
MakeTier = Callable[..., FsTier]


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    return tmp_path / "kv"


@pytest.fixture
def make_tier(store_dir: Path, pool: HostPool, namespace: Namespace) -> Iterator[MakeTier]:
    tiers: list[FsTier] = []

    def make(
        blocks: float = 100,
        path: Path | None = None,
        ns: Namespace | None = None,
        **options: object,
    ) -> FsTier:
        opts = Options(
            path=str(path or store_dir),
            capacity=int(blocks * FILE_BYTES),
            **options,  # type: ignore[arg-type]
        )
        tier = FsTier("disk", ns or namespace, pool, opts)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def block_file(tier: FsTier, key: bytes) -> Path:
    return Path(tier.root) / key.hex()[:2] / f"{key.hex()}.kvb"


def files(tier: FsTier, pattern: str = "*") -> list[Path]:
    return sorted(p for p in Path(tier.root).glob(f"*/{pattern}") if p.is_file())


def disk_bytes(tier: FsTier) -> int:
    """Everything under the namespace directory, temp files included (exact only while no job
    runs: a directory listing is no snapshot, a rename or unlink can be seen half done)."""
    return sum(p.stat().st_size for p in Path(tier.root).rglob("*") if p.is_file())


class DiskMeter:
    """Exact bytes on disk while jobs run: counts every byte before the tier writes it and every
    file the tier removes, and remembers the peak."""

    def __init__(self, tier: FsTier, monkeypatch: pytest.MonkeyPatch) -> None:
        self.lock = threading.Lock()
        self.bytes = self.peak = disk_bytes(tier)
        write_all, unlink = fs_files.write_all, fs_files.unlink

        def counted_write(fd: int, buffers: list[memoryview]) -> None:
            self.add(sum(b.nbytes for b in buffers))
            write_all(fd, buffers)

        def counted_unlink(name: str, dir_fd: int) -> bool:
            with self.lock:
                try:
                    size = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size
                except FileNotFoundError:
                    size = 0
                gone = unlink(name, dir_fd)
                if gone:
                    self.bytes -= size
            return gone

        monkeypatch.setattr(fs_files, "write_all", counted_write)
        monkeypatch.setattr(fs_files, "unlink", counted_unlink)

    def add(self, n: int) -> None:
        with self.lock:
            self.bytes += n
            self.peak = max(self.peak, self.bytes)


# -- basics ---------------------------------------------------------------------------------------


def test_registered_by_kind() -> None:
    assert tier_class("fs") is FsTier


def test_round_trip_into_poisoned_slot(
    make_tier: MakeTier, pool: HostPool, run_job: Callable[[Tier, TierJob], JobResult]
) -> None:
    tier = make_tier()
    keys = make_keys(4)
    for slot, key in enumerate(keys):
        fill(pool, slot, key)
    assert tier.lookup(keys) == [False] * 4
    assert run_job(tier, TierJob(1, TierJobKind.WRITE, keys, [0, 1, 2, 3])).ok == [True] * 4
    assert tier.lookup(keys) == [True] * 4
    targets = [40, 41, 42, 43]
    for slot in targets:
        poison(pool, slot)
    assert run_job(tier, TierJob(2, TierJobKind.READ, keys[::-1], targets)).ok == [True] * 4
    for slot, key in zip(targets, keys[::-1], strict=True):
        assert bytes(pool.view(slot)) == payload_for(key, SLOT_BYTES)
    for key in keys:
        assert block_file(tier, key).stat().st_size == FILE_BYTES
    c = tier.counters
    assert (c.write_jobs, c.write_blocks, c.write_bytes) == (1, 4, 4 * SLOT_BYTES)
    assert (c.read_jobs, c.read_blocks, c.read_bytes) == (1, 4, 4 * SLOT_BYTES)
    assert (c.lookups, c.lookup_hits) == (8, 4)
    assert c.errors == c.corrupt == c.rejected == c.evictions == 0
    assert tier.used_bytes == 4 * FILE_BYTES == disk_bytes(tier)


def test_a_lookup_does_not_wait_for_the_lock_the_io_threads_take(
    make_tier: MakeTier, pool: HostPool, run_job: Callable[[Tier, TierJob], JobResult]
) -> None:
    """Lookups run on the engine's scheduler thread; the I/O threads take the tier's lock for
    every block they move. Before, a lookup (``exists``, ``is_empty`` and the counters) waited
    for that lock, and for the GIL's hand-over after it, inside the engine's step."""
    tier = make_tier()
    keys = make_keys(3)
    for slot, key in enumerate(keys[:2]):
        fill(pool, slot, key)
    assert run_job(tier, TierJob(1, TierJobKind.WRITE, keys[:2], [0, 1])).ok == [True, True]
    answers: list[object] = []

    def look() -> None:
        answers.append((tier.is_empty(), len(tier), tier.lookup(keys)))

    with tier._lock:  # an I/O thread in the middle of a block
        looker = threading.Thread(target=look)
        looker.start()
        looker.join(5)
        done = not looker.is_alive()
    looker.join()
    assert done, "the lookup waited for the tier's lock"
    assert answers == [(False, 2, [True, True, False])]
    assert (tier.counters.lookups, tier.counters.lookup_hits) == (3, 2)


def test_unknown_key_is_a_plain_miss(make_tier: MakeTier) -> None:
    tier = make_tier()
    assert Driver(tier).read([make_key(1)], [0]) == [False]
    assert tier.counters.errors == tier.counters.corrupt == 0


def test_double_write_is_skipped(make_tier: MakeTier) -> None:
    tier = make_tier()
    drive = Driver(tier)
    key = make_key(0)
    assert drive.store(key)
    mtime = block_file(tier, key).stat().st_mtime_ns
    assert drive.store(key)
    assert block_file(tier, key).stat().st_mtime_ns == mtime
    assert tier.counters.write_blocks == 1 and tier.used_bytes == FILE_BYTES


def test_fsync_round_trip(make_tier: MakeTier) -> None:
    tier = make_tier(fsync=True)
    drive = Driver(tier)
    keys = make_keys(3)
    assert all(drive.store(key) for key in keys)
    assert all(drive.load_exact(key) for key in keys)


def test_close_is_idempotent_and_later_jobs_fail(make_tier: MakeTier) -> None:
    tier = make_tier()
    drive = Driver(tier)
    assert drive.store(make_key(0))
    tier.close()
    tier.close()
    assert drive.write([make_key(1)], [0]) == [False]
    assert drive.read([make_key(0)], [1]) == [False]
    assert tier.rescan().result(timeout=1) == 0


def test_close_waits_for_running_jobs(make_tier: MakeTier, pool: HostPool) -> None:
    tier = make_tier()
    drive = Driver(tier)
    keys = make_keys(20)
    slots = list(range(20))
    for slot, key in zip(slots, keys, strict=True):
        fill(pool, slot, key)
    job = drive.submit(TierJobKind.WRITE, keys, slots)
    tier.close()
    drive.collect()
    assert drive.results.pop(job).ok == [True] * 20
    assert len(files(tier, "*.kvb")) == 20


def test_bad_jobs_fail_without_raising(make_tier: MakeTier) -> None:
    tier = make_tier()
    drive = Driver(tier)
    assert drive.write([b"short"], [0]) == [False]
    assert drive.write([make_key(0)], [NUM_SLOTS]) == [False]
    assert drive.read([make_key(0)], [-1]) == [False]
    assert drive.write([make_key(0), make_key(1)], [0]) == [False, False]
    assert drive.write([], []) == []
    assert tier.counters.errors == 5
    assert files(tier) == []
    assert drive.store(make_key(0))


# -- restart and recovery -------------------------------------------------------------------------


def test_restart_finds_every_block(make_tier: MakeTier) -> None:
    first = make_tier()
    keys = make_keys(30)
    drive = Driver(first)
    assert all(drive.store(key, slot=i % 8) for i, key in enumerate(keys))
    first.close()

    second = make_tier()
    assert second.lookup(keys) == [True] * 30
    assert second.used_bytes == 30 * FILE_BYTES
    drive = Driver(second)
    assert all(drive.load_exact(key, slot=20) for key in keys)
    assert second.counters.corrupt == 0


def test_block_files_keep_their_format(
    make_tier: MakeTier, store_dir: Path, namespace: Namespace
) -> None:
    """The on-disk format, spelled out here rather than taken from kvtier: a file laid out by
    hand is read, and a file the tier writes is byte for byte that layout, so stores written by
    earlier versions stay readable."""
    old, new = make_keys(2)

    def laid_out(key: bytes) -> bytes:
        payload = payload_for(key, SLOT_BYTES)
        digest = xxhash.xxh3_128_digest(payload)
        head = struct.pack(
            "<4sHH16s16sQ16s", b"KVTB", 1, 0, namespace.digest, key, SLOT_BYTES, digest
        )
        return head + payload

    shard = store_dir / namespace.hex / old.hex()[:2]
    shard.mkdir(parents=True)
    (shard / f"{old.hex()}.kvb").write_bytes(laid_out(old))
    tier = make_tier()
    drive = Driver(tier)
    assert drive.load_exact(old)
    assert drive.store(new)
    assert block_file(tier, new).read_bytes() == laid_out(new)
    assert stat.S_IMODE(block_file(tier, new).stat().st_mode) == 0o600


def test_restart_over_capacity_keeps_the_newest(make_tier: MakeTier) -> None:
    first = make_tier()
    keys = make_keys(6)
    drive = Driver(first)
    for i, key in enumerate(keys):
        assert drive.store(key)
        # Distinct mtimes: the restart order follows them, whatever the filesystem's resolution.
        os.utime(block_file(first, key), (1_000_000 + i, 1_000_000 + i))
    first.close()

    second = make_tier(blocks=2.5)
    assert second.lookup(keys) == [False] * 4 + [True] * 2
    assert second.used_bytes == 2 * FILE_BYTES <= second.capacity
    # The older files are left alone, uncounted: they may be another running process's
    # (tests/tiers/fs/test_fs_shared.py). Nothing it never indexed is reported evicted.
    assert disk_bytes(second) == 6 * FILE_BYTES and second.take_evicted() == []
    assert Driver(second).load_exact(keys[5])
    assert Driver(second).store(make_key(99))  # room from its own counted files
    assert second.lookup(keys[4:]) == [False, True]
    assert not block_file(second, keys[4]).exists() and block_file(second, keys[0]).exists()


def test_temp_files_cleaned_at_start(make_tier: MakeTier) -> None:
    tier = make_tier()
    key = make_key(0)
    assert Driver(tier).store(key)
    tier.close()
    shard = block_file(tier, key).parent
    host = fs_files.host_tag()
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale_own = shard / f"{key.hex()}.{host}.{dead.pid}.0.tmp"
    stale_old = shard / "whatever-a-crash-left.tmp"
    live_own = shard / f"{key.hex()}.{host}.{os.getppid()}.0.tmp"
    live_peer = shard / f"{key.hex()}.0badc0de.12345.7.tmp"
    for path in (stale_own, stale_old, live_own, live_peer):
        path.write_bytes(b"partial")
    old = time.time() - fs_files.STALE_TMP_S - 60
    os.utime(stale_old, (old, old))

    again = make_tier()
    assert not stale_own.exists()
    assert not stale_old.exists()
    # A running writer's temp file (this host, live pid; or another host, recent) must survive.
    assert live_own.exists() and live_peer.exists()
    assert again.lookup([key]) == [True]


def test_foreign_files_are_ignored(make_tier: MakeTier) -> None:
    tier = make_tier()
    key = make_key(0)
    assert Driver(tier).store(key)
    tier.close()
    shard = block_file(tier, key).parent
    junk = [
        shard / "README",
        shard / "nothex0000000000000000000000000000.kvb",
        shard / "00.kvb",
        Path(tier.root) / "zz" / f"{'ab' * 16}.kvb",  # not a two-hex shard of its own name
        Path(tier.root) / "notes.txt",
    ]
    for path in junk:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x")
    again = make_tier()
    assert len(again) == 1 and again.used_bytes == FILE_BYTES
    assert all(path.exists() for path in junk)


# -- corruption -----------------------------------------------------------------------------------

REGIONS = {
    "magic": 0,
    "version": 4,
    "flags": 6,
    "namespace": 8,
    "key": 24,
    "length": 40,
    "checksum": 48,
    "checksum_end": 63,
    "payload_start": HEADER_BYTES,
    "payload_middle": HEADER_BYTES + SLOT_BYTES // 2,
    "payload_end": FILE_BYTES - 1,
}


@pytest.mark.parametrize("offset", REGIONS.values(), ids=REGIONS.keys())
@pytest.mark.parametrize("bit", [0x01, 0x80])
def test_flipped_byte_is_never_returned(make_tier: MakeTier, offset: int, bit: int) -> None:
    tier = make_tier()
    drive = Driver(tier)
    key = make_key(0)
    assert drive.store(key)
    path = block_file(tier, key)
    data = bytearray(path.read_bytes())
    data[offset] ^= bit
    path.write_bytes(bytes(data))

    assert drive.load_exact(key) is False
    assert tier.counters.corrupt == 1
    assert not path.exists()
    assert tier.lookup([key]) == [False]
    assert tier.take_evicted() == [key]
    assert tier.used_bytes == 0
    # The tier keeps working, and the key can be stored again.
    assert drive.store(key) and drive.load_exact(key)


@pytest.mark.parametrize(
    "size", [0, 10, HEADER_BYTES, HEADER_BYTES + 100, FILE_BYTES - 1, FILE_BYTES + 1]
)
def test_truncated_or_grown_file_is_corrupt(make_tier: MakeTier, size: int) -> None:
    tier = make_tier()
    drive = Driver(tier)
    key = make_key(0)
    assert drive.store(key)
    path = block_file(tier, key)
    with path.open("r+b") as f:
        if size > FILE_BYTES:
            f.seek(0, os.SEEK_END)
            f.write(b"\0" * (size - FILE_BYTES))
        else:
            f.truncate(size)
    assert drive.load_exact(key) is False
    assert tier.counters.corrupt == 1 and not path.exists()
    assert tier.take_evicted() == [key]


def test_short_read_is_corrupt(make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch) -> None:
    # The file shrinks between fstat and read (a peer rewriting it): the read ends early.
    tier = make_tier()
    drive = Driver(tier)
    key = make_key(0)
    assert drive.store(key)
    real = fs_files.read_exact
    path = block_file(tier, key)

    def shrinking(fd: int, buffers: list[memoryview]) -> bool:
        os.truncate(path, 100)
        return real(fd, buffers)

    monkeypatch.setattr(fs_files, "read_exact", shrinking)
    assert drive.load_exact(key) is False
    assert tier.counters.corrupt == 1


def test_file_from_another_namespace_is_a_miss(
    make_tier: MakeTier, namespace: Namespace, other_namespace: Namespace
) -> None:
    mine = make_tier()
    theirs = make_tier(ns=other_namespace)
    key = make_key(0)
    assert Driver(theirs).store(key)
    theirs.close()
    target = block_file(mine, key)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.rename(block_file(theirs, key), target)
    assert mine.rescan().result(timeout=10) == 1
    assert mine.lookup([key]) == [True]  # the index only knows a file is there...
    assert Driver(mine).load_exact(key) is False  # ...the header says it is not ours
    assert mine.counters.corrupt == 1 and not target.exists()


def test_file_of_another_key_is_a_miss(make_tier: MakeTier) -> None:
    tier = make_tier()
    drive = Driver(tier)
    a, b = make_keys(2)
    assert drive.store(a)
    tier.close()
    target = block_file(tier, b)
    target.parent.mkdir(parents=True, exist_ok=True)
    os.rename(block_file(tier, a), target)
    again = make_tier()
    assert again.lookup([a, b]) == [False, True]
    assert Driver(again).load_exact(b) is False
    assert again.counters.corrupt == 1


def test_missing_file_is_a_miss(make_tier: MakeTier) -> None:
    tier = make_tier()
    drive = Driver(tier)
    key = make_key(0)
    assert drive.store(key)
    block_file(tier, key).unlink()  # another process sharing the directory evicted it
    assert drive.load_exact(key) is False
    assert tier.counters.corrupt == 0
    assert tier.lookup([key]) == [False]
    assert tier.take_evicted() == [key]
    assert tier.used_bytes == 0


# -- capacity and LRU -----------------------------------------------------------------------------


def test_capacity_never_exceeded_one_at_a_time(make_tier: MakeTier) -> None:
    tier = make_tier(blocks=5.5)
    drive = Driver(tier)
    keys = make_keys(40)
    for key in keys:
        assert drive.store(key)
        assert tier.used_bytes <= tier.capacity
        assert disk_bytes(tier) <= tier.capacity
    assert tier.lookup(keys) == [False] * 35 + [True] * 5
    assert tier.take_evicted() == keys[:35]
    assert tier.counters.evictions == 35
    assert disk_bytes(tier) == 5 * FILE_BYTES


def test_capacity_never_exceeded_with_many_writes_in_flight(
    make_tier: MakeTier, pool: HostPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fewer I/O threads than blocks of capacity: there is always an unpinned victim, so every
    # write succeeds (with more writers than room, some are rejected: see test_all_pinned...).
    tier = make_tier(blocks=7, threads=4)
    meter = DiskMeter(tier, monkeypatch)
    drive = Driver(tier)
    keys = make_keys(NUM_SLOTS * 4)
    jobs = []
    for batch in range(4):
        for slot in range(NUM_SLOTS):
            fill(pool, slot, keys[batch * NUM_SLOTS + slot])
        jobs += [
            drive.submit(TierJobKind.WRITE, [keys[batch * NUM_SLOTS + s]], [s])
            for s in range(NUM_SLOTS)
        ]
        while not all(job in drive.results for job in jobs):
            drive.collect()
            assert tier.used_bytes <= tier.capacity
        assert disk_bytes(tier) <= tier.capacity
    assert meter.peak <= tier.capacity
    assert meter.bytes == disk_bytes(tier)
    assert all(all(drive.results[job].ok) for job in jobs)
    assert tier.counters.rejected == tier.counters.errors == 0
    assert len(tier) == 7 and disk_bytes(tier) == 7 * FILE_BYTES == tier.used_bytes
    assert files(tier, "*.tmp") == []


def test_lru_order_reads_touch(make_tier: MakeTier) -> None:
    tier = make_tier(blocks=3)
    drive = Driver(tier)
    a, b, c, d, e = make_keys(5)
    for key in (a, b, c):
        assert drive.store(key)
    assert drive.load_exact(a)  # order now b, c, a
    assert drive.store(d)
    assert tier.lookup([a, b, c, d]) == [True, False, True, True]
    assert tier.lookup([a]) == [True]  # lookups do not touch: c is the oldest now
    assert drive.store(e)
    assert tier.lookup([a, c, d, e]) == [True, False, True, True]
    assert tier.take_evicted() == [b, c]


def test_block_larger_than_capacity_is_rejected(make_tier: MakeTier) -> None:
    tier = make_tier(blocks=0.99)
    assert Driver(tier).store(make_key(0)) is False
    assert tier.counters.rejected == 1 and files(tier) == [] and tier.used_bytes == 0


def test_blocks_in_flight_are_not_evicted(
    make_tier: MakeTier, pool: HostPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(blocks=2, threads=4)
    drive = Driver(tier)
    a, b, c, d = make_keys(4)
    assert drive.store(a) and drive.store(b)  # a is the oldest

    release = threading.Event()
    reading = threading.Event()
    real = fs_files.read_exact

    def slow_read(fd: int, buffers: list[memoryview]) -> bool:
        reading.set()
        assert release.wait(10)
        return real(fd, buffers)

    monkeypatch.setattr(fs_files, "read_exact", slow_read)
    poison(pool, 30)
    read_a = drive.submit(TierJobKind.READ, [a], [30])
    assert reading.wait(10)
    assert drive.store(c, slot=0)  # must evict b, not a (a is being read)
    assert tier.lookup([a, b, c]) == [True, False, True]
    assert drive.store(d, slot=1)  # a is still pinned: c goes
    assert tier.lookup([a, b, c, d]) == [True, False, False, True]
    release.set()
    assert drive.wait(read_a) == [True]
    assert bytes(pool.view(30)) == payload_for(a, SLOT_BYTES)


def test_all_pinned_means_rejected(
    make_tier: MakeTier, pool: HostPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(blocks=1, threads=2)
    drive = Driver(tier)
    a, b = make_keys(2)
    assert drive.store(a)
    release = threading.Event()
    real = fs_files.read_exact

    def slow_read(fd: int, buffers: list[memoryview]) -> bool:
        assert release.wait(10)
        return real(fd, buffers)

    monkeypatch.setattr(fs_files, "read_exact", slow_read)
    read_a = drive.submit(TierJobKind.READ, [a], [30])
    assert drive.store(b) is False
    assert tier.counters.rejected == 1
    release.set()
    assert drive.wait(read_a) == [True]
    assert drive.store(b)


def test_key_invisible_until_renamed(
    make_tier: MakeTier, pool: HostPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    drive = Driver(tier)
    key = make_key(0)
    writing = threading.Event()
    release = threading.Event()
    real = fs_files.write_all

    def slow_write(fd: int, buffers: list[memoryview]) -> None:
        real(fd, buffers)
        writing.set()
        assert release.wait(10)

    monkeypatch.setattr(fs_files, "write_all", slow_write)
    fill(pool, 0, key)
    job = drive.submit(TierJobKind.WRITE, [key], [0])
    assert writing.wait(10)
    assert tier.lookup([key]) == [False]
    assert drive.read([key], [1]) == [False]
    assert not block_file(tier, key).exists() and len(files(tier, "*.tmp")) == 1
    # A second write of the same key while the first runs is refused, not duplicated.
    assert drive.write([key], [0]) == [False]
    release.set()
    assert drive.wait(job) == [True]
    assert tier.lookup([key]) == [True]
    assert drive.load_exact(key)


# -- I/O errors -----------------------------------------------------------------------------------


def test_disk_full_evicts_and_retries_once(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    drive = Driver(tier)
    old_key, new_key = make_keys(2)
    assert drive.store(old_key)
    real = fs_files.write_all
    calls = []

    def full_once(fd: int, buffers: list[memoryview]) -> None:
        calls.append(fd)
        if len(calls) == 1:
            os.write(fd, bytes(buffers[0][:10]))  # a partial temp file is left behind...
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, buffers)

    monkeypatch.setattr(fs_files, "write_all", full_once)
    assert drive.store(new_key)  # ...removed; the least recent block makes room; retried
    assert len(calls) == 2 and tier.counters.errors == 0 and tier.counters.evictions == 1
    assert tier.lookup([old_key, new_key]) == [False, True]
    assert files(tier, "*.tmp") == [] and tier.used_bytes == FILE_BYTES == disk_bytes(tier)
    assert tier.take_evicted() == [old_key]
    assert drive.load_exact(new_key)


def test_disk_full_for_good_fails_the_write_only(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    drive = Driver(tier)
    keys = make_keys(3)
    assert drive.store(keys[0])

    def full(fd: int, buffers: list[memoryview]) -> None:
        os.write(fd, bytes(buffers[0][:10]))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(fs_files, "write_all", full)
    assert drive.store(keys[1]) is False  # neither submit nor poll raise
    assert tier.counters.errors == 1 and tier.counters.evictions == 1  # tried to make room
    assert files(tier) == [] and tier.used_bytes == 0
    assert drive.store(keys[2]) is False  # nothing left to evict: fails without a retry
    assert tier.counters.errors == 2
    monkeypatch.undo()
    assert drive.store(keys[1]) and drive.load_exact(keys[1])


def test_permission_denied_on_create_or_rename(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    # We run as root, where chmod does not stop writes: inject the errors instead.
    tier = make_tier()
    drive = Driver(tier)
    real_open = os.open

    def no_create(path: str, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        if str(path).endswith(".tmp"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, flags, mode, dir_fd=dir_fd)

    def no_rename(src: str, dst: str, **kwargs: object) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), src)

    keys = make_keys(3)
    monkeypatch.setattr(os, "open", no_create)
    assert drive.store(keys[0]) is False
    monkeypatch.undo()
    monkeypatch.setattr(os, "replace", no_rename)
    assert drive.store(keys[1]) is False
    monkeypatch.undo()

    assert tier.counters.errors == 2
    assert files(tier) == [] and tier.used_bytes == 0
    assert tier.lookup(keys[:2]) == [False, False]
    assert drive.store(keys[2]) and drive.load_exact(keys[2])


def test_read_io_error_is_a_miss_and_keeps_the_block(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    drive = Driver(tier)
    key = make_key(0)
    assert drive.store(key)

    def eio(fd: int, buffers: list[memoryview]) -> bool:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(fs_files, "read_exact", eio)
    assert drive.load_exact(key) is False
    assert tier.counters.errors == 1 and tier.counters.corrupt == 0
    monkeypatch.undo()
    assert drive.load_exact(key)


def test_unwritable_path_is_a_config_error(
    tmp_path: Path, pool: HostPool, namespace: Namespace
) -> None:
    regular = tmp_path / "a-file"
    regular.write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        FsTier("disk", namespace, pool, Options(str(regular / "kv"), 10**6))
    assert err.value.field == "fs.path"
    assert "writable directory" in str(err.value)
    # The I/O threads started for the tier are stopped again, not left idle for the process.
    deadline = time.monotonic() + 5
    while any(t.name.startswith("kvtier-disk") for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.01)


# -- names and namespaces -------------------------------------------------------------------------


def test_key_bytes_never_escape_the_namespace_directory(make_tier: MakeTier) -> None:
    tier = make_tier()
    drive = Driver(tier)
    evil = (b"../../../../etc/" * 2)[:16]
    assert len(evil) == 16
    assert drive.store(evil) and drive.load_exact(evil)
    (only,) = files(tier)
    assert only.resolve().parent.parent == Path(tier.root).resolve()
    assert only.name == evil.hex() + ".kvb"


def test_keys_of_other_lengths_are_refused(make_tier: MakeTier) -> None:
    # A longer key would be cut to 16 bytes in the header and could pass as another key.
    tier = make_tier()
    drive = Driver(tier)
    for key in (b"", b"../" * 6, make_key(0) + b"x"):
        fill(tier.pool, 0, make_key(0))
        assert drive.write([key], [0]) == [False]
    assert files(tier) == [] and tier.counters.errors == 3


def test_two_namespaces_on_one_path_never_meet(
    make_tier: MakeTier, pool: HostPool, other_namespace: Namespace
) -> None:
    mine = make_tier()
    theirs = make_tier(ns=other_namespace)
    assert mine.root != theirs.root
    key = make_key(0)
    assert Driver(mine).store(key)
    assert theirs.lookup([key]) == [False]
    assert theirs.rescan().result(timeout=10) == 0
    assert Driver(theirs).read([key], [5]) == [False]
    # Same key, different bytes in the other namespace: each reads its own.
    pool.view(0)[:] = b"\x5a" * SLOT_BYTES
    assert Driver(theirs).write([key], [0]) == [True]
    assert Driver(mine).load_exact(key)
    assert Driver(theirs).read([key], [6]) == [True]
    assert bytes(pool.view(6)) == b"\x5a" * SLOT_BYTES


def test_rescan_sees_what_peers_wrote_and_deleted(make_tier: MakeTier) -> None:
    # Two tiers on one directory stand for two processes on a shared filesystem.
    mine = make_tier()
    peer = make_tier()
    a, b = make_keys(2)
    assert Driver(mine).store(a)
    assert Driver(peer).store(b)
    assert mine.lookup([b]) == [False]
    assert mine.rescan().result(timeout=10) == 1
    assert mine.lookup([a, b]) == [True, True]
    assert Driver(mine).load_exact(b)
    block_file(peer, b).unlink()
    assert mine.rescan().result(timeout=10) == 0
    assert mine.lookup([a, b]) == [True, False]
    assert mine.take_evicted() == [b]
    assert mine.used_bytes == FILE_BYTES


def test_rescan_never_counts_past_capacity(make_tier: MakeTier) -> None:
    # A peer with a larger share of the disk wrote more than this tier may hold: a rescan
    # indexes the newest of its files only up to this tier's capacity, and deletes none of them.
    mine = make_tier(blocks=3)
    peer = make_tier(blocks=10)
    mine_keys, peer_keys = make_keys(2, salt="mine"), make_keys(6, salt="peer")
    for key in mine_keys:
        assert Driver(mine).store(key)
    for key in peer_keys:
        assert Driver(peer).store(key)
    assert mine.rescan().result(timeout=10) == 1
    assert mine.used_bytes == 3 * FILE_BYTES
    assert mine.lookup(mine_keys) == [True, True]
    assert sum(mine.lookup(peer_keys)) == 1
    assert all(block_file(peer, key).exists() for key in peer_keys)
    assert mine.counters.evictions == 0


# -- options --------------------------------------------------------------------------------------


def test_options_parse() -> None:
    section = Section(
        {"path": "/data/kv", "capacity": "2GiB", "fsync": True, "threads": 8}, "tiers[1]"
    )
    assert Options.parse(section) == Options("/data/kv", 2 * 1024**3, True, 8)
    assert Options.parse(Section({"path": "/kv", "capacity": 4096}, "t")) == Options("/kv", 4096)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({"capacity": "1GiB"}, "tiers[1].path"),
        ({"path": "", "capacity": "1GiB"}, "tiers[1].path"),
        ({"path": 3, "capacity": "1GiB"}, "tiers[1].path"),
        ({"path": "/kv"}, "tiers[1].capacity"),
        ({"path": "/kv", "capacity": "lots"}, "tiers[1].capacity"),
        ({"path": "/kv", "capacity": 0}, "tiers[1].capacity"),
        ({"path": "/kv", "capacity": "1GiB", "fsync": "yes"}, "tiers[1].fsync"),
        ({"path": "/kv", "capacity": "1GiB", "threads": 0}, "tiers[1].threads"),
        ({"path": "/kv", "capacity": "1GiB", "threads": "4"}, "tiers[1].threads"),
        ({"path": "/kv", "capacity": "1GiB", "capcity": 1}, "tiers[1].capcity"),
    ],
)
def test_bad_options_name_the_field(data: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as err:
        Options.parse(Section(data, "tiers[1]"))
    assert err.value.field == field


# -- everything at once ---------------------------------------------------------------------------


def test_concurrent_reads_and_writes_return_only_exact_bytes(
    make_tier: MakeTier, pool: HostPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Random reads and writes under capacity pressure: every ok=True read is bit-exact, nothing
    is ever flagged corrupt, and the disk never holds more than the capacity."""
    tier = make_tier(blocks=12, threads=6)
    meter = DiskMeter(tier, monkeypatch)
    drive = Driver(tier)
    rng = random.Random(1234)
    keys = make_keys(48)
    free_slots = list(range(NUM_SLOTS))
    running: dict[int, tuple[TierJobKind, list[bytes], list[int]]] = {}
    reads_ok = 0
    submitted = 0
    deadline = time.monotonic() + 60
    while submitted < 600 or running:
        assert time.monotonic() < deadline
        if submitted < 600 and len(free_slots) >= 4:
            n = rng.randint(1, 4)
            chosen = rng.sample(keys, n)
            slots = [free_slots.pop() for _ in range(n)]
            if rng.random() < 0.5:
                kind = TierJobKind.WRITE
                for key, slot in zip(chosen, slots, strict=True):
                    fill(pool, slot, key)
            else:
                kind = TierJobKind.READ
                for slot in slots:
                    poison(pool, slot)
            running[drive.submit(kind, chosen, slots)] = (kind, chosen, slots)
            submitted += 1
        drive.collect()
        for job_id in [j for j in running if j in drive.results]:
            kind, chosen, slots = running.pop(job_id)
            ok = drive.results.pop(job_id).ok
            if kind is TierJobKind.READ:
                for key, slot, good in zip(chosen, slots, ok, strict=True):
                    if good:
                        assert bytes(pool.view(slot)) == payload_for(key, SLOT_BYTES)
                        reads_ok += 1
            free_slots += slots
        assert tier.used_bytes <= tier.capacity
    assert meter.peak <= tier.capacity
    assert meter.bytes == disk_bytes(tier)
    assert reads_ok > 50
    assert tier.counters.corrupt == 0 and tier.counters.errors == 0
    assert tier.used_bytes == disk_bytes(tier) == len(tier) * FILE_BYTES
    # Restart agrees with what the index said.
    live = [k for k, hit in zip(keys, tier.lookup(keys), strict=True) if hit]
    tier.close()
    again = make_tier(blocks=12)
    assert again.lookup(keys) == [k in live for k in keys]


def test_shutil_copy_of_a_store_is_readable(make_tier: MakeTier, tmp_path: Path) -> None:
    # Blocks are self-describing: a copied directory (backup, another node) serves the same bytes.
    tier = make_tier()
    keys = make_keys(5)
    assert all(Driver(tier).store(key) for key in keys)
    tier.close()
    copy = tmp_path / "copy"
    shutil.copytree(Path(tier.root).parent, copy)
    again = make_tier(path=copy)
    assert all(Driver(again).load_exact(key) for key in keys)


def test_a_promotion_is_read_ahead_of_queued_writes(
    make_fs: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read (a promotion a request waits for) is not queued behind the cascade's writes: on an
    H100 at 8 conversations in flight, fs reads waited behind 28 GB of writes and requests with
    full hits waited 3.8 s where vLLM alone took 1.8 s."""
    tier = make_fs(threads=1)
    drive = Driver(tier)
    stored = make_keys(2, "old")
    for key in stored:
        assert drive.store(key)
    real = fs_files.write_all
    order: list[str] = []

    def slow_write(fd: int, buffers: list[memoryview]) -> None:
        time.sleep(0.02)
        order.append("write")
        real(fd, buffers)

    monkeypatch.setattr(fs_files, "write_all", slow_write)
    monkeypatch.setattr(fs_files, "read_exact", _noting(order, fs_files.read_exact))
    fresh = make_keys(20, "new")
    for i, key in enumerate(fresh):
        fill(tier.pool, 10 + i, key)
    writes = drive.submit(TierJobKind.WRITE, fresh, list(range(10, 30)))
    time.sleep(0.05)  # the write job is running
    read = drive.submit(TierJobKind.READ, [stored[1]], [40])
    assert drive.wait(read) == [True]
    assert drive.wait(writes) == [True] * 20
    assert order.index("read") < 8, order  # after the write in progress, not after all 20


def _noting(order: list[str], real: Callable[..., bool]) -> Callable[..., bool]:
    def read(fd: int, buffers: list[memoryview]) -> bool:
        order.append("read")
        return real(fd, buffers)

    return read


def test_a_shard_directory_is_opened_once_and_closed_with_the_tier(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each system call of the I/O threads hands the GIL over and back (the engine's thread
    waits for it): blocks of one shard open it once, not once per block."""
    tier = make_tier(threads=1)  # four threads may each open it once, at the same time
    drive = Driver(tier)
    first = make_key(1)
    keys = [first[:1] + bytes([i]) + first[2:] for i in range(8)]  # one shard directory
    opened: list[str] = []
    real_open = os.open

    def counting_open(path: str, flags: int, *args: object, **kwargs: object) -> int:
        fd = real_open(path, flags, *args, **kwargs)  # type: ignore[arg-type]
        opened.append(os.fsdecode(path))  # opened (not: missing, then made)
        return fd

    monkeypatch.setattr(fs_files.os, "open", counting_open)
    assert drive.store(keys, first_slot=0) == [True] * 8
    assert drive.read(keys, list(range(8, 16))) == [True] * 8
    shard = first.hex()[:2]
    assert opened.count(shard) == 1  # 16 before
    assert len(opened) == 1 + 8 + 8  # the shard, a temp file a write, the file a read
    monkeypatch.undo()
    before = len(os.listdir("/proc/self/fd"))
    tier.close()
    assert len(os.listdir("/proc/self/fd")) == before - 2  # the shard and the namespace's root


def test_temp_names_carry_the_process_id_after_a_fork() -> None:
    """The process id is read once per process: a child forked later names its temp files with
    its own (a peer tells a dead writer's leftovers by it)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's cleanup
        os.write(write, str(fs_files._pid[0] == os.getpid()).encode())
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    assert os.read(read, 16) == b"True"
    os.close(read)
    assert fs_files._pid[0] == os.getpid()


def test_a_shard_directory_opened_by_two_threads_at_once_is_kept_once(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(threads=1)
    block_files = tier._files
    real_open_shard = block_files._open_shard
    first_fd: list[int] = []

    def another_thread_first(name: str) -> int:
        first_fd.append(real_open_shard(name))
        block_files._shards[name] = first_fd[0]  # as if another thread had kept it meanwhile
        return real_open_shard(name)  # this thread's own, now one too many

    monkeypatch.setattr(block_files, "_open_shard", another_thread_first)
    before = len(os.listdir("/proc/self/fd"))
    assert Driver(tier).store(make_key(1))
    assert list(block_files._shards.values()) == first_fd
    assert len(os.listdir("/proc/self/fd")) == before + 1  # the kept one; the other closed
