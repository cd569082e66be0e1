from __future__ import annotations

import errno
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvtier.cache.factory import build_cache
from kvtier.config import parse_config
from kvtier.errors import ConfigError, PoolError
from kvtier.keys import Namespace
from kvtier.pool import NAME_PREFIX, HostPool, PoolHandle, cleanup_stale_pools


def test_slots_are_independent_views(tmp_path):
    with HostPool.create(4, 1000, shm_dir=str(tmp_path)) as pool:
        assert pool.slot_stride % 256 == 0 and pool.slot_stride >= 1000
        for slot in range(4):
            pool.view(slot)[:] = bytes([slot + 1]) * 1000
        arr = pool.array()
        for slot in range(4):
            assert (arr[slot, :1000] == slot + 1).all()
            assert len(pool.view(slot)) == 1000


def test_alloc_and_free_are_exact(tmp_path):
    with HostPool.create(5, 64, shm_dir=str(tmp_path)) as pool:
        first = pool.alloc(3)
        second = pool.alloc(3)
        assert len(first) == 3 and len(second) == 2 and pool.num_free == 0
        assert sorted(first + second) == list(range(5))
        assert pool.alloc(1) == []
        pool.free(first)
        assert sorted(pool.alloc(10)) == sorted(first)


def _child_write(handle: PoolHandle, slot: int) -> None:
    pool = HostPool.attach(handle)
    pool.view(slot)[:4] = b"kvt!"
    arr = pool.array()
    arr[slot, 4:8] = np.frombuffer(b"ok!!", dtype=np.uint8)
    pool.close()


def test_other_process_writes_in_place_and_does_not_unlink(tmp_path):
    pool = HostPool.create(2, 64, shm_dir=str(tmp_path))
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_child_write, args=(pool.handle, 1))
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0
    assert bytes(pool.view(1)[:8]) == b"kvt!ok!!"
    assert Path(pool.handle.path).exists()  # an attached process closing never removes it
    pool.close()
    assert not Path(pool.handle.path).exists()


def test_clean_close_leaves_no_file(tmp_path):
    pool = HostPool.create(2, 64, shm_dir=str(tmp_path))
    path = Path(pool.handle.path)
    assert path.exists()
    pool.close()
    pool.close()
    assert list(tmp_path.iterdir()) == []
    assert not path.exists()


