from __future__ import annotations

import errno
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvtier.errors import PoolError
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
        f"p = HostPool.create(2, 64, shm_dir={str(tmp_path)!r}); "
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
