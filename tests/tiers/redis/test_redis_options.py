"""Options parsing, URL masking and the zero-copy command packer (no server needed)."""

from __future__ import annotations

import pytest
from redis.connection import PythonRespSerializer
from support.redis_tier import options

from kvtier.errors import ConfigError
from kvtier.tiers import tier_class
from kvtier.tiers.redis.client import BlockValue, ZeroCopyPacker
from kvtier.tiers.redis.options import masked_url
from kvtier.tiers.redis.tier import Options, RedisTier


def test_registry_finds_the_tier() -> None:
    assert tier_class("redis") is RedisTier
    assert RedisTier.Options is Options


def test_defaults() -> None:
    opts = options()
    assert opts.url == "redis://127.0.0.1:6379/0"
    assert opts.connections == opts.io_threads + 2
    assert opts.ttl_s is None and opts.ttl_ms is None
    assert opts.config_path == "tiers[0]"
    assert opts.batch_blocks(2 * 1024 * 1024) == 1
    assert opts.batch_blocks(64 * 1024) == 32
    assert opts.batch_blocks(1024) == 64
    assert options(pipeline_blocks=3).batch_blocks(2 * 1024 * 1024) == 3


def test_full_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTIER_TEST_REDIS_PW", "s3cret")
    opts = options(
        url="redis://cache.example:6380/2",
        username="engine",
        password_env="KVTIER_TEST_REDIS_PW",
        ttl_s=3600,
        timeout_s=0.5,
        pipeline_blocks=16,
        io_threads=8,
        max_connections=12,
        negative_cache_s=0.25,
        key_prefix="kv.prod",
    )
    assert opts.password == "s3cret"
    assert "s3cret" not in repr(opts)
    assert opts.ttl_ms == 3_600_000
    assert opts.connections == 12


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"url": "http://localhost"}, "tiers[0].url"),
        ({"url": "redis://"}, "tiers[0].url"),
        ({"url": "unix:///tmp/r.sock", "cluster": True}, "tiers[0].url"),
        ({"url": "redis://h/3", "cluster": True}, "tiers[0].url"),
        ({"url": "redis://h:1/xyz"}, "tiers[0].url"),  # redis-py would silently use db 0
        ({"url": "redis://h:1/-1"}, "tiers[0].url"),
        ({"url": "rediss://h:1/0/1"}, "tiers[0].url"),
        ({"password": "a", "password_env": "B"}, "tiers[0].password_env"),
        ({"password_env": "KVTIER_TEST_SURELY_UNSET"}, "tiers[0].password_env"),
        ({"url": "redis://u:p@h", "password": "x"}, "tiers[0].password"),
        ({"url": "redis://u:p@h", "username": "x"}, "tiers[0].username"),
        ({"ttl_s": 0}, "tiers[0].ttl_s"),
        ({"ttl_s": "1h"}, "tiers[0].ttl_s"),
        ({"pipeline_blocks": -1}, "tiers[0].pipeline_blocks"),
        ({"io_threads": 4, "max_connections": 5}, "tiers[0].max_connections"),
        ({"key_prefix": "kv{tag}"}, "tiers[0].key_prefix"),
        ({"tls_verify": False}, "tiers[0].url"),
        ({"url": "rediss://h", "tls_ca_file": "/nonexistent/ca.pem"}, "tiers[0].tls_ca_file"),
        ({"reconnect_initial_s": 2, "reconnect_max_s": 1}, "tiers[0].reconnect_max_s"),
        ({"timeout": 1}, "tiers[0].timeout"),
    ],
)
def test_bad_options_name_the_field(values: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        options(**values)
    assert info.value.field == field


@pytest.mark.parametrize(("url", "db"), [("redis://h", 0), ("redis://h/", 0), ("redis://h:1/7", 7)])
def test_url_database_is_a_number(url: str, db: int) -> None:
    from redis.connection import parse_url

    assert options(url=url).url == url
    assert parse_url(url).get("db", 0) == db


def test_errors_never_show_a_password() -> None:
    with pytest.raises(ConfigError) as info:
        options(url="redis://user:hunter2@host", password="x")
    assert "hunter2" not in str(info.value)
    with pytest.raises(ConfigError) as info:
        options(url="http://user:hunter2@host")
    assert "hunter2" not in str(info.value)


def test_masked_url() -> None:
    assert masked_url("redis://u:pw@h:1/0") == "redis://u:***@h:1/0"
    assert masked_url("rediss://:pw@h") == "rediss://:***@h"
    assert masked_url("redis://h:1") == "redis://h:1"


def _wire(chunks: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(c) for c in chunks)


def test_packer_matches_redis_py_and_never_copies_blocks() -> None:
    reference = PythonRespSerializer(6000, lambda v: v if isinstance(v, bytes) else str(v).encode())
    packer = ZeroCopyPacker()
    for args in [
        ("PING",),
        ("SET", b"k", b"v", "PX", 1000),
        ("CONFIG GET", "maxmemory"),
        ("SET", b"k", b"x" * 10_000),
    ]:
        assert _wire(packer.pack(*args)) == _wire(reference.pack(*args))  # type: ignore[no-untyped-call]
    header = b"H" * 64
    slot = memoryview(bytearray(b"p" * 100_000))
    chunks = packer.pack("SET", b"key", BlockValue(header, slot), "PX", 5)
    assert any(c is slot for c in chunks), "the slot view must reach the socket as it is"
    expected = b"*5\r\n$3\r\nSET\r\n$3\r\nkey\r\n$100064\r\n" + header + bytes(slot)
    expected += b"\r\n$2\r\nPX\r\n$1\r\n5\r\n"
    assert _wire(chunks) == expected
