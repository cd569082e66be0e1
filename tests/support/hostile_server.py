"""A fake, hostile "Redis": a real TCP server in a thread that speaks RESP2 well enough for the tier
(PING, SET, GET, GETEX, EXISTS, DEL, INFO, CONFIG, CLIENT, SELECT on an in-memory dict) and
misbehaves on purpose where its ``mode`` says: trickled replies, huge or wrong bulk lengths,
garbage, connections reset mid-reply, or another protocol altogether (a port taken over by a
non-Redis server).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from enum import Enum

from support.ports import free_port


class Mode(Enum):
    HONEST = "honest"
    """A correct (tiny) Redis."""
    TRICKLE_GET = "trickle_get"
    """GET/GETEX replies are right but sent one byte per ``interval_s``."""
    TRICKLE_SET = "trickle_set"
    """SET replies are right but sent one byte per ``interval_s``."""
    TRICKLE_ALL = "trickle_all"
    """Every reply (connection set-up and PING included) is sent one byte per ``interval_s``."""
    HUGE_BULK = "huge_bulk"
    """GET answers ``$1000000000000`` and then streams zeros as fast as it can."""
    LONGER_THAN_SAID = "longer_than_said"
    """GET announces the stored length but sends 7 bytes more before the CRLF."""
    NEGATIVE_LENGTH = "negative_length"
    """GET answers ``$-5``."""
    GARBAGE = "garbage"
    """GET and SET answer bytes that are no RESP at all."""
    RESET_MID_REPLY = "reset_mid_reply"
    """GET sends half of the value, then resets the connection (RST)."""
    BAD_INTEGER = "bad_integer"
    """GET, SET and EXISTS answer ``:12ab``."""
    # -- a port taken over by another server --
    HTTP = "http"
    """An HTTP server: ``400 Bad Request`` to anything, then it closes."""
    MEMCACHED = "memcached"
    """Answers ``ERROR`` to every line, as memcached does to commands it does not know."""
    ERR_EVERYTHING = "err_everything"
    """Valid RESP, but ``-ERR`` to every command (PING included)."""
    OK_EVERYTHING = "ok_everything"
    """Valid RESP, but ``+OK`` to every command (PING included)."""


class HostileServer:
    def __init__(self, mode: Mode, port: int = 0, interval_s: float = 0.2) -> None:
        self.mode = mode
        self.interval_s = interval_s
        self.port = port or free_port()
        self.data: dict[bytes, bytes] = {}
        self.commands: list[bytes] = []
        """Names of the commands received, in order (all connections)."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", self.port))
        self._listener.listen(64)
        self._listener.settimeout(0.05)
        self._thread = threading.Thread(target=self._accept, daemon=True, name="hostile-accept")
        self._thread.start()

    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def __enter__(self) -> HostileServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- serving --------------------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(0.2)
        buf = bytearray()
        try:
            while not self._stop.is_set():
                try:
                    chunk = conn.recv(1 << 20)
                except TimeoutError:
                    continue
                if not chunk:
                    return
                buf += chunk
                if self.mode is Mode.HTTP:
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
                    return
                if self.mode is Mode.MEMCACHED:
                    while b"\r\n" in buf:
                        del buf[: buf.index(b"\r\n") + 2]
                        conn.sendall(b"ERROR\r\n")
                    continue
                while True:
                    parsed = _parse_command(buf)
                    if parsed is None:
                        break
                    args, used = parsed
                    del buf[:used]
                    with self._lock:
                        self.commands.append(args[0].upper())
                    if not self._answer(conn, args):
                        return
        except OSError:
            return
        finally:
            with contextlib.suppress(OSError):
                conn.close()

    def _answer(self, conn: socket.socket, args: list[bytes]) -> bool:
        """Reply to one command; False when the connection is finished."""
        name = args[0].upper()
        mode = self.mode
        if mode is Mode.ERR_EVERYTHING:
            conn.sendall(b"-ERR this is not the server you are looking for\r\n")
            return True
        if mode is Mode.OK_EVERYTHING:
            conn.sendall(b"+OK\r\n")
            return True
        if len(args) > 1 and args[1].endswith(b":probe"):
            # The tier's start-up probe key gets honest answers: the tests aim at the data path
            # (test_non_redis_server_at_start covers a server broken from the start).
            mode = Mode.HONEST
        reading = name in (b"GET", b"GETEX")
        if mode is Mode.GARBAGE and name in (b"GET", b"GETEX", b"SET"):
            conn.sendall(b"\x00\xff\x13garbage that is no RESP\r\n")
            return True
        if mode is Mode.BAD_INTEGER and name in (b"GET", b"GETEX", b"SET", b"EXISTS"):
            conn.sendall(b":12ab\r\n")
            return True
        if reading and mode is Mode.HUGE_BULK:
            conn.sendall(b"$1000000000000\r\n")
            zeros = bytes(1 << 20)
            while not self._stop.is_set():
                conn.sendall(zeros)  # until the client gives up and closes
            return False
        if reading and mode is Mode.NEGATIVE_LENGTH:
            conn.sendall(b"$-5\r\n")
            return True
        reply = self._honest(name, args)
        found = reply.startswith(b"$") and reply != b"$-1\r\n"
        if reading and mode is Mode.LONGER_THAN_SAID and found:
            reply = reply[:-2] + b"SEVEN!!\r\n"
        if reading and mode is Mode.RESET_MID_REPLY and found:
            conn.sendall(reply[: len(reply) // 2])
            # SO_LINGER 0: close sends an RST, as a crashed or hostile peer does.
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
            return False
        trickle = (
            mode is Mode.TRICKLE_ALL
            or (reading and mode is Mode.TRICKLE_GET)
            or (name == b"SET" and mode is Mode.TRICKLE_SET)
        )
        if trickle:
            for i in range(len(reply)):
                if self._stop.wait(self.interval_s):
                    return False
                conn.sendall(reply[i : i + 1])
            return True
        conn.sendall(reply)
        return True

    def _honest(self, name: bytes, args: list[bytes]) -> bytes:
        data = self.data
        if name == b"PING":
            return b"+PONG\r\n"
        if name in (b"CLIENT", b"SELECT", b"AUTH"):
            return b"+OK\r\n"
        if name == b"SET":
            data[args[1]] = args[2]
            return b"+OK\r\n"
        if name in (b"GET", b"GETEX"):
            value = data.get(args[1])
            return b"$-1\r\n" if value is None else b"$%d\r\n%s\r\n" % (len(value), value)
        if name == b"EXISTS":
            return b":%d\r\n" % sum(1 for key in args[1:] if key in data)
        if name == b"DEL":
            return b":%d\r\n" % sum(1 for key in args[1:] if data.pop(key, None) is not None)
        if name == b"INFO":
            text = b"# Server\r\nredis_version:7.0.0\r\nrun_id:" + b"f" * 40 + b"\r\n"
            return b"$%d\r\n%s\r\n" % (len(text), text)
        if name == b"CONFIG":
            pairs = (b"maxmemory", b"1000", b"maxmemory-policy", b"allkeys-lru")
            return b"*4\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in pairs)
        return b"-ERR unknown command\r\n"


def _parse_command(buf: bytearray) -> tuple[list[bytes], int] | None:
    """One RESP array of bulk strings from the front of ``buf``, or None if incomplete."""
    if not buf:
        return None
    end = buf.find(b"\r\n")
    if end < 0:
        return None
    if buf[:1] != b"*":  # inline command (redis-cli style)
        return [bytes(part) for part in bytes(buf[:end]).split()], end + 2
    count = int(buf[1:end])
    at = end + 2
    args: list[bytes] = []
    for _ in range(count):
        end = buf.find(b"\r\n", at)
        if end < 0:
            return None
        size = int(buf[at + 1 : end])
        start = end + 2
        if len(buf) < start + size + 2:
            return None
        args.append(bytes(buf[start : start + size]))
        at = start + size + 2
    return args, at


def wait_port_free(port: int, deadline_s: float = 10.0) -> None:
    """Until nothing listens on ``port`` (a killed server's socket is gone)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            if sock.connect_ex(("127.0.0.1", port)) != 0:
                return
        time.sleep(0.02)
    raise AssertionError(f"port {port} still taken after {deadline_s} s")
