"""The fs tier's file primitives, safe in a directory that others can write to.

Every file is reached relative to a directory descriptor and opened with ``O_NOFOLLOW``, so a
symbolic link below the tier's root is never followed (a link where a shard directory or a block
file should be is refused, and removing a block removes the link itself, never its target).
Nothing but a regular file is opened for I/O: ``lstat`` first, then ``O_NONBLOCK`` and ``fstat``
(a FIFO swapped in between cannot block a thread). Files are written to a temp name created with
``O_EXCL`` and renamed into place (a reader sees a whole block or nothing); modes are set with
``fchmod`` whatever the umask.

Few system calls per block (a write makes five, a read five): each one hands Python's GIL back
and forth, and the engine's thread waits for it whenever an I/O thread holds it (docs/vllm.md,
*The engine's thread with an fs tier*). So shard directories stay open once opened (256 at
most; ``close`` closes them), and the process id in temp names is read once per process.

The byte movers (``write_all``, ``read_exact``) and ``unlink`` are module functions looked up at
call time, so tests can inject faults and meters there.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import hashlib
import itertools
import logging
import os
import socket
import stat
import time

from kvtier.errors import ConfigError
from kvtier.keys import KEY_BYTES, BlockKey
from kvtier.redaction import printable
from kvtier.tiers.iovec import advance

log = logging.getLogger(__name__)

BLOCK_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
STALE_TMP_S = 3600.0
"""A temp file this old is a crash leftover even if we cannot tell whether its writer lives."""
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""A write failed because the filesystem (or the user's quota) is full."""
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_HEX = frozenset("0123456789abcdef")
_probe_ids = itertools.count()
_pid = [os.getpid()]
os.register_at_fork(after_in_child=lambda: _pid.__setitem__(0, os.getpid()))

Found = tuple[BlockKey, int, float]
"""(key, size, mtime) of a block file found by a scan."""


class Read(enum.Enum):
    """What reading a block file found (``BlockFiles.read``)."""

    FOUND = 0
    """The buffers are filled (the caller checks the header and checksum)."""
    MISSING = 1
    """No such file (another process sharing the directory deleted it)."""
    NOT_REGULAR = 2
    """A FIFO, device, directory or symbolic link where the block should be."""
    DAMAGED = 3
    """A file of the wrong size, or shorter than it said."""
    FAILED = 4
    """An I/O error."""


class NotRegular(OSError):
    """A path where a block file should be holds something else (a link, a FIFO, a directory)."""


def names(key: BlockKey) -> tuple[str, str]:
    """(shard directory, file name) of a key, each relative to its parent. From the key's bytes
    only (hex), so no user string ever reaches a path."""
    name = key.hex()
    return name[:2], name + BLOCK_SUFFIX


def open_root(path: str, root: str, dir_mode: int, file_mode: int, field: str, tier: str) -> int:
    """Create ``path`` (missing components get ``dir_mode``; existing ones are the admin's and
    may be links) and ``root`` below it, which must be a real directory; return a descriptor of
    ``root``. Writability is tried with an empty probe file, which a full disk does not fail
    (logged for ``tier``). ``ConfigError`` for ``field`` when it is not a writable directory."""
    probe = f".probe.{host_tag()}.{os.getpid()}.{next(_probe_ids)}"
    fd = -1
    try:
        make_dirs(path, dir_mode)
        try:
            os.mkdir(root, dir_mode)
            created = True
        except FileExistsError:
            created = False
        fd = os.open(root, DIR_FLAGS)
        st = os.fstat(fd)
        if created or (st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & ~dir_mode):
            # Ours: private (or as configured) whatever the umask, and stores written with
            # looser modes by older versions are closed to others here.
            os.fchmod(fd, dir_mode)
        try:
            os.close(os.open(probe, _CREATE, file_mode, dir_fd=fd))
            os.unlink(probe, dir_fd=fd)
        except OSError as exc:
            if exc.errno not in FULL_ERRNOS:
                raise
            log.warning("fs tier %s: %s is full (%s)", tier, printable(root), exc.strerror)
    except OSError as exc:
        if fd >= 0:
            os.close(fd)
        reason = exc.strerror or str(exc)
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and fd < 0:
            reason += f"; {root} must be a directory, not a symbolic link"
        raise ConfigError(field, path, f"a writable directory ({reason})") from exc
    return fd


