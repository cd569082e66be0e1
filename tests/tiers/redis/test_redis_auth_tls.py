"""Credentials, ACL users and TLS: good ones work, bad ones fail clearly at construction."""

from __future__ import annotations

import pytest
from support import require
from support.blocks import make_keys
from support.drivers import Driver
from support.redis_servers import RedisServer, TlsFiles
from support.redis_tier import make_tier

from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.pool import HostPool

pytestmark = pytest.mark.redis

ACL_USER = "user engine on >engine-pw ~kvtier:* &* -@all +ping +exists +get +getex +set +del +info"
READER_ONLY = "user stranger on >stranger-pw ~other:* -@all +ping +exists +get +set +del"


def test_requirepass(make_server: object, pool: HostPool, namespace: Namespace) -> None:
    srv: RedisServer = make_server("requirepass top-secret")  # type: ignore[operator]
    tier = make_tier(pool, namespace, url=srv.url(password="top-secret"))
    try:
        assert Driver(tier).store(make_keys(2)) == [True, True]
    finally:
        tier.close()


@pytest.mark.parametrize(
    "credentials",
    [
        {"url_password": "wrong-one"},
        {"password": "wrong-one"},
        {},
    ],
)
def test_wrong_or_missing_password_is_a_clear_error(
    make_server: object, pool: HostPool, namespace: Namespace, credentials: dict[str, str]
) -> None:
    srv: RedisServer = make_server("requirepass top-secret")  # type: ignore[operator]
    url = (
        srv.url(password=credentials.get("url_password"))
        if "url_password" in credentials
        else srv.url()
    )
    extra = {"password": credentials["password"]} if "password" in credentials else {}
    with pytest.raises(ConfigError) as info:
        make_tier(pool, namespace, url=url, **extra)
    message = str(info.value)
    assert info.value.field == "tiers[0].url"
    assert "wrong-one" not in message and "top-secret" not in message
    assert "credentials" in message
    assert "WRONGPASS" in message or "uthentication" in message or "NOAUTH" in message


def test_acl_user_from_config_keys_and_env(
    make_server: object, pool: HostPool, namespace: Namespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    srv: RedisServer = make_server("requirepass admin-pw", ACL_USER)  # type: ignore[operator]
    monkeypatch.setenv("KVTIER_TEST_PW", "engine-pw")
    tier = make_tier(
        pool, namespace, url=srv.url(), username="engine", password_env="KVTIER_TEST_PW"
    )
    try:
        keys = make_keys(3, "acl")
        assert Driver(tier).store(keys) == [True] * 3
        assert Driver(tier).load_exact(keys, first_slot=5) == [True] * 3
    finally:
        tier.close()
    # The same user in the URL.
    tier = make_tier(pool, namespace, url=srv.url(user="engine", password="engine-pw"))
    tier.close()


def test_acl_user_with_wrong_password(
    make_server: object, pool: HostPool, namespace: Namespace
) -> None:
    srv: RedisServer = make_server("requirepass admin-pw", ACL_USER)  # type: ignore[operator]
    with pytest.raises(ConfigError) as info:
        make_tier(pool, namespace, url=srv.url(user="engine", password="nope"))
    assert "nope" not in str(info.value)
    assert "WRONGPASS" in str(info.value) or "invalid username-password" in str(info.value)


def test_acl_user_without_access_to_our_keys(
    make_server: object, pool: HostPool, namespace: Namespace
) -> None:
    srv: RedisServer = make_server("requirepass admin-pw", READER_ONLY)  # type: ignore[operator]
    with pytest.raises(ConfigError) as info:
        make_tier(pool, namespace, url=srv.url(user="stranger", password="stranger-pw"))
    assert "NOPERM" in str(info.value) or "permission" in str(info.value)
    assert "kvtier:*" in str(info.value)


def test_tls_round_trip(
    make_server: object,
    pool: HostPool,
    pool_b: HostPool,
    namespace: Namespace,
    tls_files: TlsFiles,
) -> None:
    srv = _tls_server(make_server, tls_files, "requirepass tls-pw")
    url = srv.url(password="tls-pw")
    assert url.startswith("rediss://")
    a = make_tier(pool, namespace, url=url, tls_ca_file=str(tls_files.ca))
    b = make_tier(pool_b, namespace, url=url, tls_ca_file=str(tls_files.ca))
    try:
        keys = make_keys(4, "tls")
        assert Driver(a).store(keys) == [True] * 4
        assert Driver(b).load_exact(keys, first_slot=4) == [True] * 4
    finally:
        a.close()
        b.close()


def test_tls_untrusted_certificate_is_a_clear_error(
    make_server: object, pool: HostPool, namespace: Namespace, tls_files: TlsFiles
) -> None:
    srv = _tls_server(make_server, tls_files)
    with pytest.raises(ConfigError) as info:
        make_tier(pool, namespace, url=srv.url())  # system CAs do not know our test CA
    assert "TLS" in str(info.value)
    # Verification off (testing only) connects.
    make_tier(pool, namespace, url=srv.url(), tls_verify=False).close()


def test_plain_url_to_tls_port_does_not_hang(
    make_server: object, pool: HostPool, namespace: Namespace, tls_files: TlsFiles
) -> None:
    srv = _tls_server(make_server, tls_files)
    url = srv.url().replace("rediss://", "redis://")
    try:
        tier = make_tier(pool, namespace, url=url, timeout_s=0.5)
    except ConfigError:
        return
    assert not tier.healthy
    tier.close()


def _tls_server(make_server: object, tls_files: TlsFiles, *config: str) -> RedisServer:
    try:
        return make_server(*config, tls=tls_files)  # type: ignore[operator,no-any-return]
    except RuntimeError as exc:
        if "TLS" in str(exc) and "support" in str(exc):
            require.missing("redis", f"this redis-server has no TLS: {exc}")
        raise
