"""The fs tier behind a shared pool (``SharedFsTier``): one directory, one budget and one index for
every engine. Two tier instances in one process stand for two engines here (each has its own open
file description of the index, so they exclude each other as two processes do);
``tests/shared_pool/test_shared_fs_processes.py`` runs real processes and kills them."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.blocks import make_keys
from support.drivers import Driver, wait_for

from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.shared_pool import locks
from kvtier.shared_pool.layout import WRITING
from kvtier.tiers.fs.files import host_tag
from kvtier.tiers.fs.options import Options
from kvtier.tiers.fs.share_index import DELETING, FsShareIndex
from kvtier.tiers.fs.shared import SharedFsTier, ShareSettings
from tiers.conftest import FILE_BYTES

MakeShared = Callable[..., SharedFsTier]


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    path = tmp_path / "shm"
    path.mkdir()
    return path


@pytest.fixture
def make_shared(
    fs_store_dir: Path, shm: Path, pool: HostPool, namespace: Namespace
) -> Iterator[MakeShared]:
    made: list[SharedFsTier] = []

    def make(files: int = 8, lock_timeout_s: float = 0.05) -> SharedFsTier:
        options = Options(path=str(fs_store_dir), capacity=files * FILE_BYTES, threads=2)
        tier = SharedFsTier(
            "disk", namespace, pool, options, ShareSettings(str(shm), lock_timeout_s)
        )
        made.append(tier)
        return tier

    yield make
    for tier in made:
        tier.close()


def block_files(tier: SharedFsTier) -> list[Path]:
    return sorted(Path(tier.root).glob("*/*.kvb"))


def temp_files(tier: SharedFsTier) -> list[Path]:
    return sorted(Path(tier.root).glob("*/*.tmp"))


def settle(*tiers: SharedFsTier) -> None:
    """Poll until nothing waits for the index lock and no orphan is left."""
    for tier in tiers:
        tier.poll()
    index = tiers[0].share_index
    wait_for(lambda: not index.orphans and not index.holds_entries(), what="orphans cleaned")


def test_a_block_one_engine_wrote_is_a_hit_for_the_other_at_once(make_shared: MakeShared) -> None:
    a, b = make_shared(), make_shared()
    keys = make_keys(3)
    assert Driver(a).store(keys) == [True] * 3
    assert b.lookup(keys) == [True] * 3  # no rescan: the index is the same
    assert Driver(b).load_exact(keys) == [True] * 3
    assert len(block_files(a)) == 3 and len(a) == len(b) == 3


def test_one_budget_for_all_engines_however_many_write(make_shared: MakeShared) -> None:
    """Before sharing, each engine counted only its own files: two engines with capacity C each
    could fill 2C."""
    a, b = make_shared(files=6), make_shared(files=6)
    keys = make_keys(30)
    for i, key in enumerate(keys):
        assert Driver(a if i % 2 else b).store(key, slot=i % 8)
        assert len(block_files(a)) <= 6
        assert a.used_bytes == b.used_bytes <= a.capacity
    assert len(block_files(a)) == 6 == a.used_bytes // FILE_BYTES
    assert a.lookup(keys) == [False] * 24 + [True] * 6  # the least recently used went first
    assert a.counters.evictions + b.counters.evictions == 24
    a.check_invariants(settled=True)


def test_a_block_both_store_is_one_file_counted_once(make_shared: MakeShared) -> None:
    a, b = make_shared(), make_shared()
    key = make_keys(1)[0]
    assert Driver(a).store(key)
    assert Driver(b).store(key)
    assert a.used_bytes == FILE_BYTES and len(block_files(a)) == 1
    assert (b.counters.evictions, b.counters.rejected, b.counters.errors) == (0, 0, 0)


def test_eviction_follows_reads_of_every_engine(make_shared: MakeShared) -> None:
    a, b = make_shared(files=3), make_shared(files=3)
    keys = make_keys(4)
    for key in keys[:3]:  # one by one: a job's blocks are written in parallel
        assert Driver(a).store(key)
    assert Driver(b).load_exact(keys[0])  # B's read makes it A's most recent too
    assert Driver(a).store(keys[3])
    assert a.lookup(keys) == [True, False, True, True]


def test_a_corrupt_file_is_dropped_for_every_engine(make_shared: MakeShared) -> None:
    a, b = make_shared(), make_shared()
    key = make_keys(1)[0]
    assert Driver(a).store(key)
    path = block_files(a)[0]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert not Driver(b).load_exact(key)
    assert b.counters.corrupt == 1
    assert a.lookup([key]) == [False] and not path.exists()
    settle(a, b)
    assert a.used_bytes == 0


def test_a_file_removed_behind_the_index_is_a_miss_and_uncounted(make_shared: MakeShared) -> None:
    a, b = make_shared(), make_shared()
    key = make_keys(1)[0]
    assert Driver(a).store(key)
    block_files(a)[0].unlink()
    assert not Driver(b).load_exact(key)
    assert a.lookup([key]) == [False] and a.used_bytes == 0


def test_the_files_survive_a_restart_and_the_budget_holds_then(
    make_shared: MakeShared, shm: Path
) -> None:
    a = make_shared(files=8)
    keys = make_keys(6)
    for i, key in enumerate(keys):
        assert Driver(a).store(key)
        os.utime(block_files(a)[0].parent.parent / key.hex()[:2] / f"{key.hex()}.kvb", (i, i))
    a.close()
    assert list(shm.iterdir()) == []  # the last engine out removed the index
    b = make_shared(files=4)  # a smaller budget now: the oldest files go
    assert b.lookup(keys) == [False] * 2 + [True] * 4
    assert len(block_files(b)) == 4 == b.used_bytes // FILE_BYTES
    assert Driver(b).load_exact(keys[2:]) == [True] * 4


def test_a_stopped_lock_holder_costs_a_rejected_write_not_a_hang(
    make_shared: MakeShared, shm: Path
) -> None:
    a = make_shared(lock_timeout_s=0.05)
    index_file = next(shm.iterdir())
    fd = os.open(index_file, os.O_RDWR)  # another open file: as another engine's
    try:
        assert locks.try_lock(fd, locks.INDEX_LOCK_BYTE)
        key = make_keys(1)[0]
        began = time.monotonic()
        assert not Driver(a).store(key)
        assert time.monotonic() - began < 2.0
        assert a.counters.rejected == 1 and a.share_index.lock_timeouts >= 1
    finally:
        os.close(fd)  # the holder goes: its lock with it
    assert Driver(a).store(key)


def test_a_commit_that_found_the_lock_busy_is_retried(make_shared: MakeShared, shm: Path) -> None:
    a, b = make_shared(), make_shared()
    key = make_keys(1)[0]
    index = a.share_index
    commit = index.commit
    busy = True

    def lock_busy(entry: int, ok: bool) -> bool:
        return False if busy else commit(entry, ok)

    index.commit = lock_busy  # type: ignore[method-assign]
    assert Driver(a).store(key)
    a.poll()
    assert b.lookup([key]) == [False]  # written, not yet published
    busy = False
    wait_for(lambda: not a.poll() and b.lookup([key]) == [True], what="the commit retried")


KILLED_WRITER = """
import os, sys
from kvtier.tiers.fs.share_segment import Directory, open_fs_share
dev, ino, digest, file_bytes, files, shm, key, root, host = sys.argv[1:]
d = Directory(int(dev), int(ino), bytes.fromhex(digest), int(file_bytes), int(files), list, bool)
start = open_fs_share(shm, d, 1.0).index.begin_write(bytes.fromhex(key))
if start.what.value == "write":  # a temp file exists only once an entry is taken
    tmp = os.path.join(root, key[:2], f"{key}.{host}.{os.getpid()}.0.tmp")
    os.makedirs(os.path.dirname(tmp), exist_ok=True)
    open(tmp, "wb").write(b"half a block")
