"""A small HTTP server for ``/metrics`` whose cost a network client cannot grow.

prometheus-client's own server starts one thread per connection and never times a connection
out: 300 idle clients held 304 threads and 304 descriptors, enough to starve the fs tier of
file descriptors. This one bounds both:

- at most ``max_connections`` connections are served at once; one more is answered ``503`` and
  closed at once, and counted in ``refused``;
- a connection has ``idle_timeout_s`` to send its request and as long again to take the answer,
  then it is closed (counted in ``timed_out``), however slowly it trickles bytes;
- a request head over ``MAX_REQUEST_BYTES`` is answered ``431`` and closed.

It answers ``GET`` and ``HEAD`` of ``/`` and ``/metrics``, one request per connection
(``Connection: close``), which is all a Prometheus scraper needs.
"""

from __future__ import annotations

import ipaddress
import math
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.errors import KVTierError

DEFAULT_ADDR = "127.0.0.1"
"""Loopback: a scraper on another host needs ``addr`` set on purpose (``0.0.0.0``, ``::``)."""
DEFAULT_MAX_CONNECTIONS = 16
DEFAULT_IDLE_TIMEOUT_S = 5.0
MAX_IDLE_TIMEOUT_S = 3600.0
MAX_CONNECTIONS = 1024
MAX_REQUEST_BYTES = 8192
PATHS = ("/", "/metrics")


class ExporterError(KVTierError):
    """The metrics server cannot start (bad address, port in use): one line for the user."""


@dataclass(frozen=True, slots=True)
class ServerLimits:
    addr: str = DEFAULT_ADDR
    """An IP address literal (no host name: nothing is looked up)."""
    port: int = 0
    """0: a free port (``MetricsServer.server_port``)."""
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S

    def __post_init__(self) -> None:
        check_addr(self.addr)
        if isinstance(self.port, bool) or not isinstance(self.port, int):
            raise ExporterError(f"metrics port: an integer 0 to 65535, not {type(self.port)}")
        if not 0 <= self.port <= 65535:
            raise ExporterError(f"metrics port: 0 to 65535, not {self.port}")
        if not 1 <= self.max_connections <= MAX_CONNECTIONS:
            raise ExporterError(f"metrics max connections: 1 to {MAX_CONNECTIONS}")
        if not (math.isfinite(self.idle_timeout_s) and self.idle_timeout_s > 0):
            raise ExporterError("metrics idle timeout: a finite number of seconds above 0")
        if self.idle_timeout_s > MAX_IDLE_TIMEOUT_S:
            raise ExporterError(f"metrics idle timeout: at most {MAX_IDLE_TIMEOUT_S:g} seconds")


def check_addr(addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """``addr`` as an IP address; ``ExporterError`` (with the text made printable) otherwise."""
    try:
        return ipaddress.ip_address(addr)
    except ValueError:
        shown = repr(addr[:100])  # repr escapes control characters (kvtier.redaction's rule)
        raise ExporterError(
            f"metrics address: an IP address such as 127.0.0.1, 0.0.0.0 or ::, not {shown}"
        ) from None


@dataclass(slots=True)
class ConnectionCounts:
    served: int = 0
    refused: int = 0
    """Connections closed at once because ``max_connections`` were being served."""
    timed_out: int = 0
    bad_requests: int = 0


class MetricsServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """``render()``'s bytes over HTTP from a daemon thread; ``close()`` stops it."""

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True  # a restart may bind while old connections sit in TIME_WAIT
    request_queue_size = 64

    def __init__(self, limits: ServerLimits, render: Callable[[], bytes], content_type: str):
        if check_addr(limits.addr).version == 6:
            self.address_family = socket.AF_INET6
        self.limits = limits
        self.render = render
        self.content_type = content_type
        self.counts = ConnectionCounts()
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(limits.max_connections)
        try:
            super().__init__((limits.addr, limits.port), _Handler)
        except OSError as exc:
            where = f"[{limits.addr}]" if ":" in limits.addr else limits.addr
            reason = exc.strerror or str(exc)
            raise ExporterError(
                f"metrics: cannot listen on {where}:{limits.port}: {reason}"
            ) from None
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.2}, name="kvtier-metrics"
        )
        self._thread.daemon = True
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.limits.addr}]" if ":" in self.limits.addr else self.limits.addr
        return f"http://{host}:{self.server_port}/metrics"

    @property
    def server_port(self) -> int:
        return int(self.server_address[1])

    def count(self, what: str) -> None:
        with self._lock:
            setattr(self.counts, what, getattr(self.counts, what) + 1)

    def process_request(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        # Runs on the accepting thread: a connection over the cap never gets a thread.
        if not self._slots.acquire(blocking=False):
            self.count("refused")
            _answer_quietly(request, 503, b"too many connections\n")
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:  # type: ignore[override]
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: object, client_address: object) -> None:
        # A client that resets or misbehaves costs a count, never a traceback on stderr.
        self.count("bad_requests")

    def close(self) -> None:
        """Stop serving and release the port."""
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)


def _answer_quietly(sock: socket.socket, status: int, body: bytes) -> None:
    """A short answer sent without waiting: a client that does not read gets nothing."""
    try:
        sock.setblocking(False)
        sock.send(_head(status, "text/plain; charset=utf-8", len(body)) + body)
    except OSError:
        pass


_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def _head(status: int, content_type: str, length: int) -> bytes:
    return (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
    ).encode("ascii")


class _Handler(socketserver.BaseRequestHandler):
    server: MetricsServer
    request: socket.socket

    def handle(self) -> None:
        head = self._read_head()
        if head is None:
            return
        parts = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            self._send(400, b"bad request\n")
            return
        method, target = parts[0], parts[1].split(b"?", 1)[0]
        if method not in (b"GET", b"HEAD"):
            self._send(405, b"GET or HEAD\n")
        elif target.decode("latin-1") not in PATHS:
            self._send(404, b"try /metrics\n")
        else:
            self._send(200, self.server.render(), self.server.content_type, method == b"HEAD")
            self.server.count("served")

    def _read_head(self) -> bytes | None:
        """The request up to its blank line, read within ``idle_timeout_s`` in all; None
        (and the connection closed) when it does not come in time or is too long."""
        deadline = time.monotonic() + self.server.limits.idle_timeout_s
        data = b""
        while b"\r\n\r\n" not in data and b"\n\n" not in data:
            if len(data) > MAX_REQUEST_BYTES:
                self._send(431, b"request too long\n")
                return None
            remaining = deadline - time.monotonic()
            try:
                if remaining <= 0:
                    raise TimeoutError
                self.request.settimeout(remaining)
                chunk = self.request.recv(4096)
            except TimeoutError:
                self.server.count("timed_out")
                return None
            except OSError:
                return None
            if not chunk:
                return None
            data += chunk
        return data

    def _send(
        self,
        status: int,
        body: bytes,
        content_type: str = "text/plain; charset=utf-8",
        head_only: bool = False,
    ) -> None:
        if status >= 400:
            self.server.count("bad_requests")
        try:
            self.request.settimeout(self.server.limits.idle_timeout_s)  # for the whole answer
            self.request.sendall(
                _head(status, content_type, len(body)) + (b"" if head_only else body)
            )
        except TimeoutError:
            self.server.count("timed_out")
        except OSError:
            pass
