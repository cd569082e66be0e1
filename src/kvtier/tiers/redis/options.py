"""Options of the ``redis`` tier, validated from config with field-named errors.

Secrets never reach a message (kvtier.redaction's rule): ``masked_url`` replaces a URL's
password with ``***`` and the ``password`` field is left out of ``repr``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from urllib.parse import SplitResult, urlsplit

from kvtier.errors import ConfigError
from kvtier.redaction import mask_url
from kvtier.validation import Section

SCHEMES = ("redis", "rediss", "unix")
AUTO_PIPELINE_BYTES = 2 * 1024 * 1024
AUTO_PIPELINE_MAX = 64
_PREFIX = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
"""Key prefixes may not hold ``{`` or ``}``: a hash tag would put all blocks on one cluster node."""
MAX_TTL_S = 10 * 365 * 86_400.0
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DATABASE = re.compile(r"(/[0-9]{0,9})?")
"""A ``redis://`` URL's path: none, ``/`` or ``/N`` (the database number)."""


@dataclass(frozen=True, slots=True)
class Options:
    url: str = "redis://127.0.0.1:6379/0"
    """``redis://[user[:password]@]host[:port][/db]``, ``rediss://`` for TLS, ``unix://path``."""
    username: str | None = None
    """ACL user (overrides none in the URL: give it in one place only)."""
    password: str | None = field(default=None, repr=False)
    """From the ``password`` key, or read from the environment variable named by
    ``password_env``; never both, and not together with a password in the URL."""
    cluster: bool = False
    """Redis Cluster: ``url`` names any one node; the others are discovered."""
    ttl_s: float | None = None
    """Expire blocks this long after their last write (or read, with ``ttl_touch_on_read``)."""
    ttl_touch_on_read: bool = True
    """Reads restart the TTL (``GETEX``), so blocks in use stay; needs write permission."""
    timeout_s: float = 2.0
    """Socket connect, send and receive timeout of every call."""
    pipeline_blocks: int = 0
    """Blocks per pipelined round trip (a job is split into batches of this many, spread over
    the I/O threads); 0: as many as make ``AUTO_PIPELINE_BYTES`` (one 2 MiB block, 32 blocks of
    64 KiB). Deeper pipelines of multi-MiB values are slower: the server then writes big replies
    in small slices (see docs/redis.md)."""
    io_threads: int = 4
    """Threads (each with its own connection) moving block data in parallel."""
    max_connections: int = 0
    """Connections per server node; 0: ``io_threads + 2`` (one for lookups, one for probes)."""
    negative_cache_s: float = 1.0
    """How long a key found absent is answered ``False`` without asking the server again."""
    presence_entries: int = 262_144
    """Keys whose presence is remembered locally (oldest forgotten first)."""
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    """Client certificate, for servers that require one (``tls-auth-clients yes``)."""
    tls_key_file: str | None = None
    tls_verify: bool = True
    """Verify the server's certificate and host name (only turn off for testing)."""
    health_interval_s: float = 1.0
    """While healthy, PING this often (and notice a restarted server: its blocks are gone)."""
    reconnect_initial_s: float = 0.1
    """First wait before probing an unhealthy server again; doubles after each failed probe."""
    reconnect_max_s: float = 5.0
    """Cap of that wait."""
    key_prefix: str = "kvtier"
    config_path: str = field(default="redis", compare=False)
    """Where these options came from in the config (for error messages)."""

    def batch_blocks(self, block_bytes: int) -> int:
        """Blocks per pipelined round trip for blocks of ``block_bytes``."""
        if self.pipeline_blocks:
            return self.pipeline_blocks
        return max(1, min(AUTO_PIPELINE_MAX, AUTO_PIPELINE_BYTES // max(1, block_bytes)))

    def __repr__(self) -> str:
        # Written out (the dataclass keeps a class's own __repr__): the URL's password masked,
        # fields marked repr=False (the password) left out. check-config prints this.
        shown = (
            f"{f.name}={masked_url(self.url) if f.name == 'url' else getattr(self, f.name)!r}"
            for f in fields(self)
            if f.repr
        )
        return f"{type(self).__name__}({', '.join(shown)})"

    @property
    def connections(self) -> int:
        return self.max_connections or self.io_threads + 2

    @property
    def scheme(self) -> str:
        return urlsplit(self.url).scheme

    @classmethod
    def parse(cls, section: Section) -> Options:
        # Keys are read in one fixed order, so the first bad one is the one reported.
        path = section.path or "redis"
        defaults = cls()

        def where(key: str) -> str:
            return f"{path}.{key}"

        url, parts, cluster = _parse_url(section, where, defaults.url)
        username, password = _parse_credentials(section, where, parts)
        ttl_s = _parse_ttl(section)
        io_threads, max_connections = _parse_threads(section, where, defaults.io_threads)
        key_prefix = section.string("key_prefix", defaults.key_prefix)
        if not _PREFIX.match(key_prefix):
            raise ConfigError(
                where("key_prefix"), key_prefix, "1-64 of letters, digits, '_', '.', ':', '-'"
            )
        tls = _parse_tls(section, where, url, parts.scheme)
        reconnect_initial_s, reconnect_max_s = _parse_reconnect(section, where, defaults)
        options = cls(
            url=url,
            username=username,
            password=password,
            cluster=cluster,
            ttl_s=ttl_s,
            ttl_touch_on_read=section.boolean("ttl_touch_on_read", True),
            timeout_s=section.number("timeout_s", defaults.timeout_s, minimum=0.01, maximum=600.0),
            pipeline_blocks=section.integer(
                "pipeline_blocks", defaults.pipeline_blocks, minimum=0, maximum=1024
            ),
            io_threads=io_threads,
            max_connections=max_connections,
            negative_cache_s=section.number(
                "negative_cache_s", defaults.negative_cache_s, minimum=0.0, maximum=3600.0
            ),
            presence_entries=section.integer(
                "presence_entries", defaults.presence_entries, minimum=1, maximum=100_000_000
            ),
            tls_ca_file=tls.ca_file,
            tls_cert_file=tls.cert_file,
            tls_key_file=tls.key_file,
            tls_verify=tls.verify,
            health_interval_s=section.number(
                "health_interval_s", defaults.health_interval_s, minimum=0.01, maximum=3600.0
            ),
            reconnect_initial_s=reconnect_initial_s,
            reconnect_max_s=reconnect_max_s,
            key_prefix=key_prefix,
            config_path=path,
        )
        section.done()
        return options

    @property
    def ttl_ms(self) -> int | None:
        return None if self.ttl_s is None else max(1, math.ceil(self.ttl_s * 1000))


Where = Callable[[str], str]
"""A key's full config path (``tiers[1].url``), for errors."""


@dataclass(frozen=True, slots=True)
class _Tls:
    ca_file: str | None
    cert_file: str | None
    key_file: str | None
    verify: bool


def _parse_url(section: Section, where: Where, default: str) -> tuple[str, SplitResult, bool]:
    """``url`` (checked, never shown with its password) and ``cluster``, which limits it."""
    url = section.string("url", default)
    if _CONTROL.search(url):
        raise ConfigError(where("url"), masked_url(url), "a URL without control characters")
    try:
        # urlsplit checks brackets ("[::1"); port and hostname are parsed when first read.
        parts = urlsplit(url)
        port, hostname = parts.port, parts.hostname
    except ValueError as exc:
        raise ConfigError(where("url"), masked_url(url), f"a valid URL ({exc})") from exc
    if parts.scheme not in SCHEMES:
        raise ConfigError(where("url"), masked_url(url), "a redis://, rediss:// or unix:// URL")
    if parts.scheme != "unix" and not hostname:
        raise ConfigError(where("url"), masked_url(url), "a URL with a host name")
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(where("url"), masked_url(url), "a port in 1..65535")
    cluster = section.boolean("cluster", False)
    if cluster and parts.scheme == "unix":
        raise ConfigError(where("url"), masked_url(url), "redis:// or rediss:// in cluster mode")
    if cluster and parts.path not in ("", "/", "/0"):
        raise ConfigError(where("url"), masked_url(url), "database 0 in cluster mode")
    if parts.scheme != "unix" and not _DATABASE.fullmatch(parts.path):
        # redis-py reads a path it cannot parse as database 0 (and /0/1 as 1): refuse it here.
        raise ConfigError(where("url"), masked_url(url), "a database number as its path (/0)")
    return url, parts, cluster


def _parse_credentials(
    section: Section, where: Where, parts: SplitResult
) -> tuple[str | None, str | None]:
    """``username`` and the password (``password`` or ``password_env``), each given in one
    place only (the key or the URL)."""
    username = section.optional_string("username")
    raw_password = section.data.get("password")
    if raw_password is not None and not isinstance(raw_password, str):
        # Not section.optional_string: its error would print the value.
        raise ConfigError(where("password"), "***", "a string")
    password = section.optional_string("password")
    password_env = section.optional_string("password_env")
    if password is not None and password_env is not None:
        raise ConfigError(where("password_env"), password_env, "either password or password_env")
    if password_env is not None:
        password = os.environ.get(password_env)
        if password is None:
            raise ConfigError(
                where("password_env"), password_env, "the name of a set environment variable"
            )
    if password is not None and parts.password is not None:
        raise ConfigError(
            where("password"),
            "***",
            "no password key when the URL holds one (give it in one place)",
        )
    if username is not None and parts.username:
        raise ConfigError(
            where("username"),
            username,
            "no username key when the URL holds one (give it in one place)",
        )
    return username, password


def _parse_ttl(section: Section) -> float | None:
    if section.has("ttl_s") and section.data["ttl_s"] is not None:
        return section.number("ttl_s", minimum=0.001, maximum=MAX_TTL_S)
    section.optional_string("ttl_s")  # marks the (null) key as read
    return None


def _parse_threads(section: Section, where: Where, default: int) -> tuple[int, int]:
    """``io_threads`` and ``max_connections`` (room for every thread's connection)."""
    io_threads = section.integer("io_threads", default, minimum=1, maximum=64)
    max_connections = section.integer("max_connections", 0, minimum=0, maximum=10_000)
    if max_connections and max_connections < io_threads + 2:
        raise ConfigError(
            where("max_connections"),
            max_connections,
            f"0 (automatic) or at least io_threads + 2 = {io_threads + 2}",
        )
    return io_threads, max_connections


def _parse_tls(section: Section, where: Where, url: str, scheme: str) -> _Tls:
    tls = _Tls(
        _existing_file(section, "tls_ca_file", where),
        _existing_file(section, "tls_cert_file", where),
        _existing_file(section, "tls_key_file", where),
        section.boolean("tls_verify", True),
    )
    uses_tls = tls.ca_file or tls.cert_file or tls.key_file or not tls.verify
    if uses_tls and scheme != "rediss":
        raise ConfigError(where("url"), masked_url(url), "a rediss:// URL when tls_* is set")
    if (tls.cert_file is None) != (tls.key_file is None):
        raise ConfigError(where("tls_key_file"), tls.key_file, "set together with tls_cert_file")
    return tls


def _parse_reconnect(section: Section, where: Where, defaults: Options) -> tuple[float, float]:
    initial = section.number(
        "reconnect_initial_s", defaults.reconnect_initial_s, minimum=0.001, maximum=60.0
    )
    most = section.number(
        "reconnect_max_s", defaults.reconnect_max_s, minimum=0.001, maximum=3600.0
    )
    if most < initial:
        raise ConfigError(where("reconnect_max_s"), most, "at least reconnect_initial_s")
    return initial, most


def _existing_file(section: Section, key: str, where: Where) -> str | None:
    value = section.optional_file_path(key)
    if value is not None and not os.path.isfile(value):
        raise ConfigError(where(key), value, "a readable file")
    return value


def masked_url(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: kvtier.redaction's URL rule
    (everything between the first ``:`` after the user name and the last ``@``; a user-info
    without ``:`` masked whole)."""
    return mask_url(url)