class BlockFiles:
    """The block files of one namespace directory (``<root>/<shard>/<key hex>.kvb``), reached
    through the directory's descriptor ``root_fd`` (owned by the caller)."""

    def __init__(self, root_fd: int, file_mode: int, dir_mode: int, fsync: bool) -> None:
        self.root_fd = root_fd
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self.fsync = fsync
        self.host = host_tag()
        self._tmp_ids = itertools.count()
        self._shards: dict[str, int] = {}
        """Open shard directories by name (set once; a race opens one twice and closes one)."""

    def close(self) -> None:
        """Close the shard directories (not ``root_fd``: the caller's)."""
        shards, self._shards = self._shards, {}
        for fd in shards.values():
            with contextlib.suppress(OSError):
                os.close(fd)

    def _shard(self, name: str, create: bool) -> int:
        """The shard directory's descriptor, kept open. ``create``: made if missing; else
        FileNotFoundError. NotRegular when a link or a file sits in its place."""
        fd = self._shards.get(name)
        if fd is not None:
            return fd
        try:
            fd = self._open_shard(name) if create else os.open(name, DIR_FLAGS, dir_fd=self.root_fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise NotRegular(name) from exc
            raise
        kept = self._shards.setdefault(name, fd)
        if kept != fd:
            os.close(fd)  # another thread opened it first
        return kept

    def _open_regular(self, key: BlockKey) -> tuple[int, int]:
        """(descriptor, size) of the key's block file, read-only. Raises ``NotRegular`` for
        anything but a regular file (nothing else is opened; a FIFO swapped in between the check
        and the open is opened non-blocking and refused), OSError as the calls do.
        ``O_NONBLOCK`` stays set: regular files ignore it on Linux, and a read that saw EAGAIN
        would fail the block, never return a wrong one."""
        shard_name, name = names(key)
        shard = self._shard(shard_name, create=False)
        if not stat.S_ISREG(os.stat(name, dir_fd=shard, follow_symlinks=False).st_mode):
            raise NotRegular(name)
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, dir_fd=shard)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise NotRegular(name) from exc
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise NotRegular(name)
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size

    def read(self, key: BlockKey, buffers: list[memoryview], size: int) -> Read:
        """Fill ``buffers`` from the key's block file, which must be ``size`` bytes (checked
        before reading: a truncated or grown file is not read)."""
        try:
            fd, found = self._open_regular(key)
        except FileNotFoundError:
            return Read.MISSING
        except NotRegular:
            return Read.NOT_REGULAR
        except OSError:
            return Read.FAILED
        try:
            if found != size:
                return Read.DAMAGED
            return Read.FOUND if read_exact(fd, buffers) else Read.DAMAGED
        except OSError:
            return Read.FAILED
        finally:
            os.close(fd)

    def write(self, key: BlockKey, buffers: list[memoryview]) -> None:
        """Temp file (created exclusively, never through a link), optional fsync, atomic rename:
        readers see the whole block or nothing. Raises OSError (the temp file is removed)."""
        shard_name, final = names(key)
        tmp = f"{final[: -len(BLOCK_SUFFIX)]}.{self.host}.{_pid[0]}.{next(self._tmp_ids)}"
        tmp += TMP_SUFFIX
        shard = self._shard(shard_name, create=True)
        fd = os.open(tmp, _CREATE, self.file_mode, dir_fd=shard)
        try:
            try:
                os.fchmod(fd, self.file_mode)  # the umask may have masked bits off
                write_all(fd, buffers)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final, src_dir_fd=shard, dst_dir_fd=shard)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=shard)
            raise
        if self.fsync:
            os.fsync(shard)

    def remove(self, key: BlockKey, stale_temps: bool = False) -> bool:
        """Remove the key's file (never what a link there points to); True when it is gone.
        ``stale_temps``: its temp files whose writer is dead too (``_stale_tmp``: what a writer
        killed mid-write left)."""
        shard_name, name = names(key)
        try:
            shard = self._shard(shard_name, create=False)
        except (FileNotFoundError, NotRegular):
            return True  # no shard, or a link or a file in its place: nothing of ours is there
        except OSError:
            return False
        if stale_temps:
            self._remove_stale_temps(shard, name[: -len(BLOCK_SUFFIX)] + ".")
        return unlink(name, shard)

    def _remove_stale_temps(self, shard: int, prefix: str) -> None:
        now = time.time()
        temps: list[os.DirEntry[str]] = []
        with contextlib.suppress(OSError), os.scandir(shard) as listing:
            temps = [e for e in listing if e.name.startswith(prefix)]
        for entry in temps:
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                stale = self._stale_tmp(entry.name, st.st_mtime, now)
                if entry.name.endswith(TMP_SUFFIX) and stale:
                    unlink(entry.name, shard)

    def scan(self) -> list[Found]:
        """(key, size, mtime) of every block file under the namespace directory; removes stale
        temp files on the way. Files that do not look like ours are left alone; links, FIFOs and
        other non-regular files are neither followed nor listed."""
        found: list[Found] = []
        now = time.time()
        try:
            with os.scandir(self.root_fd) as listing:
                shards = [
                    e.name
                    for e in listing
                    if len(e.name) == 2 and set(e.name) <= _HEX and e.is_dir(follow_symlinks=False)
                ]
        except OSError:
            return found
        for shard_name in shards:
            try:
                shard = os.open(shard_name, DIR_FLAGS, dir_fd=self.root_fd)
            except OSError:
                continue  # gone, or replaced by a link since the listing
            try:
                self._scan_shard(shard, shard_name, found, now)
            finally:
                os.close(shard)
        return found

    def _scan_shard(self, shard: int, shard_name: str, found: list[Found], now: float) -> None:
        try:
            with os.scandir(shard) as listing:
                entries = list(listing)
        except OSError:
            return
        for entry in entries:
            name = entry.name
            try:
                if name.endswith(BLOCK_SUFFIX):
                    stem = name[: -len(BLOCK_SUFFIX)]
                    if (
                        len(stem) == 2 * KEY_BYTES
                        and set(stem) <= _HEX
                        and stem[:2] == shard_name
                        and entry.is_file(follow_symlinks=False)
                    ):
                        st = entry.stat(follow_symlinks=False)
                        found.append((bytes.fromhex(stem), st.st_size, st.st_mtime))
                elif (
                    name.endswith(TMP_SUFFIX)
                    and entry.is_file(follow_symlinks=False)
                    and self._stale_tmp(name, entry.stat(follow_symlinks=False).st_mtime, now)
                ):
                    unlink(name, shard)
            except OSError:
                continue  # vanished while we looked (another process): skip it

    def _stale_tmp(self, name: str, mtime: float, now: float) -> bool:
        """A temp file of a dead writer on this host, or one too old to belong to a live write.
        A live peer's temp file on a shared filesystem must survive, or its rename would fail."""
        parts = name.split(".")  # <key hex>.<host>.<pid>.<n>.tmp
        if len(parts) == 5 and parts[1] == self.host and parts[2].isdigit():
            pid = int(parts[2])
            if pid != os.getpid() and not pid_alive(pid):
                return True
        return now - mtime > STALE_TMP_S

    def _open_shard(self, name: str) -> int:
        """A descriptor of a shard directory, created (``dir_mode``) if missing; OSError (ELOOP,
        ENOTDIR) when something else, a symbolic link say, sits in its place."""
        try:
            return os.open(name, DIR_FLAGS, dir_fd=self.root_fd)
        except FileNotFoundError:
            pass
        created = True
        try:
            os.mkdir(name, self.dir_mode, dir_fd=self.root_fd)
        except FileExistsError:  # a concurrent writer (here or in a peer) made it first
            created = False
        fd = os.open(name, DIR_FLAGS, dir_fd=self.root_fd)
        if created:
            try:
                os.fchmod(fd, self.dir_mode)
                if self.fsync:
                    os.fsync(self.root_fd)
            except BaseException:
                os.close(fd)
                raise
        return fd


