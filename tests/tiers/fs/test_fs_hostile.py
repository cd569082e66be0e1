"""The fs tier under hostile files: FIFOs, symbolic links, loose modes, undeletable files and
peers that share the directory. Real files, FIFOs, links and immutable files throughout."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import require
from support.blocks import make_keys
from support.drivers import Driver

from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.tiers.fs.tier import FsTier, Options
from kvtier.validation import Section
from tiers.fs.helpers import FILE_BYTES, MakeTier, block_file, block_files, disk_bytes

# -- FIFOs and other non-regular files (finding 3) -----------------------------------------------


def _release_fifo(path: Path) -> None:
    """Let a reader blocked in open() of ``path`` go (it sees end of file): an unfixed tier
    would otherwise keep a thread, and the test process, waiting forever."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:
        return  # no FIFO there any more, or nobody waiting on it
    os.close(fd)


def test_fifo_in_place_of_a_block_is_dropped_without_waiting(make_fs: MakeTier) -> None:
    tier = make_fs()
    drive = Driver(tier)
    key, other = make_keys(2)
    assert drive.store(key) and drive.store(other)
    path = block_file(tier, key)
    path.unlink()
    os.mkfifo(path)
    try:
        started = time.monotonic()
        assert drive.read([key], [5]) == [False]
        assert time.monotonic() - started < 2.0
        assert tier.counters.corrupt == 1 and tier.counters.errors == 0
        assert not path.exists()  # the FIFO itself is removed
        assert tier.lookup([key, other]) == [False, True]
        assert tier.take_evicted() == [key]
        assert tier.used_bytes == FILE_BYTES
        assert drive.load_exact(other)  # the threads are all still there
    finally:
        _release_fifo(path)


@pytest.mark.parametrize("kind", ["directory", "fifo-swapped-after-check"])
def test_other_non_regular_files_are_never_read(
    make_fs: MakeTier, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    tier = make_fs()
    drive = Driver(tier)
    key = make_keys(1)[0]
    assert drive.store(key)
    path = block_file(tier, key)
    if kind == "directory":
        path.unlink()
        path.mkdir()
    else:
        # The file is regular when checked and a FIFO when opened: the open does not block
        # (O_NONBLOCK) and fstat refuses it.
        real_stat = os.stat

        def swap_after_check(*args: object, **kwargs: object) -> os.stat_result:
            st = real_stat(*args, **kwargs)  # type: ignore[arg-type]
            if args and args[0] == path.name and stat.S_ISREG(st.st_mode):
                path.unlink()
                os.mkfifo(path)
            return st

        monkeypatch.setattr(os, "stat", swap_after_check)
    try:
        assert drive.read([key], [5]) == [False]
        assert tier.counters.corrupt == 1
        assert tier.lookup([key]) == [False]
    finally:
        monkeypatch.undo()
        _release_fifo(path)


# -- modes (finding 7) ----------------------------------------------------------------------------


@pytest.fixture
def umask() -> Iterator[None]:
    """Run with umask 0: every bit the tier does not clear itself would show."""
    old = os.umask(0)
    yield
    os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.mark.usefixtures("umask")
def test_files_and_directories_are_private_by_default(
    make_fs: MakeTier, fs_store_dir: Path
) -> None:
    tier = make_fs(path=fs_store_dir / "a" / "b")
    key = make_keys(1)[0]
    assert Driver(tier).store(key)
    for directory in (fs_store_dir, fs_store_dir / "a", fs_store_dir / "a" / "b", Path(tier.root)):
        assert _mode(directory) == 0o700, directory
    assert _mode(block_file(tier, key).parent) == 0o700
    assert _mode(block_file(tier, key)) == 0o600


def test_modes_are_configurable_and_umask_independent(
    make_fs: MakeTier, fs_store_dir: Path
) -> None:
    old = os.umask(0o077)  # would take every group bit away
    try:
        tier = make_fs(file_mode=0o640, dir_mode=0o750)
        key = make_keys(1)[0]
        assert Driver(tier).store(key)
    finally:
        os.umask(old)
    assert _mode(fs_store_dir) == _mode(Path(tier.root)) == 0o750
    assert _mode(block_file(tier, key).parent) == 0o750
    assert _mode(block_file(tier, key)) == 0o640


def test_an_existing_open_namespace_directory_is_closed(
    make_fs: MakeTier, fs_store_dir: Path, namespace: Namespace
) -> None:
    # A store written by an older version: 0755 directories, 0644 files.
    old = make_fs()
    key = make_keys(1)[0]
    assert Driver(old).store(key)
    old.close()
    os.chmod(old.root, 0o755)
    make_fs()
    assert _mode(Path(old.root)) == 0o700
    assert _mode(fs_store_dir) == 0o700  # created by the tier in the first place


@pytest.mark.parametrize(
    ("value", "mode"),
    [("0640", 0o640), ("0o660", 0o660), ("600", 0o600), (0o644, 0o644), (0o600, 0o600)],
)
def test_mode_options_parse(value: object, mode: int) -> None:
    section = Section({"path": "/kv", "capacity": 4096, "file_mode": value}, "tiers[1]")
    assert Options.parse(section).file_mode == mode


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("file_mode", "rw-r-----"),
        ("file_mode", "0400"),  # the owner could not write its own blocks
        ("file_mode", 640),  # decimal 640 is 0o1200: not permission bits
        ("file_mode", "01600"),
        ("file_mode", ""),
        ("file_mode", True),
        ("dir_mode", "0600"),  # the owner could not enter it
        ("dir_mode", -1),
        ("min_free", "lots"),
        ("io_timeout_s", 0),
        ("io_timeout_s", 7200),
    ],
)
def test_bad_new_options_name_the_field(key: str, value: object) -> None:
    with pytest.raises(ConfigError) as err:
        Options.parse(Section({"path": "/kv", "capacity": 4096, key: value}, "tiers[1]"))
    assert err.value.field == f"tiers[1].{key}"


