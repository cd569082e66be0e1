"""The fs tier on a real full filesystem: a size-limited tmpfs (mounting one needs root)."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import require
from support.blocks import make_keys
from support.drivers import Driver

from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.tiers.fs import tier as fs_module
from kvtier.tiers.fs.tier import FsTier, Options
from tiers.fs.helpers import FILE_BYTES, block_files, disk_bytes

MountSmall = Callable[[int], Path]


@pytest.fixture
def mount_small(tmp_path: Path) -> Iterator[MountSmall]:
    mounts: list[Path] = []

    def mount(size: int) -> Path:
        if os.geteuid() != 0:
            require.missing("root", "mounting a tmpfs needs root")
        where = tmp_path / f"small{len(mounts)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(where)],
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            require.missing("root", f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(where)
        return where

    yield mount
    for where in mounts:
        if subprocess.run(["umount", str(where)], check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], check=False)


def fill_up(path: Path) -> None:
    """Write a file until the filesystem says it is full."""
    chunk = b"\0" * 4096
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        while True:
            os.write(fd, chunk)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def test_starts_on_a_full_disk(
    mount_small: MountSmall,
    pool: HostPool,
    namespace: Namespace,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fs_module, "FREE_SPACE_REFRESH_S", 0.0)
    mount = mount_small(256 * 1024)
    fill_up(mount / "someone-elses-file")
    tier = FsTier("disk", namespace, pool, Options(str(mount / "kv"), 10**6, min_free=0))
    try:
        drive = Driver(tier)
        key = make_keys(1)[0]
        assert tier.lookup([key]) == [False]
        assert drive.store(key) is False  # no room, nothing of ours to evict: refused, no raise
        assert tier.counters.rejected + tier.counters.errors == 1
        (mount / "someone-elses-file").unlink()
        assert drive.store(key) and drive.load_exact(key)
    finally:
        tier.close()


def test_capacity_above_the_free_space_evicts_and_keeps_caching(
    mount_small: MountSmall, pool: HostPool, namespace: Namespace
) -> None:
    mount = mount_small(256 * 1024)  # room for about 60 blocks
    # The tier is told it has far more room than the filesystem has.
    tier = FsTier("disk", namespace, pool, Options(str(mount), 64 * 1024**2, min_free=0))
    try:
        drive = Driver(tier)
        keys = make_keys(200)
        stored = [drive.store(key, slot=i % 8) for i, key in enumerate(keys)]
        assert all(stored), f"{stored.count(False)} writes failed"
        assert tier.counters.evictions > 100 and tier.counters.errors == 0
        assert tier.used_bytes == disk_bytes(tier) <= tier.limit <= 256 * 1024
        assert list(mount.glob("*/*/*.tmp")) == []
        assert tier.lookup(keys[-20:]) == [True] * 20
        for key in keys[-20:]:
            assert drive.load_exact(key, slot=20)
    finally:
        tier.close()


def test_disk_filled_by_others_while_running_evicts_own_blocks(
    mount_small: MountSmall, pool: HostPool, namespace: Namespace
) -> None:
    mount = mount_small(512 * 1024)
    tier = FsTier("disk", namespace, pool, Options(str(mount / "kv"), 64 * 1024**2, min_free=0))
    try:
        drive = Driver(tier)
        first = make_keys(40, "first")
        assert all(drive.store(key, slot=i % 8) for i, key in enumerate(first))
        fill_up(mount / "filler")  # someone else takes every free byte
        later = make_keys(40, "later")
        stored = [drive.store(key, slot=i % 8) for i, key in enumerate(later)]
        assert all(stored) and tier.counters.errors == 0
        assert tier.counters.evictions >= len(later)
        assert len(block_files(tier)) == len(tier) and tier.used_bytes == disk_bytes(tier)
        assert tier.lookup(later) == [True] * len(later)
        assert drive.load_exact(later[-1], slot=20)
    finally:
        tier.close()


def test_min_free_is_left_to_others(
    mount_small: MountSmall,
    pool: HostPool,
    namespace: Namespace,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fs_module, "FREE_SPACE_REFRESH_S", 0.0)
    mount = mount_small(512 * 1024)
    reserve = 256 * 1024
    tier = FsTier(
        "disk", namespace, pool, Options(str(mount / "kv"), 64 * 1024**2, min_free=reserve)
    )
    try:
        drive = Driver(tier)
        assert all(drive.store(key, slot=i % 8) for i, key in enumerate(make_keys(100)))
        st = os.statvfs(mount)
        assert st.f_bavail * st.f_frsize >= reserve - FILE_BYTES
        assert tier.used_bytes <= 512 * 1024 - reserve
    finally:
        tier.close()
