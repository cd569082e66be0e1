"""Total deadlines for the ``redis`` tier's network calls.

A socket timeout bounds one ``recv``; a server that sends one byte just before each timeout
(or a TLS handshake, an AUTH reply, a redis-py reply parser fed the same way) holds a thread
forever. Here every command runs inside ``Watchdog.command(timeout_s)``: the connections it
uses are registered with its deadline (redis-py connections through the tier's pool, see
``watch``), and a watchdog thread shuts their sockets down once the deadline has passed, so the
blocked call returns at once with an error. ``redis_wire.Lane`` also checks the deadline itself
before every ``recv``/``send`` (exact, and counted as a timeout); the watchdog is the backstop
for calls inside redis-py.

``shutdown`` (never ``close``) is used on a socket another thread may be blocked on: the file
descriptor stays valid until its owner closes it, so it cannot be reused under that thread.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

SLACK_S = 0.1
"""The watchdog fires this long after a deadline: calls that check the deadline themselves
(``redis_wire.Lane``) report a clean timeout first."""

REFIRE_S = 0.05
"""How often the sockets of a command past its deadline are shut down again."""

_current = threading.local()


class Deadline:
    """One command's deadline and the connections it uses."""

    __slots__ = ("at", "conns", "fired")

    def __init__(self, at: float) -> None:
        self.at = at
        self.conns: list[Any] = []
        self.fired = False
        """The watchdog (or ``abort_all``) shut this command's sockets down."""

    def remaining(self) -> float:
        return self.at - time.monotonic()


def current() -> Deadline | None:
    """The deadline of the command running on this thread, if any."""
    deadline: Deadline | None = getattr(_current, "deadline", None)
    return deadline


def watch(conn: Any) -> None:
    """Register a redis-py connection with this thread's command (no-op outside one)."""
    deadline = current()
    if deadline is not None and all(conn is not c for c in deadline.conns):
        deadline.conns.append(conn)


def shutdown(conn: Any) -> None:
    """Make every blocked and later call on ``conn``'s socket fail at once."""
    sock = getattr(conn, "_sock", None)
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            # socket.socket's own method: on an SSLSocket it acts on the file descriptor
            # without touching the TLS state another thread is using.
            socket.socket.shutdown(sock, socket.SHUT_RDWR)


class Watchdog:
    """Shuts down the sockets of commands that passed their deadline (one thread per tier)."""

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._active: set[Deadline] = set()
        self._stopped = False
        self._aborting = False
        self._wake_at = float("inf")
        """When the watchdog thread wakes next (guarded by ``_cond``)."""
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def command(self, timeout_s: float) -> Iterator[Deadline]:
        """Run one command (connect, send, every reply) within ``timeout_s`` in all."""
        if current() is not None:  # nested: the outer deadline rules
            yield current()  # type: ignore[misc]
            return
        deadline = Deadline(time.monotonic() + timeout_s)
        with self._cond:
            if self._aborting:
                deadline.at = time.monotonic()  # closing: fail at once
            self._active.add(deadline)
            if deadline.at + SLACK_S < self._wake_at:
                # Only a deadline earlier than the next wake-up needs the thread now: deadlines
                # are mostly later than those already watched (one wake-up per timeout_s).
                self._cond.notify()
        _current.deadline = deadline
        try:
            yield deadline
        finally:
            _current.deadline = None
            with self._cond:
                self._active.discard(deadline)

    def abort_all(self) -> None:
        """Fail every command now and every later one at once (the tier is closing)."""
        with self._cond:
            self._aborting = True
            for deadline in self._active:
                deadline.at = time.monotonic()
                self._fire(deadline)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(1.0)

    def _loop(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                wait: float | None = None
                for deadline in self._active:
                    due = deadline.at + SLACK_S - now
                    if due <= 0:
                        self._fire(deadline)
                        # Again soon: a connection made after the deadline (a reconnect inside
                        # redis-py) is shut down too.
                        due = REFIRE_S
                    if wait is None or due < wait:
                        wait = due
                self._wake_at = float("inf") if wait is None else now + wait
                self._cond.wait(wait)

    def _fire(self, deadline: Deadline) -> None:
        # Connections registered later (a reconnect after the deadline) are shut down too.
        deadline.fired = True
        for conn in deadline.conns:
            shutdown(conn)
