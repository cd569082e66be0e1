"""Connections of the ``redis`` tier: building a redis-py client, a zero-copy command packer, and
sorting errors into "the server is unreachable" and "this one command failed".

Values are raw bytes (kvtier's 64-byte header, then the block); nothing read from the server is
ever unpickled or evaluated.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Iterable
from typing import Any

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.connection import BlockingConnectionPool, parse_url
from redis.exceptions import (
    AskError,
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    ClusterDownError,
    DataError,
    InvalidResponse,
    NoPermissionError,
    RedisClusterException,
    ResponseError,
)
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import (
    TimeoutError as RedisTimeoutError,
)
from redis.retry import Retry

from kvtier.errors import ConfigError
from kvtier.tiers.redis import deadline as redis_deadline
from kvtier.tiers.redis.options import Options, masked_url
from kvtier.tiers.redis.wire import ProtocolError

log = logging.getLogger("kvtier.tiers.redis")

SOCKET_READ_BYTES = 1 << 20
"""recv size of the reply parser: 64 KiB (redis-py's default) costs ~30% of GET throughput for
2 MiB values."""

Client = Any
"""``redis.Redis`` or ``redis.cluster.RedisCluster`` (both typed loosely by redis-py)."""


class BlockValue:
    """A SET value sent as a header and a slot view without joining them (no 2 MiB copy)."""

    __slots__ = ("header", "payload")

    def __init__(self, header: bytes, payload: memoryview) -> None:
        self.header = header
        self.payload = payload

    def __len__(self) -> int:
        return len(self.header) + len(self.payload)


class ZeroCopyPacker:
    """RESP command packer for redis-py connections (their ``command_packer`` hook).

    Large bulk arguments (``memoryview``, ``BlockValue``, long ``bytes``) are handed to the
    socket as they are; redis-py's hiredis packer would copy a memoryview into ``bytes`` and
    then into the packed command (two copies of every block written). Stateless, so one
    instance serves every connection.
    """

    CUTOFF = 6000

    def pack(self, *args: Any) -> list[bytes | memoryview]:
        if isinstance(args[0], str):
            args = (*args[0].encode().split(), *args[1:])
        elif b" " in args[0]:
            args = (*args[0].split(), *args[1:])
        out: list[bytes | memoryview] = []
        buf = [b"*%d\r\n" % len(args)]
        for arg in args:
            if isinstance(arg, BlockValue):
                buf.append(b"$%d\r\n" % len(arg))
                buf.append(arg.header)
                out.append(b"".join(buf))
                out.append(arg.payload)
                buf = [b"\r\n"]
                continue
            data = _encode(arg)
            if isinstance(data, memoryview) or len(data) > self.CUTOFF:
                buf.append(b"$%d\r\n" % len(data))
                out.append(b"".join(buf))
                out.append(data)
                buf = [b"\r\n"]
            else:
                buf.append(b"$%d\r\n%b\r\n" % (len(data), data))
        out.append(b"".join(buf))
        return out


def _encode(value: Any) -> bytes | memoryview:
    if isinstance(value, bytes | memoryview):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bytearray):
        return bytes(value)
    if isinstance(value, bool):
        raise DataError("booleans are not Redis values")
    if isinstance(value, int | float):
        return repr(value).encode()
    raise DataError(f"cannot send a {type(value).__name__} to Redis")


_PACKER = ZeroCopyPacker()


class _Pool(BlockingConnectionPool):  # type: ignore[misc]
    """Waits (up to ``timeout``) for a free connection instead of failing, and gives every
    connection the zero-copy packer."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs["command_packer"] = _PACKER
        super().__init__(**kwargs)  # type: ignore[no-untyped-call]

    # Every connection handed out (or made: connecting, TLS and AUTH happen in redis-py) joins
    # the deadline of the command running on this thread, so the watchdog can cut it off.

    def make_connection(self) -> Any:
        conn = super().make_connection()  # type: ignore[no-untyped-call]
        redis_deadline.watch(conn)
        return conn

    def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        conn = super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]
        redis_deadline.watch(conn)
        return conn


def _no_retry() -> Retry:
    # Fail fast: the tier's health loop reconnects, with backoff, instead of each command.
    return Retry(NoBackoff(), 0)


