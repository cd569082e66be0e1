"""``kvtier.safe_files``: the one way kvtier opens a file by name refuses what is not a regular
file without blocking, bounds what it reads, and writes privately and atomically through names
nobody else can plant."""

from __future__ import annotations

import errno
import os
import socket
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier import safe_files
from kvtier.safe_files import FileRefused, LineTooLong


def in_time(fn: Callable[[], object], seconds: float = 5.0) -> object:
    """``fn()`` on a thread that must finish within ``seconds`` (a blocked open fails the test
    instead of hanging it; the daemon thread is left behind)."""
    out: list[object] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # handed to the test
            out.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "blocked"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def hostile(tmp_path: Path) -> dict[str, Path]:
    """One of each thing that is not a regular file."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    target = tmp_path / "target"
    target.write_text("secret")
    link = tmp_path / "link"
    link.symlink_to(target)
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    (tmp_path / "dir").mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    return {
        "fifo": fifo,
        "link": link,
        "dangling": dangling,
        "dir": tmp_path / "dir",
        "socket": tmp_path / "sock",
        "device": Path("/dev/zero"),
        "link to a device": _link(tmp_path / "zero", "/dev/zero"),
    }


def _link(path: Path, target: str) -> Path:
    path.symlink_to(target)
    return path


@pytest.mark.parametrize("how", ["read_bytes", "iter_lines", "open_append", "open_regular"])
def test_nothing_but_a_regular_file_is_opened_and_nothing_blocks(tmp_path: Path, how: str) -> None:
    calls: dict[str, Callable[[Path], object]] = {
        "read_bytes": lambda p: safe_files.read_bytes(p, 100),
        "iter_lines": lambda p: list(safe_files.iter_lines(p, 100)),
        "open_append": safe_files.open_append,
        "open_regular": safe_files.open_regular,
    }
    for kind, path in hostile(tmp_path).items():
        with pytest.raises(FileRefused, match="not a regular file") as info:
            in_time(lambda p=path: calls[how](p))  # type: ignore[misc]
        assert info.value.filename == str(path), kind
    assert (tmp_path / "target").read_text() == "secret"


def test_a_fifo_swapped_in_after_the_check_is_refused_without_blocking(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "f"
    path.write_text("x")
    real_lstat = os.lstat

    def lstat_then_swap(name: str) -> os.stat_result:
        st = real_lstat(name)
        os.unlink(name)
        os.mkfifo(name)
        return st

    monkeypatch.setattr(os, "lstat", lstat_then_swap)
    with pytest.raises(FileRefused, match="a FIFO"):
        in_time(lambda: safe_files.read_bytes(path, 10))


def test_reads_are_bounded(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"a" * 100)
    assert safe_files.read_bytes(path, 100) == b"a" * 100
    with pytest.raises(FileRefused, match="larger than 99 bytes") as info:
        safe_files.read_bytes(path, 99)
    assert info.value.errno == errno.EFBIG
    # A file whose size says 0 (procfs) is still read to its end, and bounded.
    assert b"MemTotal" in safe_files.read_bytes("/proc/meminfo", 1 << 20)
    with pytest.raises(FileRefused, match="larger than 10 bytes"):
        safe_files.read_bytes("/proc/meminfo", 10)


def test_lines_are_bounded_each_and_named(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"12345\n" + b"1234\n" + b"x" * 6 + b"\nlast")
    lines = safe_files.iter_lines(path, 6)
    assert next(lines) == b"12345\n" and next(lines) == b"1234\n"
    with pytest.raises(LineTooLong, match="line 3 is longer than 6 bytes") as info:
        next(lines)
    assert info.value.lineno == 3
    assert list(safe_files.iter_lines(path, 7))[-1] == b"last"


def test_writes_are_private_atomic_and_bounded(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        path = tmp_path / "stats.json"
        safe_files.write_atomic(path, b"one", 10)
        assert path.read_bytes() == b"one"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        safe_files.write_atomic(path, b"two", 10, fsync=True)
        assert path.read_bytes() == b"two"
        with pytest.raises(FileRefused, match="11 bytes to write, over 10"):
            safe_files.write_atomic(path, b"x" * 11, 10)
        assert path.read_bytes() == b"two"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["stats.json"]  # no temp left
    finally:
        os.umask(old)


def test_planted_names_are_replaced_never_written_through(tmp_path: Path) -> None:
    target = tmp_path / "victim"
    target.write_text("keep")
    path = tmp_path / "stats.json"
    # Whatever sits at the old fixed temp name or at the path itself is never opened.
    (tmp_path / "stats.json.tmp").symlink_to(target)
    os.mkfifo(tmp_path / ".stats.json.tmp")
    path.symlink_to(target)
    in_time(lambda: safe_files.write_atomic(path, b"new", 10))
    assert target.read_text() == "keep"
    assert not path.is_symlink() and path.read_bytes() == b"new"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    in_time(lambda: safe_files.write_atomic(fifo, b"new", 10))
    assert fifo.read_bytes() == b"new"


def test_create_new_is_whole_or_nothing_and_never_replaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "salt"
    safe_files.create_new(path, b"first", 10)
    with pytest.raises(FileExistsError):
        safe_files.create_new(path, b"second", 10)
    assert path.read_bytes() == b"first"
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(FileExistsError):
        safe_files.create_new(dangling, b"x", 10)
    assert not (tmp_path / "nowhere").exists()

    def full_disk(fd: int, data: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError, match="No space"):
        safe_files.create_new(tmp_path / "new", b"x", 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "salt"]


def test_append_creates_a_private_file_and_appends(tmp_path: Path) -> None:
    path = tmp_path / "trace"
    for text in (b"a\n", b"b\n"):
        fd = safe_files.open_append(path)
        os.write(fd, text)
        os.close(fd)
    assert path.read_bytes() == b"a\nb\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