def test_pool_left_by_crashed_process_is_removed(tmp_path):
    code = (
        "import os, sys; from kvtier.pool import HostPool; "
        f"p = HostPool.create(2, 64, shm_dir={str(tmp_path)!r}, reap=False); "
        "print(p.handle.path, flush=True); os._exit(1)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    stale = Path(out.stdout.strip())
    assert stale.exists() and stale.name.startswith(NAME_PREFIX)
    live = HostPool.create(2, 64, shm_dir=str(tmp_path))  # creating a pool sweeps stale ones
    assert not stale.exists()
    assert Path(live.handle.path).exists()
    assert cleanup_stale_pools(str(tmp_path)) == []  # a live owner's pool is kept
    live.close()


def test_attach_errors_are_clear(tmp_path):
    with pytest.raises(PoolError, match="cannot attach"):
        HostPool.attach(PoolHandle(str(tmp_path / "missing"), 2, 64, 256))
    with HostPool.create(2, 64, shm_dir=str(tmp_path)) as pool:
        bigger = PoolHandle(pool.handle.path, 100, 64, 256)
        with pytest.raises(PoolError, match="smaller"):
            HostPool.attach(bigger)


def test_pool_too_big_for_tmpfs_fails_with_reason(tmp_path):
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    with pytest.raises(PoolError, match="does not fit"):
        HostPool.create(4, free, shm_dir=str(tmp_path))
    with pytest.raises(PoolError, match="> 0"):
        HostPool.create(0, 64, shm_dir=str(tmp_path))


def test_pool_memory_is_claimed_at_creation(tmp_path):
    """The file is not sparse: a tmpfs filling up later cannot fault the pool with SIGBUS."""
    with HostPool.create(8, 100_000, shm_dir=str(tmp_path)) as pool:
        st = os.stat(pool.handle.path)
        assert st.st_blocks * 512 >= pool.num_slots * pool.slot_stride


def test_pool_memory_claim_failing_is_a_clear_error(tmp_path, monkeypatch):
    def no_space(fd, offset, size):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(PoolError, match=r"cannot reserve .* No space left"):
        HostPool.create(4, 4096, shm_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_pool_on_a_filesystem_without_fallocate_is_created(tmp_path, monkeypatch):
    def unsupported(fd, offset, size):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    with HostPool.create(4, 4096, shm_dir=str(tmp_path)) as pool:
        assert pool.num_slots == 4  # its pages come on first touch instead


# -- hostile shm directories (issue 15, findings 1, 2 and 8) ------------------------------------

NOBODY = 65534


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A sticky world-writable directory like /dev/shm that other users can reach (pytest's
    tmp_path sits below a directory only root may enter)."""
    path = Path(tempfile.mkdtemp(prefix="kvtier-shm-test-", dir="/tmp"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path)


def _create_in_child(shm_dir: Path, as_user: int | None = None, timeout: float = 20) -> str:
    """Create and close a pool in a fresh process (optionally after dropping to ``as_user``);
    returns what it printed: ``ok``, or the exception's type and message."""
    drop = f"os.setgid({as_user}); os.setuid({as_user}); " if as_user is not None else ""
    code = (
        "import os\n"
        "from kvtier.pool import HostPool\n"
        f"{drop}\n"
        "try:\n"
        f"    HostPool.create(2, 64, shm_dir={str(shm_dir)!r}).close()\n"
        "    print('ok')\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_fifo_or_a_link_to_one_under_a_pool_name_does_not_block_creation(tmp_path):
    """Before: the sweep opened the FIFO and waited forever for a writer."""
    fifo = tmp_path / f"{NAME_PREFIX}planted"
    os.mkfifo(fifo)
    elsewhere = tmp_path / "fifo-elsewhere"
    os.mkfifo(elsewhere)
    link = tmp_path / f"{NAME_PREFIX}link"
    link.symlink_to(elsewhere)
    assert _create_in_child(tmp_path, timeout=20) == "ok"
    assert cleanup_stale_pools(str(tmp_path)) == []
    assert fifo.exists() and link.is_symlink()  # not ours to judge: left alone


def test_another_users_file_under_a_pool_name_is_left_alone(shared_dir):
    """Root could remove it (it did); a plain user got a raw PermissionError at start-up."""
    sticky = shared_dir
    foreign = sticky / f"{NAME_PREFIX}1-foreign"
    foreign.write_bytes(b"x")
    foreign.chmod(0o644)
    os.chown(foreign, NOBODY, NOBODY)
    assert cleanup_stale_pools(str(sticky)) == []
    assert foreign.exists()
    os.chown(foreign, 0, 0)  # now root's, seen by a plain user
    assert _create_in_child(sticky, as_user=NOBODY) == "ok"
    assert foreign.exists()


def test_the_sweep_removes_only_unlocked_pools_of_this_user(tmp_path):
    with HostPool.create(1, 64, shm_dir=str(tmp_path)) as live:
        stale = tmp_path / f"{NAME_PREFIX}1-stale"
        stale.write_bytes(b"")
        assert cleanup_stale_pools(str(tmp_path)) == [str(stale)]
        assert Path(live.handle.path).exists()
    assert cleanup_stale_pools(str(tmp_path / "missing")) == []  # never raises


def _create_and_check(shm_dir: str, seconds: float, queue: object) -> None:
    import time

    lost = created = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            pool = HostPool.create(1, 64, shm_dir=shm_dir)
        except Exception:
            lost += 1  # a sweep held the new file's lock before its creator did
            continue
        created += 1
        try:
            HostPool.attach(pool.handle).close()
        except PoolError:
            lost += 1  # another process's sweep deleted this live pool
        pool.close()
    queue.put((created, lost))  # type: ignore[attr-defined]


def _sweep(shm_dir: str, seconds: float, queue: object) -> None:
    import time

    end = time.monotonic() + seconds
    sweeps = 0
    while time.monotonic() < end:
        cleanup_stale_pools(shm_dir)
        sweeps += 1
    queue.put((sweeps, 0))  # type: ignore[attr-defined]


def test_concurrent_creators_never_delete_each_others_pools(tmp_path):
    """Before: a sweep between another process's create and its lock deleted a live pool (11 of
    8,000 creates); here two creators and two sweepers race for 4 s."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_create_and_check, args=(str(tmp_path), 4.0, queue))]
    procs += [ctx.Process(target=_sweep, args=(str(tmp_path), 4.0, queue)) for _ in range(2)]
    procs.append(ctx.Process(target=_create_and_check, args=(str(tmp_path), 4.0, queue)))
    for proc in procs:
        proc.start()
    results = [queue.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert sum(lost for _, lost in results) == 0
    assert sum(created for created, _ in results) > 500  # creates and sweeps really raced
    assert list(tmp_path.iterdir()) == []


def test_without_o_tmpfile_the_pool_is_locked_before_it_gets_its_name(tmp_path, monkeypatch):
    real_open = os.open
    seen: list[str] = []

    def no_tmpfile(path, flags, *args, **kwargs):
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))
        seen.append(str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", no_tmpfile)
    with HostPool.create(2, 64, shm_dir=str(tmp_path)) as pool:
        assert any(name.startswith(f".{NAME_PREFIX}") for name in seen)  # the scratch name
        assert [p.name for p in tmp_path.iterdir()] == [Path(pool.handle.path).name]
        assert cleanup_stale_pools(str(tmp_path)) == []  # its lock came with it
    assert list(tmp_path.iterdir()) == []


def test_an_unusable_shm_dir_is_a_config_error_naming_it(tmp_path, shared_dir):
    from kvtier.cache.factory import build_cache
    from kvtier.config import load_config
    from kvtier.errors import ConfigError
    from kvtier.keys import Namespace
    from kvtier.pool import ShmDirError

    ns = Namespace(model="m", dtype="float16", block_tokens=4)
    a_file = tmp_path / "file"
    a_file.write_bytes(b"")
    for bad in (a_file, tmp_path / "missing"):
        config = load_config({"pool": {"size": "64KiB", "shm_dir": str(bad)}})
        with pytest.raises(ConfigError, match=r"pool\.shm_dir") as err:
            build_cache(config, ns, 4096)
        assert err.value.field == "pool.shm_dir"
    read_only = shared_dir / "ro"
    read_only.mkdir()
    read_only.chmod(0o555)
    # root writes anywhere: a plain user sees the read-only directory
    out = _create_in_child(read_only, as_user=NOBODY)
    assert out.startswith(ShmDirError.__name__) and "Permission denied" in out
    assert list(read_only.iterdir()) == []


@pytest.mark.parametrize(("size", "slot_bytes"), [(1024 * 1024, 1000), (4096, 257), (1024, 1024)])
def test_a_pool_built_from_config_never_exceeds_pool_size(
    tmp_path: Path, namespace: Namespace, size: int, slot_bytes: int
) -> None:
    # Slots are aligned to 256 bytes: 1 MiB of 1000-byte slots once made 1048 slots of 1024
    # bytes, 1,073,152 bytes in all.
    config = parse_config({"pool": {"size": size, "shm_dir": str(tmp_path)}})
    pool, cache = build_cache(config, namespace, slot_bytes)
    try:
        assert pool.num_slots * pool.slot_stride <= size
        assert os.path.getsize(pool.handle.path) <= size
        assert pool.num_slots == size // pool.slot_stride  # and no slot is lost
    finally:
        cache.close()
        pool.close()


def test_a_pool_size_below_one_aligned_slot_names_the_field(
    tmp_path: Path, namespace: Namespace
) -> None:
    config = parse_config({"pool": {"size": 1000, "shm_dir": str(tmp_path)}})
    with pytest.raises(ConfigError) as info:
        build_cache(config, namespace, 1000)  # one slot takes 1024 bytes
    assert info.value.field == "pool.size"
