"""The pool's memory comes back when its last user is gone, SIGKILL included (``pool_reaper``).

Real processes, killed for real: a child creates (or attaches) a pool, prints its path and waits;
the test kills it and watches the file."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtier.errors import PoolError
from kvtier.pool import HostPool, hold_shared, unlink_if_last
from kvtier.pool_reaper import REAPER_CODE, Reaper

CREATE = (
    "import sys, time; from kvtier.pool import HostPool\n"
    "p = HostPool.create(4, 4096, shm_dir=sys.argv[1])\n"
    "print(p.handle.path, flush=True); time.sleep(600)\n"
)
ATTACH = (
    "import sys, time; from kvtier.pool import HostPool, PoolHandle\n"
    "p = HostPool.attach(PoolHandle(sys.argv[1], 4, 4096, 4096))\n"
    "print('attached', flush=True); time.sleep(600)\n"
)


def _child(code: str, arg: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", code, arg], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    assert line, "the child printed nothing"
    return proc, line


def _kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def _gone_within(path: Path, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not path.exists():
            return True
        time.sleep(0.02)
    return not path.exists()


def test_a_pool_whose_owner_is_killed_is_removed_at_once(tmp_path):
    """Before: the file (the pool's full size of RAM) stayed until the next kvtier start."""
    proc, path = _child(CREATE, str(tmp_path))
    assert Path(path).exists()
    _kill(proc)
    assert _gone_within(Path(path), 10.0)
    assert list(tmp_path.iterdir()) == []


def test_the_pool_stays_while_an_attached_process_lives(tmp_path):
    owner, path = _child(CREATE, str(tmp_path))
    worker, _ = _child(ATTACH, path)
    _kill(owner)
    assert not _gone_within(Path(path), 0.5)  # the worker still maps it
    _kill(worker)
    assert _gone_within(Path(path), 10.0)


def test_a_clean_close_removes_the_file_and_stops_the_reaper(tmp_path):
    pool = HostPool.create(2, 64, shm_dir=str(tmp_path))
    reaper = pool._reaper
    assert reaper is not None and reaper.pid is not None
    pid = reaper.pid
    pool.close()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and collected: no process, no zombie


def test_a_reaper_that_cannot_start_leaves_the_sweep_as_fallback(tmp_path, monkeypatch, caplog):
    def no_processes(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "Popen", no_processes)
    with HostPool.create(2, 64, shm_dir=str(tmp_path)) as pool:
        assert pool._reaper is not None and pool._reaper.pid is None
    assert "no reaper" in caplog.text
    assert list(tmp_path.iterdir()) == []
    Reaper(None).stop()  # nothing to stop


def test_the_reaper_leaves_a_file_that_replaced_its_own(tmp_path):
    path = tmp_path / "kvtier-pool-x"
    path.write_bytes(b"a")
    fd = os.open(path, os.O_RDONLY)
    reaper = Reaper.start(str(path), fd)
    os.close(fd)
    time.sleep(0.3)  # the reaper got the lock (nobody holds one) and unlinked its file
    assert not path.exists()
    path.write_bytes(b"b")  # another file under the same name
    fd = os.open(path, os.O_RDONLY)
    st = os.fstat(fd)
    os.close(fd)
    # a reaper told of another inode leaves this one alone
    argv = [sys.executable, "-I", "-S", "-c", REAPER_CODE, str(path), str(st.st_dev)]
    proc = subprocess.run([*argv, str(st.st_ino + 1)], timeout=30, check=False)
    assert proc.returncode == 0 and path.exists()
    reaper.stop()


def test_attaching_a_pool_being_removed_is_a_clear_error(tmp_path):
    with HostPool.create(2, 64, shm_dir=str(tmp_path)) as pool:
        path = pool.handle.path
        remover = os.open(path, os.O_RDONLY)
        fcntl.flock(pool._fd, fcntl.LOCK_UN)  # as if the owner were gone ...
        fcntl.flock(remover, fcntl.LOCK_EX)  # ... and a reaper had the lock
        with pytest.raises(PoolError, match="being removed"):
            HostPool.attach(pool.handle)
        os.close(remover)
        fcntl.flock(pool._fd, fcntl.LOCK_SH)
        fd = os.open(path, os.O_RDONLY)
        os.rename(path, path + ".moved")
        with pytest.raises(PoolError, match="was removed"):
            hold_shared(fd, path)
        Path(path).write_bytes(b"")  # another file under the name
        with pytest.raises(PoolError, match="another file"):
            hold_shared(fd, path)
        os.close(fd)
        os.rename(path + ".moved", path)


def test_the_last_user_out_removes_a_shared_file(tmp_path):
    path = tmp_path / "kvtier-pool-share"
    path.write_bytes(b"x")
    first, second = os.open(path, os.O_RDONLY), os.open(path, os.O_RDONLY)
    hold_shared(first, str(path))
    hold_shared(second, str(path))
    assert not unlink_if_last(first, str(path))  # the second still holds it
    fcntl.flock(first, fcntl.LOCK_SH)
    os.close(first)
    assert unlink_if_last(second, str(path))
    assert not path.exists()
    assert not unlink_if_last(second, str(path))  # the name is gone
    os.close(second)
