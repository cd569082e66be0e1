"""Health of the ``redis`` tier: the connection at start, the probe (``PING`` must answer
``PONG``), the background loop that probes while healthy and reconnects with capped, jittered
exponential backoff while not, and the sorting of every failed command into counters and
"unhealthy".

Connection errors and timeouts mark the tier unhealthy, and so do ``PROTOCOL_ERRORS_UNHEALTHY``
replies in a row that are no valid RESP (another program on the port, a broken or hostile
server). While unhealthy, the tier answers lookups ``False`` and fails jobs at once; a probe that
sees ``PONG`` makes it healthy again, and the presence cache is dropped then (the server may have
restarted empty), as it is when the periodic probe sees a new server run id.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from kvtier.tiers.redis import wire as redis_wire
from kvtier.tiers.redis.client import (
    Client,
    build_client,
    close_client,
    config_error,
    describe,
    is_protocol_error,
    is_timeout,
    is_unreachable,
)
from kvtier.tiers.redis.deadline import Watchdog
from kvtier.tiers.redis.keys import KeySpace
from kvtier.tiers.redis.options import Options, masked_url
from kvtier.tiers.redis.presence import Presence

log = logging.getLogger("kvtier.tiers.redis")

ERROR_LOG_INTERVAL_S = 10.0
"""At most one warning this often for refused commands (each is counted in ``errors``)."""
PROTOCOL_ERRORS_UNHEALTHY = 3
"""Failed commands in a row whose replies were no valid RESP: the tier turns unhealthy."""
_REFUSALS = ("NOAUTH", "NOPERM", "WRONGPASS")
"""Error replies to PING that mean "not allowed" (a config error at start), not "not Redis"."""

Count = Callable[..., None]
"""The tier's counter update: ``count(errors=1, timeouts=2, ...)``."""


