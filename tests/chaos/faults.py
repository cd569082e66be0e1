"""Real faults for the chaos soak: a TCP proxy that slows, trickles and cuts Redis traffic, a
second writer process killed with SIGKILL, block files corrupted or replaced by FIFOs and symlinks,
and a filesystem filled to the last byte.

Each injector only does things a broken machine or a hostile local user could do; none of them
reaches into kvtier's objects.
"""

from __future__ import annotations

import contextlib
import enum
import os
import random
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

HEADER_BYTES = 64
"""Every block file and Redis value starts with kvtier's 64-byte payload header."""


class ProxyMode(enum.Enum):
    PASS = "pass"
    SLOW = "slow"
    """Every chunk waits ``slow_s`` before it is forwarded."""
    TRICKLE = "trickle"
    """Replies are forwarded one byte at a time, ``trickle_s`` apart."""


class ChaosProxy:
    """A loopback TCP proxy in front of a Redis server whose behaviour the soak switches."""

    def __init__(self, target_port: int, slow_s: float = 0.2, trickle_s: float = 0.05) -> None:
        self.target_port = target_port
        self.slow_s = slow_s
        self.trickle_s = trickle_s
        self.mode = ProxyMode.PASS
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._closed = False
        threading.Thread(target=self._accept, name="chaos-proxy", daemon=True).start()

    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def reset(self) -> int:
        """Cut every open connection (both sides); returns how many were cut."""
        with self._lock:
            sockets = list(self._sockets)
            self._sockets.clear()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        return len(sockets) // 2

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        self.reset()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=1.0)
                server.settimeout(None)
            except OSError:
                client.close()  # the server is down: the client sees a closed connection
                continue
            with self._lock:
                self._sockets.update((client, server))
            for src, dst, reply in ((client, server, False), (server, client, True)):
                threading.Thread(
                    target=self._pump, args=(src, dst, reply), name="chaos-pump", daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, reply: bool) -> None:
        try:
            while not self._closed:
                ready, _, _ = select.select([src], [], [], 0.5)
                if not ready:
                    continue
                data = src.recv(65536)
                if not data:
                    break
                mode = self.mode
                if mode is ProxyMode.SLOW:
                    time.sleep(self.slow_s)
                if mode is ProxyMode.TRICKLE and reply:
                    for i in range(len(data)):
                        if self.mode is not ProxyMode.TRICKLE:
                            dst.sendall(data[i:])
                            break
                        dst.sendall(data[i : i + 1])
                        time.sleep(self.trickle_s)
                else:
                    dst.sendall(data)
        except (OSError, ValueError):  # ValueError: reset() closed the socket under select()
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.close()
            with self._lock:
                self._sockets.discard(src)
                self._sockets.discard(dst)


def block_files(root: Path) -> list[Path]:
    """Regular block files under ``root``, found without following symlinks."""
    found: list[Path] = []
    for directory, _, names in os.walk(root, followlinks=False):
        for name in names:
            path = Path(directory, name)
            if name.endswith(".kvb") and path.is_file() and not path.is_symlink():
                found.append(path)
    return found


class FileFault(enum.Enum):
    FLIP_BYTE = "flip a payload byte"
    FLIP_HEADER = "flip a header byte"
    TRUNCATE = "truncate"
    SWAP = "copy another block's file over it"
    FIFO = "replace with a FIFO"
    SYMLINK_BLOCK = "replace with a symlink to another block"
    SYMLINK_OUTSIDE = "replace with a symlink outside the tier"
    SHARD_SYMLINK = "replace a shard directory with a symlink"


