"""The block data path on a standalone server: pipelined SET / GET written and read on a redis-py
connection's socket, moving block bytes straight between pool slots and the kernel.

redis-py's reply parser hands a GET value over as ``bytes`` after copying it three times
(socket buffer, hiredis buffer, ``bytes`` object); here a value's 64-byte header lands in a small
buffer and its payload straight in the slot (``recv_into``), and a batch of SETs goes out as one
scatter-gather ``sendmsg`` of header and slot views. Connections, authentication, TLS and
timeouts stay redis-py's: a connection is taken from the client's pool and kept by one I/O thread
between batches while clean (every reply read); on any error it is disconnected.

Only RESP2 replies are parsed here (the client is built with ``protocol=2``); anything
unexpected is a ``ProtocolError`` and the connection is dropped. The server is not trusted:
every wait is bounded by the deadline of the command running on the thread (``redis_deadline``:
a total for connect, send and every reply, not a timeout that restarts with each byte), a bulk
length is checked before anything is read (a GET value longer than a block is refused at its
length line; other bulk replies have a cap given by the caller), lines are at most 64 KiB and
arrays at most ``MAX_ARRAY`` entries. Nothing is ever allocated from a length the server sent.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
from collections.abc import Sequence
from enum import Enum
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtier.tiers.iovec import advance
from kvtier.tiers.redis import deadline as redis_deadline

_BUFFER = 64 * 1024
_MAX_LINE = 64 * 1024
_IOV_MAX = 512
"""Buffers per sendmsg call (Linux allows 1024)."""
MAX_ARRAY = 1024
"""Entries of an array reply (CONFIG GET answers a few)."""
INFO_MAX_BYTES = 256 * 1024
"""Largest INFO or CONFIG reply read (INFO server is ~2 KiB)."""
_MAX_DEPTH = 2


class Got(Enum):
    """What a GET reply was, besides an error."""

    VALUE = "value"
    """A value of the expected size: header in the header buffer, payload in the slot."""
    MISSING = "missing"
    WRONG_SIZE = "wrong_size"
    """A shorter value (read and discarded): not a block of ours."""
    TOO_BIG = "too_big"
    """A value longer than a block: not read (the connection is dropped after the batch)."""


class WireError(RedisConnectionError):  # type: ignore[misc]
    """The connection is unusable (closed by the server)."""


class ProtocolError(RedisError):  # type: ignore[misc]
    """A reply that is no RESP2, or not one the command can answer: whoever answers is not a
    working Redis server. The connection is dropped; the tier counts these in a row."""


def supported(client: Any) -> bool:
    """True when ``client`` is a standalone redis-py client whose connections expose a socket."""
    pool = getattr(client, "connection_pool", None)
    return pool is not None and callable(getattr(pool, "get_connection", None))


class Lane:
    """The connection one I/O thread keeps between its batches, and its reply buffer.

    Borrowing a connection from redis-py's pool for every batch costs tens of microseconds of
    Python (locks, observability hooks) per 2 MiB block, on the core the server also needs. A
    lane takes one connection the first time it is used and keeps it while every reply is read;
    on any exception, or with bytes left unread, the connection is disconnected and given back,
    so no half-read reply reaches a later batch. ``reused`` tells whether the current batch runs
    on a kept connection (one the server may have closed while it was idle).

    Use as ``with lane.on(client):`` around one pipelined batch.
    """

    def __init__(self) -> None:
        self._pool: Any = None
        self._conn: Any = None
        self._sock: socket.socket | None = None
        self._buf = bytearray(_BUFFER)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0
        self._broken = False
        """A reply was left unread on purpose (a value too big): drop the connection."""
        self._deadline: redis_deadline.Deadline | None = None
        self.reused = False

    def on(self, client: Any) -> Lane:
        """The lane's connection to ``client``, for one batch within the deadline of the command
        running on this thread (``redis_deadline.Watchdog.command``)."""
        self._deadline = redis_deadline.current()
        pool = client.connection_pool
        if self._conn is not None and pool is self._pool and self._conn._sock is self._sock:
            self.reused = True
            redis_deadline.watch(self._conn)
            return self
        self.close()
        try:
            conn = pool.get_connection()
        except TypeError:  # redis-py < 5.3 wants a command name
            conn = pool.get_connection("GET")
        self._pool, self._conn, self.reused = pool, conn, False
        sock = getattr(conn, "_sock", None)
        if not isinstance(sock, socket.socket):
            self._drop()
            raise WireError("redis-py connection has no socket to use")
        self._sock = sock
        return self

    def __enter__(self) -> Lane:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc is not None or self._start != self._end or self._broken:
            self._drop()

    def close(self) -> None:
        """Give the kept connection back to its pool (clean: every reply was read)."""
        if self._conn is not None:
            if self._sock is not None:
                # redis-py's own timeout again (the lane set per-call ones).
                with contextlib.suppress(OSError):
                    self._sock.settimeout(self._conn.socket_timeout)
            self._pool.release(self._conn)
        self._pool = self._conn = self._sock = None

    def _drop(self) -> None:
        self._start = self._end = 0
        self._broken = False
        if self._conn is not None:
            self._conn.disconnect()
        self.close()

    def _timeout(self, sock: socket.socket, doing: str) -> None:
        """Give the next socket call what is left of the deadline (a total, not per call)."""
        deadline = self._deadline
        if deadline is None:
            return
        left = deadline.remaining()
        if left <= 0 or deadline.fired:
            raise RedisTimeoutError(f"command deadline passed while {doing}")
        sock.settimeout(left)

    # -- sending --------------------------------------------------------------------------------

    def send(self, chunks: Sequence[bytes | memoryview]) -> None:
        sock = self._sock
        assert sock is not None
        try:
            pending = [memoryview(chunk).cast("B") for chunk in chunks]
            while pending:
                self._timeout(sock, "writing")
                if isinstance(sock, ssl.SSLSocket):
                    advance(pending, sock.send(pending[0]))
                else:
                    advance(pending, sock.sendmsg(pending[:_IOV_MAX]))
        except TimeoutError as exc:
            raise RedisTimeoutError("timeout writing to socket") from exc
        except OSError as exc:
            raise RedisConnectionError(f"error writing to socket: {exc}") from exc

    # -- replies --------------------------------------------------------------------------------

    def simple(self) -> bytes | int | ResponseError | None:
        """One reply that is a status, an integer, a null or an error (bulk strings rejected)."""
        return self._simple(self._line())

    def _simple(self, line: bytes) -> bytes | int | ResponseError | None:
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return ResponseError(rest.decode(errors="replace"))
        if kind == b":":
            return _integer(line)
        if line in (b"$-1", b"_"):
            return None
        raise ProtocolError(f"unexpected reply {line[:40]!r}")

    def reply(self, max_bulk: int) -> Any:
        """Any one RESP2 reply: status or bulk as ``bytes``, ``int``, ``None``, a
        ``ResponseError`` or a list of these (arrays of at most ``MAX_ARRAY``, nested at most
        twice); a bulk string longer than ``max_bulk`` is a ``ProtocolError`` before any of it
        is read."""
        return self._reply(max_bulk, 0)

    def _reply(self, max_bulk: int, depth: int) -> Any:
        line = self._line()
        kind = line[:1]
        if kind == b"$":
            size = _integer(line)
            if size == -1:
                return None
            if not 0 <= size <= max_bulk:
                raise ProtocolError(f"bulk length {size} outside 0..{max_bulk}")
            out = bytearray(size)
            self._into(memoryview(out))
            self._crlf()
            return bytes(out)
        if kind == b"*":
            count = _integer(line)
            if count == -1:
                return None
            if not 0 <= count <= MAX_ARRAY or depth >= _MAX_DEPTH:
                raise ProtocolError(f"array of {count} at depth {depth}")
            return [self._reply(max_bulk, depth + 1) for _ in range(count)]
        return self._simple(line)

    def block(self, header: memoryview, payload: memoryview) -> Got | ResponseError:
        """One GET reply: header bytes into ``header``, the rest into ``payload``.

        A value longer than a block is not read at all (``Got.TOO_BIG``; the lane is then
        dropped at the end of the batch, so later replies of this batch cannot be read)."""
        line = self._line()
        kind = line[:1]
        if kind == b"-":
            return ResponseError(line[1:].decode(errors="replace"))
        if line in (b"$-1", b"_"):
            return Got.MISSING
        if kind != b"$":
            raise ProtocolError(f"unexpected reply {line[:40]!r}")
        size = _integer(line)
        expected = len(header) + len(payload)
        if size < 0:
            raise ProtocolError(f"bad bulk length {line[:40]!r}")
        if size > expected:
            self._broken = True
            return Got.TOO_BIG
        if size == expected:
            self._into(header)
            self._into(payload)
        else:
            self._skip(size)
        self._crlf()
        return Got.VALUE if size == expected else Got.WRONG_SIZE

    # -- reading --------------------------------------------------------------------------------

    def _recv(self, into: memoryview) -> int:
        sock = self._sock
        assert sock is not None
        try:
            self._timeout(sock, "reading")
            n = sock.recv_into(into)
        except TimeoutError as exc:
            raise RedisTimeoutError("timeout reading from socket") from exc
        except OSError as exc:
            raise RedisConnectionError(f"error reading from socket: {exc}") from exc
        if n == 0:
            raise WireError("connection closed by server")
        return n

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            # Move the unread tail to the front (only happens while looking for a line end).
            tail = self._end - self._start
            self._buf[:tail] = self._buf[self._start : self._end]
            self._start, self._end = 0, tail
        self._end += self._recv(self._view[self._end :])

    def _line(self) -> bytes:
        while True:
            at = self._buf.find(b"\r\n", self._start, self._end)
            if at >= 0:
                line = bytes(self._buf[self._start : at])
                self._start = at + 2
                return line
            if self._end - self._start > _MAX_LINE:
                raise ProtocolError("reply line too long")
            self._fill()

    def _into(self, target: memoryview) -> None:
        """Fill ``target`` with the next bytes: what is buffered, then straight from the socket."""
        have = min(self._end - self._start, len(target))
        if have:
            target[:have] = self._view[self._start : self._start + have]
            self._start += have
        filled = have
        while filled < len(target):
            filled += self._recv(target[filled:])

    def _skip(self, n: int) -> None:
        while n > 0:
            if self._start == self._end:
                self._fill()
            take = min(n, self._end - self._start)
            self._start += take
            n -= take

    def _crlf(self) -> None:
        while self._end - self._start < 2:
            if self._start == self._end:
                self._start = self._end = 0
            self._fill()
        if self._buf[self._start : self._start + 2] != b"\r\n":
            raise ProtocolError("bulk string not followed by CRLF")
        self._start += 2


def _integer(line: bytes) -> int:
    """The number after a reply's type byte (``:12``, ``$5``, ``*2``)."""
    digits = line[1:]
    # int() would also take " 12", "1_2" or 4,000 digits: RESP numbers are plain decimals.
    unsigned = digits[1:] if digits[:1] == b"-" else digits
    if not 0 < len(digits) <= 20 or not unsigned.isdigit():
        raise ProtocolError(f"bad number in reply {line[:40]!r}")
    return int(digits)