print(start.what.value, flush=True)
os.kill(os.getpid(), 9)
"""


@pytest.mark.parametrize(("files", "began"), [(3, "write"), (2, "evict")])
def test_what_a_killed_writer_left_is_removed_and_uncounted(
    make_shared: MakeShared, shm: Path, namespace: Namespace, files: int, began: str
) -> None:
    """A process that took an entry and began its temp file, or marked a victim for removal to
    make room, and died: the next engine removes its files and frees its entries."""
    a = make_shared(files=files)
    keys = make_keys(3)
    assert Driver(a).store(keys[:2]) == [True] * 2
    st = os.stat(a.root)
    args = [st.st_dev, st.st_ino, namespace.digest.hex(), FILE_BYTES, files, shm, keys[2].hex()]
    args += [a.root, host_tag()]
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, *map(str, args)], capture_output=True, timeout=60
    )
    assert proc.returncode == -9, proc.stderr.decode()
    assert proc.stdout.decode().strip() == began
    index: FsShareIndex = a.share_index
    held = WRITING if began == "write" else DELETING
    assert int((index.a.state == held).sum()) == 1
    assert len(temp_files(a)) == (began == "write")
    assert index.reap_dead() == 1
    settle(a)
    assert temp_files(a) == []
    assert len(block_files(a)) == a.used_bytes // FILE_BYTES == 2 if began == "write" else 1
    a.check_invariants(settled=True)
    assert Driver(a).store(keys[2])
    assert len(block_files(a)) <= files


def test_an_engine_asking_another_capacity_keeps_the_first_ones(make_shared: MakeShared) -> None:
    a = make_shared(files=4)
    b = make_shared(files=8)  # attaches the index as it is, like a shared pool's size
    for key in make_keys(6):
        assert Driver(b).store(key)
    assert len(block_files(a)) == 4 and b.limit == a.limit == 4 * FILE_BYTES