def build_client(options: Options) -> Client:
    """A redis-py client for ``options``; a cluster client contacts the cluster at once
    (``RedisClusterException`` when it cannot)."""
    kwargs: dict[str, Any] = {
        "socket_timeout": options.timeout_s,
        "socket_read_size": SOCKET_READ_BYTES,
        "protocol": 2,  # the block data path parses RESP2 replies itself (redis_wire)
        "max_connections": options.connections,
        "timeout": options.timeout_s,  # wait for a free pooled connection
    }
    if options.scheme != "unix":
        kwargs["socket_connect_timeout"] = options.timeout_s
        kwargs["socket_keepalive"] = True
    if options.username is not None:
        kwargs["username"] = options.username
    if options.password is not None:
        kwargs["password"] = options.password
    if options.scheme == "rediss":
        kwargs["ssl_cert_reqs"] = "required" if options.tls_verify else "none"
        kwargs["ssl_check_hostname"] = options.tls_verify
        if options.tls_ca_file is not None:
            kwargs["ssl_ca_certs"] = options.tls_ca_file
        if options.tls_cert_file is not None:
            kwargs["ssl_certfile"] = options.tls_cert_file
            kwargs["ssl_keyfile"] = options.tls_key_file
    if options.cluster:
        return redis.cluster.RedisCluster(
            url=options.url,
            connection_pool_class=_Pool,
            retry=_no_retry(),
            require_full_coverage=False,
            **kwargs,
        )
    conn_kwargs: dict[str, Any] = parse_url(options.url)  # type: ignore[no-untyped-call]
    conn_kwargs.update(kwargs)
    conn_kwargs["retry"] = _no_retry()
    return redis.Redis(connection_pool=_Pool(**conn_kwargs))


def close_client(client: Client) -> None:
    try:
        client.close()
    except Exception:  # closing must not fail: the sockets may be gone already
        log.debug("closing the redis client failed", exc_info=True)


# -- errors -------------------------------------------------------------------------------------

UNREACHABLE: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    RedisClusterException,
    OSError,
)
"""Errors meaning the server (or cluster) cannot serve us now: the tier turns unhealthy."""


def is_unreachable(exc: BaseException) -> bool:
    return isinstance(exc, UNREACHABLE)


def is_timeout(exc: BaseException) -> bool:
    return isinstance(exc, RedisTimeoutError | TimeoutError)


def is_protocol_error(exc: BaseException) -> bool:
    """A reply that is no valid RESP (or not what the command answers): whoever listens on the
    port is not a working Redis server (another program, a hostile or broken server)."""
    return isinstance(exc, ProtocolError | InvalidResponse)


_AUTH_TEXT = (
    "WRONGPASS",
    "NOAUTH",
    "invalid username-password",
    "Authentication required",
    "AUTH <password> called without",
)


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and its causes (redis-py wraps socket, SSL and auth errors)."""
    out: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and all(current is not seen for seen in out):
        out.append(current)
        current = current.__cause__ or current.__context__
    return out


def config_error(options: Options, exc: BaseException) -> ConfigError | None:
    """The ``ConfigError`` that ``exc`` at start means (bad credentials, ACL, TLS, cluster mode),
    or None when it only means "not reachable now"."""
    url = masked_url(options.url)
    field = f"{options.config_path}.url"
    reason = _reason(exc, options)
    chain = _chain(exc)
    if any(
        isinstance(e, AuthenticationError | AuthenticationWrongNumberOfArgsError)
        or any(text in str(e) for text in _AUTH_TEXT)
        for e in chain
    ):
        return ConfigError(field, url, f"credentials the server accepts; it said: {reason}")
    if any(isinstance(e, NoPermissionError) or "NOPERM" in str(e) for e in chain):
        return ConfigError(
            field,
            url,
            "an ACL user allowed PING, EXISTS, GET, GETEX, SET and DEL on keys "
            f"'{options.key_prefix}:*'; the server said: {reason}",
        )
    if (isinstance(exc, AskError | ClusterDownError) or "MOVED" in reason) and not options.cluster:
        return ConfigError(
            f"{options.config_path}.cluster", False, f"true for a Redis Cluster ({reason})"
        )
    if isinstance(exc, RedisClusterException) and "not enabled" in reason:
        return ConfigError(
            f"{options.config_path}.cluster", True, f"false for a standalone server ({reason})"
        )
    if options.scheme == "rediss" and any(
        isinstance(e, ssl.SSLError) or "SSL" in str(e) for e in chain
    ):
        return ConfigError(field, url, f"a TLS handshake that succeeds; it failed: {reason}")
    if isinstance(exc, UNREACHABLE) or is_protocol_error(exc):
        # Not a Redis server there now (down, or another program on the port): the tier starts
        # unhealthy and joins when a real server answers.
        return None
    if isinstance(exc, ResponseError):
        return ConfigError(
            field, url, f"a server that accepts kvtier's commands; it said: {reason}"
        )
    return ConfigError(field, url, f"settings the redis client accepts; it failed: {reason}")


def _reason(exc: BaseException, options: Options) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return _mask_secrets(text, [options.password, _url_password(options.url)])


def _url_password(url: str) -> str | None:
    try:
        password = parse_url(url).get("password")  # type: ignore[no-untyped-call]
        return password if isinstance(password, str) else None
    except ValueError:
        return None


def _mask_secrets(text: str, secrets: Iterable[str | None]) -> str:
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def describe(exc: BaseException, options: Options) -> str:
    """A one-line description of ``exc`` safe for logs (passwords masked)."""
    return _reason(exc, options)
