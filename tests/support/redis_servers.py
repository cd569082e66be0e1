"""Real Redis servers for tests and benchmarks: Debian's ``redis-server`` on loopback ports, each
with its own config file and directory, killed at teardown.

Nothing here is persistent (``save ""``, ``appendonly no``); ports are picked free at start and
kept across restarts, so a restarted server is the same URL.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import redis

from support.ports import free_port

START_TIMEOUT_S = 15.0
CLUSTER_TIMEOUT_S = 30.0


def binaries_missing() -> str | None:
    """Why real-server tests cannot run here, or None when they can."""
    for name in ("redis-server", "redis-cli"):
        if shutil.which(name) is None:
            return f"{name} not installed (Debian: apt-get install -y redis-server redis-tools)"
    return None


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path
    key: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A throwaway CA and a server certificate for 127.0.0.1 / localhost, made with openssl."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca = directory / "ca.key", directory / "ca.crt"
    key, csr, cert = directory / "server.key", directory / "server.csr", directory / "server.crt"
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=kvtier-test-ca",
        "-keyout",
        str(ca_key),
        "-out",
        str(ca),
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=localhost",
        "-keyout",
        str(key),
        "-out",
        str(csr),
    )
    run(
        "x509",
        "-req",
        "-in",
        str(csr),
        "-CA",
        str(ca),
        "-CAkey",
        str(ca_key),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        str(ext),
        "-out",
        str(cert),
    )
    return TlsFiles(ca=ca, cert=cert, key=key)


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1.

    ``config`` lines are appended to the generated config file (``requirepass x``,
    ``user alice on >pw ~kvtier:* +@all``, ``maxmemory 64mb``...).
    """

    def __init__(
        self,
        directory: Path,
        config: Sequence[str] = (),
        tls: TlsFiles | None = None,
        cluster: bool = False,
    ) -> None:
        self.directory = directory
        self.config = list(config)
        self.tls = tls
        self.cluster = cluster
        self.port = 0
        self.bus_port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.password: str | None = None
        for line in self.config:
            if line.startswith("requirepass "):
                self.password = line.split(" ", 1)[1]

    # -- lifetime -------------------------------------------------------------------------------

    def start(self) -> RedisServer:
        for attempt in range(5):
            if self.port == 0 or attempt > 0:
                self.port = free_port()
                self.bus_port = free_port() if self.cluster else 0
            (self.directory / "nodes.conf").unlink(missing_ok=True)
            if self._spawn():
                return self
        raise RuntimeError(f"redis-server did not start; log:\n{self._log_tail()}")

    def _spawn(self) -> bool:
        self.directory.mkdir(parents=True, exist_ok=True)
        conf = self.directory / "redis.conf"
        lines = [
            "bind 127.0.0.1",
            "protected-mode no",
            'save ""',
            "appendonly no",
            f"dir {self.directory}",
            f"logfile {self.directory / 'redis.log'}",
            "daemonize no",
        ]
        if self.tls is not None:
            lines += [
                "port 0",
                f"tls-port {self.port}",
                f"tls-cert-file {self.tls.cert}",
                f"tls-key-file {self.tls.key}",
                f"tls-ca-cert-file {self.tls.ca}",
                "tls-auth-clients no",
            ]
        else:
            lines.append(f"port {self.port}")
        if self.cluster:
            lines += [
                "cluster-enabled yes",
                f"cluster-config-file {self.directory / 'nodes.conf'}",
                "cluster-node-timeout 2000",
                f"cluster-port {self.bus_port}",
            ]
        conf.write_text("\n".join([*lines, *self.config]) + "\n")
        log = self.directory / "redis.log"
        log.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            ["redis-server", str(conf)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            if log.exists() and "Ready to accept connections" in log.read_text(errors="replace"):
                return True
            time.sleep(0.02)
        self.kill()
        return False

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        self._signal_and_wait(signal.SIGKILL)

    def stop(self) -> None:
        self._signal_and_wait(signal.SIGTERM)

    def restart(self) -> None:
        """Start again on the same port (empty: nothing is persisted)."""
        self.kill()
        if not self._spawn():
            raise RuntimeError(f"redis-server did not restart; log:\n{self._log_tail()}")

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open, nothing answers."""
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)

    def _signal_and_wait(self, sig: int) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, signal.SIGCONT)
            os.kill(process.pid, sig)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def _log_tail(self) -> str:
        log = self.directory / "redis.log"
        return log.read_text(errors="replace")[-3000:] if log.exists() else "(no log)"

    # -- access ---------------------------------------------------------------------------------

    def url(self, user: str | None = None, password: str | None = None) -> str:
        scheme = "rediss" if self.tls is not None else "redis"
        auth = ""
        if user is not None or password is not None:
            auth = f"{user or ''}:{password or ''}@"
        return f"{scheme}://{auth}127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        """A plain redis-py client as the default user (for raw reads and damage in tests)."""
        kwargs: dict[str, object] = {"password": self.password, "socket_timeout": 10}
        if self.tls is not None:
            kwargs.update(ssl_ca_certs=str(self.tls.ca), ssl_cert_reqs="required")
        return redis.Redis.from_url(self.url(), **kwargs)

    def cli(self, *args: str, timeout: float = 10.0) -> str:
        """Run ``redis-cli`` against this server (as the default user) and return its output."""
        cmd = ["redis-cli", "-h", "127.0.0.1", "-p", str(self.port)]
        if self.tls is not None:
            cmd += ["--tls", "--cacert", str(self.tls.ca)]
        if self.password is not None:
            cmd += ["--no-auth-warning", "-a", self.password]
        out = subprocess.run([*cmd, *args], capture_output=True, timeout=timeout, check=True)
        return out.stdout.decode(errors="replace").strip()


class RedisCluster:
    """Three cluster-enabled masters on loopback ports, slots split by ``redis-cli --cluster``."""

    def __init__(self, directory: Path, nodes: int = 3, config: Sequence[str] = ()) -> None:
        self.servers = [
            RedisServer(directory / f"node{i}", config=config, cluster=True) for i in range(nodes)
        ]

    def start(self) -> RedisCluster:
        for server in self.servers:
            server.start()
        addresses = [f"127.0.0.1:{s.port}" for s in self.servers]
        password = self.servers[0].password
        auth = ["--no-auth-warning", "-a", password] if password else []
        subprocess.run(
            [
                "redis-cli",
                *auth,
                "--cluster",
                "create",
                *addresses,
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=CLUSTER_TIMEOUT_S,
            check=True,
        )
        self.wait_ok()
        return self

    def wait_ok(self, timeout_s: float = CLUSTER_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = []
            for server in self.servers:
                try:
                    states.append("cluster_state:ok" in server.cli("cluster", "info", timeout=5))
                except (subprocess.SubprocessError, OSError):
                    states.append(False)
            if all(states):
                return
            time.sleep(0.1)
        raise RuntimeError("redis cluster did not reach cluster_state:ok")

    @property
    def url(self) -> str:
        return self.servers[0].url()

    def stop(self) -> None:
        for server in self.servers:
            server.kill()
