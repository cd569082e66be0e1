"""The exporter's HTTP server cannot be exhausted from the network: a bind address (loopback by
default), a cap on connections served at once and a deadline per connection; and its CLI options
fail with one line."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import require

prometheus_client = require.importorskip("prometheus_client", "extras")

from kvtier.metrics_server import ExporterError, MetricsServer  # noqa: E402
from kvtier.prometheus import serve  # noqa: E402


def scrape(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: bytes = response.read()
        return body


def idle_clients(port: int, n: int) -> list[socket.socket]:
    """``n`` connections that never send a byte (refused ones are closed by the server)."""
    out = []
    for _ in range(n):
        sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        out.append(sock)
    return out


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    registry = prometheus_client.CollectorRegistry()
    prometheus_client.Counter("probe_total", "a probe", registry=registry).inc(3)
    server = serve(0, registry, max_connections=4, idle_timeout_s=0.5)
    yield server
    server.close()


def test_listens_on_loopback_unless_told(server: MetricsServer) -> None:
    assert server.server_address[0] == "127.0.0.1"
    assert server.url == f"http://127.0.0.1:{server.server_port}/metrics"
    assert b"probe_total 3.0" in scrape(server.url)


def test_idle_connections_are_capped_timed_out_and_a_scrape_then_works(
    server: MetricsServer,
) -> None:
    threads, fds = threading.active_count(), open_fds()
    clients = idle_clients(server.server_port, 60)
    try:
        time.sleep(0.2)
        # 60 client sockets are ours; the server holds at most 4 of its own and 4 threads.
        assert threading.active_count() <= threads + 4
        assert open_fds() <= fds + 60 + 4
        deadline = time.monotonic() + 10
        # Each is either refused at once or served, and then timed out after 0.5 s.
        while server.counts.refused + server.counts.timed_out < 60:
            assert time.monotonic() < deadline, server.counts
            time.sleep(0.05)
        assert server.counts.timed_out >= 4 and server.counts.refused >= 40, server.counts
        assert b"probe_total 3.0" in scrape(server.url)
        assert threading.active_count() <= threads + 4
    finally:
        for sock in clients:
            sock.close()


def test_a_client_trickling_bytes_is_cut_off_at_its_deadline(server: MetricsServer) -> None:
    sock = socket.create_connection(("127.0.0.1", server.server_port), timeout=5)
    start = time.monotonic()
    try:
        closed = False
        while time.monotonic() - start < 3:
            try:
                sock.sendall(b"G")
                time.sleep(0.05)
                sock.setblocking(False)
                closed = sock.recv(1) == b""
            except BlockingIOError:
                pass
            except OSError:
                closed = True
            finally:
                sock.setblocking(True)
            if closed:
                break
        assert closed and time.monotonic() - start < 1.5
        assert server.counts.timed_out == 1
    finally:
        sock.close()


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /other HTTP/1.1\r\n\r\n", b"404"),
        (b"POST /metrics HTTP/1.1\r\n\r\n", b"405"),
        (b"nonsense\r\n\r\n", b"400"),
        (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 10_000, b"431"),
    ],
)
def test_bad_requests_get_a_status(
    server: MetricsServer, request_bytes: bytes, status: bytes
) -> None:
    with socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as sock:
        sock.sendall(request_bytes)
        assert sock.recv(100).startswith(b"HTTP/1.1 " + status)
    with socket.create_connection(("127.0.0.1", server.server_port), timeout=5) as sock:
        sock.sendall(b"HEAD /metrics?x=1 HTTP/1.0\r\n\r\n")
        head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200") and head.endswith(b"\r\n\r\n")


def test_a_port_in_use_is_one_line(server: MetricsServer) -> None:
    with pytest.raises(ExporterError, match=r"^metrics: cannot listen on 127\.0\.0\.1:\d+: "):
        serve(server.server_port, prometheus_client.CollectorRegistry())


@pytest.mark.parametrize("addr", ["localhost", "0.0.0.0.0", "\x1b[31m", ""])
def test_a_bad_address_is_one_line(addr: str) -> None:
    with pytest.raises(ExporterError) as info:
        serve(0, prometheus_client.CollectorRegistry(), addr)
    message = str(info.value)
    assert message.isprintable() and "\\\\" not in message, message  # escaped once


# -- kvtier simulate --metrics-* ------------------------------------------------------------------


def kvtier(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvtier", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_simulate_exporter_holds_few_threads_and_descriptors_under_idle_clients() -> None:
    """300 idle clients once held 304 threads and 304 descriptors of the replay's process."""
    proc = kvtier("simulate", "--limit", "5", "--metrics-port", "0", "--metrics-hold", "60")
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
        assert match, line
        url = match.group(0)
        scrape(url)  # the replay's threads are up
        task, fd = Path(f"/proc/{proc.pid}/task"), Path(f"/proc/{proc.pid}/fd")
        threads, fds = len(list(task.iterdir())), len(list(fd.iterdir()))
        clients = idle_clients(int(match.group(1)), 200)
        try:
            time.sleep(1.0)
            # 16 served at once, and a few threads and files of the replay's own that may come
            # and go (200 idle clients held 200 more of each before).
            assert len(list(task.iterdir())) <= threads + 16 + 4
            assert len(list(fd.iterdir())) <= fds + 16 + 4
            deadline = time.monotonic() + 15
            while True:  # the served idle ones time out (5 s); then a scrape is answered
                try:
                    assert b"kvtier_lookup_blocks_total" in scrape(url, timeout=2)
                    break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    assert time.monotonic() < deadline
                    time.sleep(0.5)
        finally:
            for sock in clients:
                sock.close()
    finally:
        proc.kill()
        proc.wait()


def test_simulate_port_in_use_is_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        proc = kvtier("simulate", "--limit", "5", "--metrics-port", port)
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.startswith("kvtier: error: metrics: cannot listen on 127.0.0.1:")
    assert err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize(
    "option",
    [
        ("--metrics-hold", "inf"),
        ("--metrics-hold", "nan"),
        ("--metrics-hold", "-1"),
        ("--metrics-hold", "1e300"),
        ("--metrics-addr", "example.com"),
        ("--metrics-idle-timeout", "0"),
        ("--metrics-max-connections", "0"),
    ],
)
def test_bad_metrics_options_are_usage_errors(
    capsys: pytest.CaptureFixture[str], option: tuple[str, str]
) -> None:
    from kvtier.cli import main

    with pytest.raises(SystemExit) as info:
        main(["simulate", "--limit", "5", "--metrics-port", "0", *option])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option[0]}:" in err and "Traceback" not in err