def inject_file_fault(
    root: Path, fault: FileFault, rng: random.Random, outside: Path, wanted: list[Path]
) -> bool:
    """Apply ``fault`` to a block file under ``root``, preferably one of ``wanted`` (blocks that
    requests about to come will read); False when there was none to hit (or it vanished
    meanwhile: the tier deletes files while we pick)."""
    files = block_files(root)
    if len(files) < 2:
        return False
    present = [path for path in wanted if path.is_file() and not path.is_symlink()]
    target = rng.choice(present) if present else rng.choice(files)
    other = rng.choice([path for path in files if path != target])
    try:
        if fault in (FileFault.FLIP_BYTE, FileFault.FLIP_HEADER):
            size = target.stat().st_size
            low, high = (HEADER_BYTES, size - 1) if fault is FileFault.FLIP_BYTE else (0, 63)
            if high < low:
                return False
            offset = rng.randint(low, high)
            with open(target, "r+b") as f:
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
        elif fault is FileFault.TRUNCATE:
            size = target.stat().st_size
            os.truncate(target, rng.randrange(max(size, 1)))
        elif fault is FileFault.SWAP:
            data = other.read_bytes()
            target.write_bytes(data)
        elif fault is FileFault.FIFO:
            target.unlink()
            os.mkfifo(target)
        elif fault is FileFault.SYMLINK_BLOCK:
            target.unlink()
            target.symlink_to(other)
        elif fault is FileFault.SYMLINK_OUTSIDE:
            target.unlink()
            target.symlink_to(outside)
        elif fault is FileFault.SHARD_SYMLINK:
            shard = target.parent
            moved = shard.with_name(shard.name + ".moved")
            if moved.exists():
                return False
            shard.rename(moved)
            try:
                shard.symlink_to(moved, target_is_directory=True)
            except FileExistsError:
                return False  # the tier made the shard again in between: a shard lost, no link
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return False
    return True


class DiskFiller:
    """Fills the filesystem of ``directory`` with one ballast file until ENOSPC."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "ballast.chaos"
        self.filled_bytes = 0

    def fill(self) -> int:
        chunk = b"\0" * (64 * 1024)
        written = 0
        with contextlib.suppress(OSError), open(self.path, "ab") as f:
            while True:
                written += f.write(chunk)
                f.flush()
        # Top up byte-sized leftovers that a 64 KiB chunk did not fit into.
        with contextlib.suppress(OSError), open(self.path, "ab", buffering=0) as f:
            while f.write(b"\0" * 512):
                written += 512
        self.filled_bytes = written
        return written

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


WRITER_CODE = """
import random, sys, time
from kvtier.keys import Namespace, keys_from_hashes
from kvtier.pool import HostPool
from kvtier.tiers.base import TierJobKind, TierJob
from kvtier.tiers.fs.tier import FsTier, Options

path, ns_model = sys.argv[1], sys.argv[2]
slot_bytes, capacity, seed = (int(arg) for arg in sys.argv[3:6])
ids = [int(x) for x in sys.stdin.read().split()]
namespace = Namespace(model=ns_model, dtype="simulated", block_tokens=512, tenant="default")
keys = keys_from_hashes(namespace, ids)
pool = HostPool.create(32, slot_bytes)
tier = FsTier("writer", namespace, pool, Options(path=path, capacity=capacity))
rng = random.Random(seed)
job_id = 0
print("ready", flush=True)
while True:
    batch = rng.sample(keys, 8)
    for slot, key in enumerate(batch):
        reps = -(-slot_bytes // len(key))
        pool.view(slot)[:] = (key * reps)[:slot_bytes]
    tier.submit(TierJob(job_id, TierJobKind.WRITE, batch, list(range(len(batch)))))
    job_id += 1
    while not tier.poll():
        time.sleep(0.001)
"""


class WriterProcess:
    """Another engine writing the same blocks into the shared fs directory, in its own process,
    so that it can be killed with SIGKILL in the middle of a write."""

    def __init__(
        self, path: Path, model: str, slot_bytes: int, capacity: int, hash_ids: list[int]
    ) -> None:
        self.args = [str(path), model, str(slot_bytes), str(capacity)]
        self.ids = " ".join(map(str, hash_ids))
        self.proc: subprocess.Popen[str] | None = None

    def start(self, seed: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WRITER_CODE, *self.args, str(seed)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(self.ids)
        self.proc.stdin.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, then reap; an early death of the writer is a test failure, not a fault."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"the writer process died on its own: {err[-2000:]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        self.proc = None