def make_dirs(path: str, mode: int) -> None:
    """``os.makedirs`` that gives every directory it creates ``mode`` whatever the umask (and
    never changes one that exists)."""
    missing: list[str] = []
    head = os.path.abspath(path)
    while not os.path.lexists(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, mode)
        except FileExistsError:
            continue  # made by someone else meanwhile: theirs, left as it is
        fd = os.open(directory, DIR_FLAGS)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)


def write_all(fd: int, buffers: list[memoryview]) -> None:
    """writev until every byte is written (one syscall in the common case)."""
    pending = [b.cast("B") for b in buffers if b.nbytes]
    while pending:
        n = os.writev(fd, pending)
        if n <= 0:
            raise OSError("writev wrote nothing")
        advance(pending, n)


def read_exact(fd: int, buffers: list[memoryview]) -> bool:
    """readv until every buffer is full; False when the file ends first."""
    pending = [b.cast("B") for b in buffers if b.nbytes]
    while pending:
        n = os.readv(fd, pending)
        if n <= 0:
            return False
        advance(pending, n)
    return True


def unlink(name: str, dir_fd: int) -> bool:
    """Remove ``name`` in the directory ``dir_fd`` (a link itself, never its target); True when
    it is gone (removed, or already missing)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def host_tag() -> str:
    # Hashed: a host name may hold characters we do not want in file names.
    return hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()
