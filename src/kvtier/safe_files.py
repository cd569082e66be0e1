"""The one way kvtier opens a file by name (stats snapshots, traces and their salts, config
files, CLI inputs).

Such a path may sit in a directory that other users can write to, or be a name a user typed, so:

- Only a regular file is opened for I/O. The last component is never followed if it is a symbolic
  link (``O_NOFOLLOW``), and a FIFO, device, socket or directory is refused: ``lstat`` first, so a
  device is not even opened, then ``O_NONBLOCK`` so a FIFO swapped in meanwhile cannot block the
  open, then ``fstat`` on the descriptor. Nothing here ever waits on another process.
- Reads are bounded: a file (or a line) over the caller's limit is a ``FileRefused`` error, never
  a ``MemoryError``.
- Writes are private (0600 unless the caller says otherwise, whatever the umask), atomic (a temp
  file of a random name in the same directory, created with ``O_EXCL | O_NOFOLLOW``, then renamed
  or linked into place: a reader sees the old file or the whole new one, and a name another user
  planted next to the target is never written through) and bounded.

Errors are ``OSError`` (``FileRefused`` for what this module refuses), so a caller's ``except
OSError`` covers them; ``strerror`` says what was wrong in a few words.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
from collections.abc import Generator
from pathlib import Path

PRIVATE_MODE = 0o600
_NO_FOLLOW = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_CREATE_TEMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_CHUNK = 1 << 20
_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)

StrPath = str | os.PathLike[str]


class FileRefused(OSError):
    """A path this module will not use: not a regular file, a symbolic link, too large."""


class LineTooLong(FileRefused):
    """A line over the caller's bound (``lineno`` counts from 1)."""

    def __init__(self, path: str, lineno: int, max_bytes: int) -> None:
        super().__init__(errno.EFBIG, f"line {lineno} is longer than {max_bytes} bytes", path)
        self.lineno = lineno


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def _refuse(path: str, mode: int) -> FileRefused:
    kind = _kind(mode)
    code = errno.ELOOP if kind == "a symbolic link" else errno.EINVAL
    return FileRefused(code, f"not a regular file ({kind})", path)


def open_regular(path: StrPath, flags: int = os.O_RDONLY, mode: int = PRIVATE_MODE) -> int:
    """A blocking descriptor of the regular file at ``path`` (created with ``mode`` when
    ``flags`` has ``O_CREAT``). Raises ``FileRefused`` for anything else, OSError as the calls
    do; never blocks."""
    name = os.fspath(path)
    with contextlib.suppress(FileNotFoundError):
        before = os.lstat(name)
        if not stat.S_ISREG(before.st_mode):
            raise _refuse(name, before.st_mode)  # never opened: a device may act on open
    try:
        fd = os.open(name, flags | _NO_FOLLOW, mode)
    except OSError as exc:
        # Swapped in after the lstat: ELOOP a link, ENXIO a FIFO without a reader (write-only).
        if exc.errno == errno.ELOOP:
            raise FileRefused(errno.ELOOP, "not a regular file (a symbolic link)", name) from None
        if exc.errno in (errno.ENXIO, errno.EISDIR):
            raise FileRefused(errno.EINVAL, "not a regular file", name) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(name, st.st_mode)
        # Regular files ignore O_NONBLOCK on Linux; cleared anyway so no read sees EAGAIN.
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _too_large(path: str, max_bytes: int) -> FileRefused:
    return FileRefused(errno.EFBIG, f"larger than {max_bytes} bytes", path)


def read_bytes(path: StrPath, max_bytes: int) -> bytes:
    """The whole regular file, at most ``max_bytes`` of it (``FileRefused`` if longer)."""
    name = os.fspath(path)
    fd = open_regular(name)
    try:
        if os.fstat(fd).st_size > max_bytes:
            raise _too_large(name, max_bytes)
        chunks: list[bytes] = []
        total = 0
        # Read to the end whatever st_size said (it may grow, or be 0 as in /proc).
        while chunk := os.read(fd, min(_READ_CHUNK, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise _too_large(name, max_bytes)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: StrPath, max_bytes: int, encoding: str = "utf-8") -> str:
    """``read_bytes`` decoded (``UnicodeDecodeError`` for bytes that are not ``encoding``)."""
    return read_bytes(path, max_bytes).decode(encoding)


def iter_lines(path: StrPath, max_line_bytes: int) -> Generator[bytes, None, None]:
    """The file's lines (bytes, with their newline), each at most ``max_line_bytes`` long
    (``LineTooLong`` names the first longer one). Opened at the first ``next()``."""
    name = os.fspath(path)
    with os.fdopen(open_regular(name), "rb") as handle:
        lineno = 0
        while line := handle.readline(max_line_bytes + 1):
            lineno += 1
            if len(line) > max_line_bytes:
                raise LineTooLong(name, lineno, max_line_bytes)
            yield line


def _write_temp(target: Path, data: bytes, max_bytes: int, mode: int, fsync: bool) -> Path:
    """``data`` in a new private file next to ``target``: the name is random and created with
    ``O_EXCL``, so nothing another user planted (a ``.tmp`` link, a FIFO) is ever opened."""
    if len(data) > max_bytes:
        raise FileRefused(errno.EFBIG, f"{len(data)} bytes to write, over {max_bytes}", str(target))
    # A name of at most 255 bytes whatever the target's length.
    temp = target.with_name(f".{target.name[:200]}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temp, _CREATE_TEMP, mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have masked bits off
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return temp


def write_atomic(
    path: StrPath, data: bytes, max_bytes: int, mode: int = PRIVATE_MODE, fsync: bool = False
) -> None:
    """Replace ``path`` with a file holding ``data``: whatever was there before (a file, a
    planted link or FIFO) is replaced by the rename, never written through or opened."""
    target = Path(path)
    temp = _write_temp(target, data, max_bytes, mode, fsync)
    try:
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise


def create_new(
    path: StrPath, data: bytes, max_bytes: int, mode: int = PRIVATE_MODE, fsync: bool = True
) -> None:
    """Create ``path`` holding ``data``, whole or not at all: ``FileExistsError`` if anything
    (even a dangling link) has the name. A failed write (a full disk) leaves nothing behind."""
    target = Path(path)
    temp = _write_temp(target, data, max_bytes, mode, fsync)
    try:
        os.link(temp, target, follow_symlinks=False)  # atomic, and never replaces anything
    finally:
        with contextlib.suppress(OSError):
            os.unlink(temp)


def open_append(path: StrPath, mode: int = PRIVATE_MODE) -> int:
    """A descriptor appending to the regular file at ``path``, created with ``mode`` if
    missing (an existing file keeps its mode)."""
    return open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
