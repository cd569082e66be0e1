from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import require
from support.redis_servers import (
    RedisCluster,
    RedisServer,
    TlsFiles,
    binaries_missing,
    make_tls_files,
)

from kvtier.keys import Namespace
from kvtier.pool import HostPool

SLOT_BYTES = 64 * 1024 + 100
"""Not a multiple of the pool's slot alignment, on purpose."""
NUM_SLOTS = 64


def _require_binaries() -> None:
    reason = binaries_missing()
    if reason is not None:
        require.missing("redis", reason)


@pytest.fixture
def pool(make_pool: Callable[..., HostPool]) -> HostPool:
    return make_pool(NUM_SLOTS, SLOT_BYTES)


@pytest.fixture
def namespace() -> Namespace:
    # Tenant "a", not the default: test_cluster_flag_must_match_the_server finds the cluster only
    # when the tier's probe key hashes to another node's slot (MOVED), which holds for this
    # tenant's key prefix and not for the default one.
    return Namespace(model="test-model", dtype="float16", block_tokens=16, tenant="a")


@pytest.fixture
def pool_b(make_pool: Callable[..., HostPool]) -> HostPool:
    """A second engine instance's pool."""
    return make_pool(NUM_SLOTS, SLOT_BYTES)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    _require_binaries()
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.kill()


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[object]:
    """Factory for servers with extra config lines (auth, ACL users, maxmemory, TLS)."""
    _require_binaries()
    servers: list[RedisServer] = []

    def make(*config: str, tls: TlsFiles | None = None, start: bool = True) -> RedisServer:
        srv = RedisServer(tmp_path / f"redis{len(servers)}", config=config, tls=tls)
        servers.append(srv)
        return srv.start() if start else srv

    yield make
    for srv in servers:
        srv.kill()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    _require_binaries()
    nodes = RedisCluster(tmp_path_factory.mktemp("cluster")).start()
    yield nodes
    nodes.stop()


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    _require_binaries()
    try:
        return make_tls_files(tmp_path_factory.mktemp("tls"))
    except (OSError, Exception) as exc:  # openssl missing or failing
        require.missing("redis", f"cannot make a test certificate with openssl: {exc}")