def ask(lane: Lane, client: Any, commands: Sequence[tuple[bytes, ...]], max_bulk: int) -> list[Any]:
    """``commands`` in one round trip on ``lane``, their replies (errors as ``ResponseError``
    values, bulk replies up to ``max_bulk`` bytes), within the command deadline of the caller.
    Like a batch, it runs once more on a fresh connection when a kept one was closed while idle
    (the tier sends only idempotent commands this way)."""
    data = b"".join(command(*args) for args in commands)
    for attempt in (1, 2):
        try:
            with lane.on(client) as wire:
                wire.send([data])
                return [wire.reply(max_bulk) for _ in commands]
        except RedisConnectionError:
            deadline = redis_deadline.current()
            if attempt == 2 or not lane.reused or (deadline is not None and deadline.fired):
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def command(*args: bytes) -> bytes:
    """One command as a RESP array of bulk strings."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def set_chunks(
    keys: Sequence[bytes],
    headers: Sequence[bytes],
    payloads: Sequence[memoryview],
    ttl_ms: int | None,
) -> list[bytes | memoryview]:
    """The RESP2 bytes of ``SET key header+payload [PX ttl]`` for each block, the payloads as
    views (never joined)."""
    argc = b"*5\r\n" if ttl_ms is not None else b"*3\r\n"
    tail = b"\r\n"
    if ttl_ms is not None:
        tail += b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(ttl_ms)), ttl_ms)
    out: list[bytes | memoryview] = []
    lead = b""
    for key, header, payload in zip(keys, headers, payloads, strict=True):
        out.append(
            b"%s%s$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s"
            % (lead, argc, len(key), key, len(header) + len(payload), header)
        )
        out.append(payload)
        lead = tail
    out.append(lead)
    return out


def get_command(keys: Sequence[bytes], ttl_ms: int | None) -> bytes:
    """``GET key`` (or ``GETEX key PX ttl``) for each key, as one buffer."""
    if ttl_ms is None:
        return b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys)
    px = b"$2\r\nPX\r\n$%d\r\n%d\r\n" % (len(str(ttl_ms)), ttl_ms)
    return b"".join(b"*4\r\n$5\r\nGETEX\r\n$%d\r\n%s\r\n%s" % (len(k), k, px) for k in keys)