# -- links (finding 12 and the hostile-file rules) ------------------------------------------------


def test_symlinked_block_file_is_not_followed(make_fs: MakeTier, tmp_path: Path) -> None:
    tier = make_fs()
    drive = Driver(tier)
    key = make_keys(1)[0]
    assert drive.store(key)
    path = block_file(tier, key)
    # A valid copy of the very block elsewhere: followed, the read would succeed.
    target = tmp_path / "elsewhere.kvb"
    shutil.copyfile(path, target)
    path.unlink()
    path.symlink_to(target)
    assert drive.read([key], [5]) == [False]
    assert tier.counters.corrupt == 1
    assert not path.is_symlink() and not path.exists()  # the link is removed...
    assert target.stat().st_size == FILE_BYTES  # ...never what it points to
    assert tier.lookup([key]) == [False]


def test_symlinked_shard_directory_is_not_followed(
    make_fs: MakeTier, tmp_path: Path, pool: HostPool, namespace: Namespace, fs_store_dir: Path
) -> None:
    first = make_fs()
    key = make_keys(1)[0]
    assert Driver(first).store(key)
    first.close()
    tier = make_fs()  # indexes the block; has not opened its shard directory yet
    drive = Driver(tier)
    shard = block_file(tier, key).parent
    moved = tmp_path / "moved-shard"
    shard.rename(moved)
    shard.symlink_to(moved)
    # Reads and writes do not go through the link; nothing is removed behind it.
    assert drive.read([key], [5]) == [False]
    assert tier.counters.corrupt == 1 and tier.lookup([key]) == [False]
    assert drive.store(key) is False
    assert sorted(p.name for p in moved.iterdir()) == [f"{key.hex()}.kvb"]
    # A restart does not index what sits behind the link either.
    fresh = FsTier("again", namespace, pool, Options(str(fs_store_dir), 100 * FILE_BYTES))
    try:
        assert len(fresh) == 0 and fresh.lookup([key]) == [False]
    finally:
        fresh.close()


def test_a_shard_directory_replaced_after_it_was_opened_is_not_followed(
    make_fs: MakeTier, tmp_path: Path
) -> None:
    """The tier keeps the shard directories it opened: one moved away and replaced by a link
    is still the one written to and read from, never the link's target."""
    tier = make_fs()
    drive = Driver(tier)
    key = make_keys(1)[0]
    neighbour = key[:1] + bytes(len(key) - 1)  # the same shard directory
    assert drive.store(key)
    shard = block_file(tier, key).parent
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    shard.rename(ours)
    theirs.mkdir()
    shard.symlink_to(theirs)
    assert drive.store(neighbour, 1)
    assert drive.read([key, neighbour], [5, 6]) == [True, True]
    assert list(theirs.iterdir()) == []
    assert sorted(p.name for p in ours.iterdir()) == sorted(
        f"{k.hex()}.kvb" for k in (key, neighbour)
    )