class Health:
    """The client of one tier and whether its server is usable; see the module docstring.

    ``client`` is None until a server answered once; ``healthy`` is read without a lock by the
    tier's threads (a stale answer costs one failed command, never a wrong block)."""

    def __init__(
        self,
        name: str,
        options: Options,
        keys: KeySpace,
        presence: Presence,
        watchdog: Watchdog,
        count: Count,
    ) -> None:
        self.name = name
        self.options = options
        self._keys = keys
        self._presence = presence
        self._watchdog = watchdog
        self._count = count
        self.client: Client | None = None
        self.healthy = False
        self.closed = False
        """The tier is closing: the periodic probe stops probing."""
        self.stop = threading.Event()
        self.probe_needed = threading.Event()
        self._lock = threading.Lock()
        """Guards the healthy transitions and the protocol error streak."""
        self._protocol_errors = 0
        """Commands in a row answered with no valid RESP."""
        self._server_ids: frozenset[str] | None = None
        self._last_error_log = -math.inf
        self._lane = redis_wire.Lane()
        self._max_bulk = max(redis_wire.INFO_MAX_BYTES, keys.value_bytes)

    # -- what the tier's threads report ---------------------------------------------------------

    def failed(self, exc: BaseException, blocks: int) -> None:
        """Count a failed call (``blocks`` blocks lost with it); unreachable -> unhealthy."""
        if is_timeout(exc):
            self._count(timeouts=blocks)
        else:
            self._count(errors=blocks)
        if is_unreachable(exc):
            self.mark_unhealthy(exc)
            return
        if is_protocol_error(exc):
            # One garbled reply may be a fluke; several in a row mean the server (or whatever
            # took its port) cannot answer: stop sending it work until the probe sees PONG.
            with self._lock:
                self._protocol_errors += 1
                streak = self._protocol_errors
            if streak >= PROTOCOL_ERRORS_UNHEALTHY:
                self.mark_unhealthy(exc)
                return
        # Server refusals (OOM under noeviction, ACL, WRONGTYPE) repeat per block: log a few.
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.warning("redis tier %s: %s", self.name, describe(exc, self.options))

    def replied(self) -> None:
        """Every reply of a command was valid RESP: the protocol error streak ends."""
        with self._lock:
            self._protocol_errors = 0

    def mark_unhealthy(self, exc: BaseException) -> None:
        with self._lock:
            if not self.healthy:
                return
            self.healthy = False
            self.probe_needed.set()
        log.warning(
            "redis tier %s: %s unhealthy (%s); going on without it",
            self.name,
            masked_url(self.options.url),
            describe(exc, self.options),
        )

    def ask(
        self, client: Client, lane: redis_wire.Lane, commands: Sequence[tuple[bytes, ...]]
    ) -> list[Any]:
        """Standalone: ``commands`` in one round trip (``redis_wire.ask``)."""
        return redis_wire.ask(lane, client, commands, self._max_bulk)

    # -- start ----------------------------------------------------------------------------------

    def connect_at_start(self) -> None:
        """Connect and probe; a refusal (credentials, ACL, TLS, cluster flag) raises
        ``ConfigError``, anything else starts the tier unhealthy."""
        lane = redis_wire.Lane()
        try:
            with self._watchdog.command(self.options.timeout_s):
                self.client = build_client(self.options)
            self.probe(self.client, lane, at_start=True)
        except Exception as exc:
            lane.close()
            error = config_error(self.options, exc)
            if error is not None:
                if self.client is not None:
                    close_client(self.client)
                raise error from None
            log.warning(
                "redis tier %s: %s unreachable or not a working Redis server at start (%s); "
                "going on without it until it answers",
                self.name,
                masked_url(self.options.url),
                describe(exc, self.options),
            )
            self.probe_needed.set()
            return
        self.healthy = True
        self._server_ids = self._run_ids(self.client, lane)
        self._check_eviction_policy(self.client, lane)
        lane.close()

    def probe(
        self, client: Client, lane: redis_wire.Lane, at_start: bool = False, refresh: bool = True
    ) -> None:
        """Raise unless the server answers PING with PONG (anything else, an error reply
        included, is a ``ProtocolError``: whoever listens is not a working Redis server); at
        start, also check our commands are allowed; ``refresh`` re-reads a cluster's topology
        first. One command deadline for all of it."""
        with self._watchdog.command(self.options.timeout_s):
            if self.options.cluster:
                replies = self._probe_cluster(client, at_start, refresh)
            else:
                replies = self._probe_standalone(client, lane, at_start)
        if at_start:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply

    def _probe_cluster(self, client: Client, at_start: bool, refresh: bool) -> list[Any]:
        if refresh and not at_start:
            client.nodes_manager.initialize()
        info = client.cluster_info()
        state = info.get("cluster_state") if isinstance(info, dict) else None
        if state not in (None, "ok", b"ok"):
            raise ConnectionRefusedError(f"cluster_state is {state!r}")
        if client.ping(target_nodes=client.PRIMARIES) is not True:
            raise redis_wire.ProtocolError("PING did not answer PONG")
        if not at_start:
            return []
        probe = self._keys.probe_key
        pipe = client.pipeline(transaction=False)
        pipe.execute_command("EXISTS", probe)
        pipe.execute_command("GET", probe)
        pipe.execute_command("DEL", probe)
        replies: list[Any] = pipe.execute(raise_on_error=False)
        return replies

    def _probe_standalone(self, client: Client, lane: redis_wire.Lane, at_start: bool) -> list[Any]:
        probe = self._keys.probe_key
        commands: list[tuple[bytes, ...]] = [(b"PING",)]
        if at_start:
            commands += [(b"EXISTS", probe), (b"GET", probe), (b"DEL", probe)]
        replies = self.ask(client, lane, commands)
        pong = replies.pop(0)
        if pong != b"PONG":
            if isinstance(pong, ResponseError) and str(pong).startswith(_REFUSALS):
                raise pong  # credentials or ACL: a ConfigError at start
            raise redis_wire.ProtocolError(f"PING answered {str(pong)[:60]!r}")
        return replies

    def _check_eviction_policy(self, client: Client, lane: redis_wire.Lane) -> None:
        """Warn if the server would refuse writes once full (best effort: CONFIG may be denied)."""
        try:
            with self._watchdog.command(self.options.timeout_s):
                if self.options.cluster:
                    config = client.config_get("maxmemory*")
                    if isinstance(config, dict) and config:
                        first = next(iter(config.values()))
                        config = first if isinstance(first, dict) else config
                else:
                    (pairs,) = self.ask(client, lane, [(b"CONFIG", b"GET", b"maxmemory*")])
                    items = [str(v, errors="replace") for v in pairs]
                    config = dict(zip(items[::2], items[1::2], strict=True))
            policy = str(config.get("maxmemory-policy", ""))
            maxmemory = int(config.get("maxmemory", 0) or 0)
        except Exception:
            return
        if maxmemory == 0 or not policy.startswith(("allkeys-", "volatile-")):
            log.warning(
                "redis tier %s: server has maxmemory=%d, maxmemory-policy=%s; set maxmemory "
                "and maxmemory-policy allkeys-lru (docs/redis.md) or writes fail when it is full",
                self.name,
                maxmemory,
                policy or "?",
            )

    # -- the health thread ----------------------------------------------------------------------

    def loop(self) -> None:
        """The health thread: probe every ``health_interval_s`` while healthy, and with backoff
        while not, until ``stop``."""
        opts = self.options
        try:
            while not self.stop.is_set():
                if not self.probe_needed.wait(opts.health_interval_s):
                    self._check_alive()
                    continue
                delay = opts.reconnect_initial_s
                while not self.stop.is_set():
                    # Jitter keeps many engines from probing a restarted server in lockstep.
                    if self.stop.wait(delay * random.uniform(0.5, 1.0)):
                        return
                    if self._try_recover():
                        break
                    delay = min(delay * 2, opts.reconnect_max_s)
        finally:
            self._lane.close()

    def _check_alive(self) -> None:
        """Periodic probe while healthy: an idle tier notices a lost (or replaced) server too,
        and a server that restarted (new run id, nothing persisted) invalidates what we
        believed it held."""
        client = self.client
        if client is None or self.closed or not self.healthy:
            return
        try:
            self.probe(client, self._lane, refresh=False)
        except Exception as exc:
            self.failed(exc, 0)
            self.mark_unhealthy(exc)  # no PONG: whatever answered, it is no working Redis
            return
        run_ids = self._run_ids(client, self._lane)
        if run_ids is not None:
            if self._server_ids is not None and run_ids != self._server_ids:
                log.warning("redis tier %s: server restarted; forgetting what it held", self.name)
                self._presence.clear()
            self._server_ids = run_ids

    def _run_ids(self, client: Client, lane: redis_wire.Lane) -> frozenset[str] | None:
        """The servers' run ids (best effort: INFO may be denied by an ACL)."""
        try:
            with self._watchdog.command(self.options.timeout_s):
                if self.options.cluster:
                    info = client.info("server", target_nodes=client.PRIMARIES)
                    values = info.values() if isinstance(info, dict) else []
                    ids = [v.get("run_id") for v in values if isinstance(v, dict)]
                    if not ids and isinstance(info, dict):
                        ids = [info.get("run_id")]
                else:
                    (text,) = self.ask(client, lane, [(b"INFO", b"server")])
                    ids = [
                        line[7:].decode(errors="replace")
                        for line in text.split(b"\r\n")
                        if line.startswith(b"run_id:")
                    ]
        except Exception:
            return None
        if not ids or not all(isinstance(i, str) for i in ids):
            return None
        return frozenset(str(i) for i in ids)

    def _try_recover(self) -> bool:
        lane = self._lane
        try:
            if self.client is None:
                with self._watchdog.command(self.options.timeout_s):
                    self.client = build_client(self.options)
                self.probe(self.client, lane, at_start=True)
            else:
                self.probe(self.client, lane)
        except Exception as exc:
            log.debug("redis tier %s: probe failed: %s", self.name, describe(exc, self.options))
            return False
        # The server may have restarted empty, or others changed it meanwhile.
        self._presence.clear()
        self._server_ids = self._run_ids(self.client, lane)
        with self._lock:
            self.probe_needed.clear()
            self._protocol_errors = 0
            self.healthy = True
        log.warning("redis tier %s: %s healthy again", self.name, masked_url(self.options.url))
        return True