def test_symlinked_namespace_directory_is_refused(
    tmp_path: Path, fs_store_dir: Path, pool: HostPool, namespace: Namespace
) -> None:
    probe = FsTier("probe", namespace, pool, Options(str(fs_store_dir), 10**6))
    probe.close()
    root = Path(probe.root)
    root.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root.symlink_to(elsewhere)
    with pytest.raises(ConfigError) as err:
        FsTier("disk", namespace, pool, Options(str(fs_store_dir), 10**6, config_path="tiers[0]"))
    assert err.value.field == "tiers[0].path"
    assert "symbolic link" in str(err.value)
    assert list(elsewhere.iterdir()) == []


def test_symlink_named_like_a_block_is_not_indexed(make_fs: MakeTier, tmp_path: Path) -> None:
    tier = make_fs()
    key = make_keys(1)[0]
    assert Driver(tier).store(key)
    path = block_file(tier, key)
    target = tmp_path / "copy.kvb"
    shutil.copyfile(path, target)
    path.unlink()
    path.symlink_to(target)
    assert make_fs().lookup([key]) == [False]


# -- accounting (finding 12) ----------------------------------------------------------------------


@pytest.fixture
def immutable() -> Iterator[list[Path]]:
    """Files made immutable with chattr (unlink fails even for root); made mutable again after."""
    paths: list[Path] = []
    yield paths
    for path in paths:
        subprocess.run(["chattr", "-i", str(path)], check=False, capture_output=True)


def _make_immutable(path: Path, paths: list[Path]) -> None:
    done = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        require.missing("root", f"chattr +i is not possible here: {done.stderr.strip()}")
    paths.append(path)
    try:
        path.rename(path)  # a no-op rename still needs a mutable file
    except OSError as exc:
        assert exc.errno in (errno.EPERM, errno.EACCES)


def test_undeletable_victim_is_forgotten_not_counted_forever(
    make_fs: MakeTier, immutable: list[Path]
) -> None:
    tier = make_fs(blocks=1)
    drive = Driver(tier)
    a, b, c = make_keys(3)
    assert drive.store(a)
    _make_immutable(block_file(tier, a), immutable)
    # The victim cannot be removed: it is forgotten (one error), no longer counted, and the write
    # claims the room it no longer holds.
    assert drive.store(b)
    assert tier.counters.errors == 1 and tier.counters.evictions == 0
    assert tier.lookup([a, b]) == [False, True] and tier.used_bytes == FILE_BYTES
    # A rescan does not index it again, and the capacity keeps working.
    assert tier.rescan().result(timeout=10) == 0
    assert tier.used_bytes == FILE_BYTES and tier.lookup([a, b]) == [False, True]
    assert drive.store(c) and tier.lookup([b, c]) == [False, True]
    assert tier.used_bytes == FILE_BYTES


def test_rescan_of_a_peers_undeletable_files_stays_within_capacity(
    make_fs: MakeTier, immutable: list[Path]
) -> None:
    # The peer stands for another user's process on a shared directory: its files are there to
    # read, not ours to delete.
    peer = make_fs(blocks=10)
    mine = make_fs(blocks=2)
    keys = make_keys(6)
    peer_drive = Driver(peer)
    for key in keys:
        assert peer_drive.store(key)
        _make_immutable(block_file(peer, key), immutable)
    mine.rescan().result(timeout=10)
    assert mine.used_bytes <= mine.capacity
    again = mine.rescan().result(timeout=10)
    assert again == 0 and mine.used_bytes <= mine.capacity
    # Evicting a peer's file we cannot delete does not stop our own blocks.
    own = make_keys(3, "own")
    drive = Driver(mine)
    for key in own:
        drive.store(key)
    assert mine.lookup(own[-1:]) == [True] and mine.used_bytes <= mine.capacity


def test_rescan_does_not_count_a_file_deleted_while_it_listed(
    make_fs: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_fs(blocks=2, threads=2)
    drive = Driver(tier)
    a, b, c = make_keys(3)
    assert drive.store(a) and drive.store(b)
    listed, go_on = threading.Event(), threading.Event()
    real_scan = tier._scan

    def scan_then_wait() -> list[tuple[bytes, int, float]]:
        found = real_scan()
        listed.set()
        assert go_on.wait(10)
        return found

    monkeypatch.setattr(tier, "_scan", scan_then_wait)
    pending = tier.rescan()
    assert listed.wait(10)
    assert drive.store(c)  # evicts a, which the listing still shows
    go_on.set()
    assert pending.result(timeout=10) == 0
    assert tier.lookup([a, b, c]) == [False, True, True]
    assert len(tier) == len(block_files(tier)) == 2
    assert tier.used_bytes == disk_bytes(tier) == 2 * FILE_BYTES
