"""A secondary tier on Redis or Valkey (standalone or cluster), shared by engine instances and
nodes.

Each block is one string value under ``<key_prefix>:<namespace hex>:<key hex>``: kvtier's 64-byte
payload header (namespace, key, length, XXH3-128 checksum) followed by the bytes of one pool slot.
The namespace digest covers the model fingerprint and the tenant, so two models or two tenants
never see each other's blocks. Keys carry no hash tag: in a cluster they spread over all slots,
and pipelines are split per node by redis-py. Nothing read from the server is ever unpickled or
executed.

What callers may rely on (besides the ``Tier`` contract):

* ``lookup`` answers from a local presence cache and never waits on the network. Keys it does not
  know are answered ``None`` and checked with one pipelined ``EXISTS`` batch on the lookup thread;
  the next ``lookup`` sees the answer (each answer is served at least once). Absent keys are
  remembered for ``negative_cache_s``; present keys until a read finds them gone (or, with a TTL,
  until shortly before it would expire).
* A read reports ``ok=True`` only after the value's header matched and the checksum of the bytes
  landed in the slot matched. A mismatch is a miss: ``counters.corrupt`` is bumped, the remote
  copy deleted and the key reported by ``take_evicted``. A key the server no longer holds (TTL,
  ``maxmemory`` eviction) is a miss reported the same way and counted in ``evictions``.
* A value of the wrong Redis type at a key of ours (``WRONGTYPE``) is corrupt too: counted,
  deleted and reported. Only keys under this tier's ``<key_prefix>:<namespace>:`` are ever
  deleted.
* Connection errors and timeouts mark the tier unhealthy, and so do ``PROTOCOL_ERRORS_UNHEALTHY``
  replies in a row that are no valid RESP (another program on the port, a broken or hostile
  server): ``lookup`` answers ``False`` at once, new jobs fail at once (counted in ``rejected``
  for writes, ``errors`` for reads), and a background probe (``PING``, which must answer
  ``PONG``, with capped exponential backoff) marks it healthy again by itself. The presence
  cache is dropped then (the server may have restarted empty).
* Every command on the network (a pipelined batch counts as one: connect, send, every reply)
  has one total deadline of ``timeout_s``, enforced by ``redis_deadline``: a server that
  trickles its replies fails the command at its deadline, and the job is reported. Nothing
  read is allocated from a length the server sent (``redis_wire``). Nothing retries in a loop
  but the probe. Wrong credentials, ACL denials and TLS failures at start raise ``ConfigError``
  (password masked); an unreachable server (or another program on the port) at start only
  starts the tier unhealthy.
* ``close`` returns within ``timeout_s + CLOSE_ABORT_S`` whatever the server does: queued jobs
  run until ``timeout_s`` after the call, then every command still running is cut off, and
  every job is reported (failed if not done).
* Capacity is the server's: configure ``maxmemory`` and ``maxmemory-policy allkeys-lru`` there
  (see docs/redis.md).
"""

from __future__ import annotations

import itertools
import logging
import math
import queue
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtier.keys import BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers import redis_deadline, redis_wire
from kvtier.tiers.base import JobKind, Tier, TierJob
from kvtier.tiers.block_tier import valid_job
from kvtier.tiers.payload import HEADER_BYTES, block_matches, encode_header
from kvtier.tiers.redis_client import (
    BlockValue,
    Client,
    build_client,
    close_client,
    config_error,
    describe,
    is_protocol_error,
    is_timeout,
    is_unreachable,
)
from kvtier.tiers.redis_options import Options, masked_url

__all__ = ["Options", "RedisTier"]

log = logging.getLogger("kvtier.tiers.redis")

EXISTS_BATCH = 1024
"""Keys per pipelined EXISTS round trip."""
ERROR_LOG_INTERVAL_S = 10.0
"""At most one warning this often for refused commands (each is counted in ``errors``)."""
POSITIVE_TTL_MARGIN = 0.9
"""With a TTL, a key written (or read) is believed present for this fraction of the TTL."""
CLOSE_ABORT_S = 1.0
"""``close`` waits this long for threads after cutting off their commands."""
PROTOCOL_ERRORS_UNHEALTHY = 3
_REFUSALS = ("NOAUTH", "NOPERM", "WRONGPASS")
"""Error replies to PING that mean "not allowed" (a config error at start), not "not Redis"."""
"""Failed commands in a row whose replies were no valid RESP: the tier turns unhealthy."""
INFO_MAX_BYTES = 256 * 1024
"""Largest INFO or CONFIG reply read (INFO server is ~2 KiB)."""
_READ_FIRST, _WRITE, _STOP = 0, 1, 2
"""Data queue priorities: promotions are on a request's critical path, cascades are not."""


class _MetaOp(Enum):
    EXISTS = "exists"
    DELETE = "delete"


@dataclass(slots=True)
class _JobState:
    job: TierJob
    ok: list[bool]
    remaining: int
    """Batches not finished yet (guarded by the tier's ``_lock``)."""


@dataclass(slots=True, eq=False)
class _Batch:
    state: _JobState
    start: int
    stop: int
    """Positions ``[start, stop)`` of the job's keys."""
    reported: bool = False
    """Its result was handed over (once: by its I/O thread or, for a stuck one, by close)."""


class _Presence:
    """What this process believes the server holds: a bounded, thread-safe map.

    An entry is a signed expiry time: ``+t`` present until ``t``, ``-t`` absent until ``t``. Keys
    being checked are ``pending``; answers not yet served by ``answer`` are ``unserved`` and are
    served once even if expired, so a short negative cache can never starve a lookup.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._entries: dict[BlockKey, float] = {}
        self._pending: set[BlockKey] = set()
        self._unserved: set[BlockKey] = set()

    def answer(self, keys: Sequence[BlockKey], now: float) -> tuple[list[bool | None], list[Any]]:
        """Answers for ``keys`` and the unknown keys to check (now marked pending)."""
        out: list[bool | None] = []
        ask: list[BlockKey] = []
        with self._lock:
            entries, pending, unserved = self._entries, self._pending, self._unserved
            for key in keys:
                value = entries.get(key)
                if value is not None:
                    if key in unserved:
                        unserved.discard(key)
                        out.append(value > 0)
                        continue
                    if abs(value) > now:
                        out.append(value > 0)
                        continue
                    del entries[key]
                out.append(None)
                if key not in pending:
                    pending.add(key)
                    ask.append(key)
        return out, ask

    def set(self, key: BlockKey, present: bool, until: float) -> None:
        """A fact learned from our own read, write or delete (wins over pending checks)."""
        with self._lock:
            self._pending.discard(key)
            self._put(key, until if present else -until)

    def resolve(
        self, keys: Sequence[BlockKey], present: Sequence[bool], pos: float, neg: float
    ) -> None:
        """EXISTS answers; keys no longer pending were settled by a read or write meanwhile."""
        with self._lock:
            pending = self._pending
            for key, here in zip(keys, present, strict=True):
                if key in pending:
                    pending.discard(key)
                    self._put(key, pos if here else -neg)
                    self._unserved.add(key)

    def forget(self, keys: Sequence[BlockKey]) -> None:
        """Unknown again (a failed check or write): the next lookup asks the server."""
        with self._lock:
            for key in keys:
                self._pending.discard(key)
                self._entries.pop(key, None)
                self._unserved.discard(key)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._pending.clear()
            self._unserved.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _put(self, key: BlockKey, value: float) -> None:
        entries = self._entries
        entries.pop(key, None)  # re-insert at the end: oldest entries are dropped first
        entries[key] = value
        if len(entries) > self._capacity:
            oldest = next(iter(entries))
            del entries[oldest]
            self._unserved.discard(oldest)


def _now() -> float:
    # Offset so that a present entry's expiry is always > 0 (the sign carries presence).
    return time.monotonic() + 1.0


class RedisTier(Tier):
    """Blocks in Redis / Valkey; see the module docstring (options: ``Options`` here)."""

    def __init__(
        self, name: str, namespace: Namespace, pool: HostPool, options: Options | None = None
    ) -> None:
        super().__init__(name, namespace, pool)
        self.options = opts = options if options is not None else Options()
        self._digest = namespace.digest
        self._prefix = f"{opts.key_prefix}:{namespace.hex}:".encode()
        self._value_bytes = HEADER_BYTES + pool.slot_bytes
        self._batch_blocks = opts.batch_blocks(pool.slot_bytes)
        self._presence = _Presence(opts.presence_entries)
        self._lock = threading.Lock()
        """Guards counters bumped off the manager's thread and job states."""
        self._closed = False
        self._healthy = False
        self._stop = threading.Event()
        self._probe_needed = threading.Event()
        self._data_q: queue.PriorityQueue[tuple[int, int, _Batch | None]] = queue.PriorityQueue()
        self._meta_q: queue.SimpleQueue[tuple[_MetaOp, list[BlockKey]] | None] = queue.SimpleQueue()
        self._order = itertools.count()
        self._client: Client | None = None
        self._wire = not opts.cluster
        """Standalone: blocks move on the socket directly (redis_wire); cluster: redis-py
        pipelines, which route each key to its node."""
        self._server_ids: frozenset[str] | None = None
        self._last_error_log = -math.inf
        self._protocol_errors = 0
        """Commands in a row answered with no valid RESP (guarded by ``_lock``)."""
        self._running: set[_Batch] = set()
        """Batches an I/O thread is working on (guarded by ``_lock``)."""
        self._aborting = False
        """``close`` gave up waiting: batches still queued fail without being sent."""
        self._health_lane = redis_wire.Lane()
        self._watchdog = redis_deadline.Watchdog(f"kvtier-redis-{name}-watchdog")

        try:
            self._connect_at_start()
        except BaseException:
            self._watchdog.stop()
            raise
        self._threads = [
            threading.Thread(target=self._data_loop, name=f"kvtier-redis-{name}-io{i}", daemon=True)
            for i in range(opts.io_threads)
        ]
        self._threads.append(
            threading.Thread(target=self._meta_loop, name=f"kvtier-redis-{name}-meta", daemon=True)
        )
        self._threads.append(
            threading.Thread(
                target=self._health_loop, name=f"kvtier-redis-{name}-health", daemon=True
            )
        )
        for thread in self._threads:
            thread.start()

    # -- the Tier interface ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        n = len(keys)
        try:
            if self._closed or not self._healthy:
                self._bump(lookups=n)
                return [False] * n
            out, ask = self._presence.answer(keys, _now())
            if ask:
                for start in range(0, len(ask), EXISTS_BATCH):
                    self._meta_q.put((_MetaOp.EXISTS, ask[start : start + EXISTS_BATCH]))
            self._bump(lookups=n, lookup_hits=sum(1 for answer in out if answer))
            return out
        except Exception:  # the contract: never raise into the engine's thread
            log.exception("redis tier %s: lookup failed", self.name)
            return [False] * n

    def submit(self, job: TierJob) -> None:
        n = len(job.keys)
        reading = job.kind is JobKind.READ
        self._bump(**{"read_jobs" if reading else "write_jobs": 1})
        try:
            if self._closed or not valid_job(job, self.pool.num_slots):
                self._bump(errors=n)
                self._finish(job.job_id, [False] * n)
                return
            if not self._healthy:
                self._bump(**{"errors" if reading else "rejected": n})
                self._finish(job.job_id, [False] * n)
                return
            if n == 0:
                self._finish(job.job_id, [])
                return
            step = self._batch_blocks
            starts = range(0, n, step)
            state = _JobState(job, [False] * n, len(starts))
            priority = _READ_FIRST if reading else _WRITE
            for start in starts:
                batch = _Batch(state, start, min(start + step, n))
                self._data_q.put((priority, next(self._order), batch))
        except Exception:  # pragma: no cover - defensive: a job must always be reported
            log.exception("redis tier %s: submit failed", self.name)
            self._finish(job.job_id, [False] * n)

    def close(self) -> None:
        """Finish queued jobs for up to ``timeout_s``, then cut off what still runs; every job
        is reported (failed if not done). Returns within ``timeout_s + CLOSE_ABORT_S``."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        started = time.monotonic()
        for _ in range(self.options.io_threads):
            self._data_q.put((_STOP, next(self._order), None))
        self._meta_q.put(None)
        self._stop.set()
        self._probe_needed.set()
        if not self._join(started + self.options.timeout_s):
            # Queued batches fail unsent, running commands are cut off now.
            self._aborting = True
            self._watchdog.abort_all()
            if not self._join(time.monotonic() + CLOSE_ABORT_S):
                for thread in self._threads:
                    if thread.is_alive():
                        log.warning("redis tier %s: thread %s did not stop", self.name, thread.name)
        # Jobs still queued or held by a stuck thread are reported as failed, never dropped.
        while True:
            try:
                _, _, batch = self._data_q.get_nowait()
            except queue.Empty:
                break
            if batch is not None:
                self._batch_done(batch, [False] * (batch.stop - batch.start))
        with self._lock:
            stuck = list(self._running)
        for batch in stuck:
            self._batch_done(batch, [False] * (batch.stop - batch.start))
        self._watchdog.stop()
        if self._client is not None:
            close_client(self._client)

    def _join(self, until: float) -> bool:
        """Wait for every thread until ``until``; True when all stopped."""
        for thread in self._threads:
            thread.join(max(0.0, until - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    # -- extras ---------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """False while the server is unreachable (lookups answer False, jobs fail fast)."""
        return self._healthy and not self._closed

    def redis_key(self, key: BlockKey) -> bytes:
        """The Redis key of ``key`` in this tier's namespace."""
        return self._prefix + key.hex().encode()

    # -- start and health -----------------------------------------------------------------------

    def _connect_at_start(self) -> None:
        lane = redis_wire.Lane()
        try:
            with self._watchdog.command(self.options.timeout_s):
                self._client = build_client(self.options)
            self._probe(self._client, lane, at_start=True)
        except Exception as exc:
            lane.close()
            error = config_error(self.options, exc)
            if error is not None:
                if self._client is not None:
                    close_client(self._client)
                raise error from None
            log.warning(
                "redis tier %s: %s unreachable or not a working Redis server at start (%s); "
                "going on without it until it answers",
                self.name,
                masked_url(self.options.url),
                describe(exc, self.options),
            )
            self._probe_needed.set()
            return
        self._healthy = True
        self._server_ids = self._run_ids(self._client, lane)
        self._check_eviction_policy(self._client, lane)
        lane.close()

    def _probe(
        self, client: Client, lane: redis_wire.Lane, at_start: bool = False, refresh: bool = True
    ) -> None:
        """Raise unless the server answers PING with PONG (anything else, an error reply
        included, is a ``ProtocolError``: whoever listens is not a working Redis server); at
        start, also check our commands are allowed; ``refresh`` re-reads a cluster's topology
        first. One command deadline for all of it."""
        probe = self._prefix + b"probe"
        with self._watchdog.command(self.options.timeout_s):
            if self.options.cluster:
                if refresh and not at_start:
                    client.nodes_manager.initialize()
                info = client.cluster_info()
                state = info.get("cluster_state") if isinstance(info, dict) else None
                if state not in (None, "ok", b"ok"):
                    raise ConnectionRefusedError(f"cluster_state is {state!r}")
                if client.ping(target_nodes=client.PRIMARIES) is not True:
                    raise redis_wire.ProtocolError("PING did not answer PONG")
                if at_start:
                    pipe = client.pipeline(transaction=False)
                    pipe.execute_command("EXISTS", probe)
                    pipe.execute_command("GET", probe)
                    pipe.execute_command("DEL", probe)
                    replies = pipe.execute(raise_on_error=False)
            else:
                commands: list[tuple[bytes, ...]] = [(b"PING",)]
                if at_start:
                    commands += [(b"EXISTS", probe), (b"GET", probe), (b"DEL", probe)]
                replies = self._ask(client, lane, commands)
                pong = replies.pop(0)
                if pong != b"PONG":
                    if isinstance(pong, ResponseError) and str(pong).startswith(_REFUSALS):
                        raise pong  # credentials or ACL: a ConfigError at start
                    raise redis_wire.ProtocolError(f"PING answered {str(pong)[:60]!r}")
        if at_start:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply

    def _ask(
        self, client: Client, lane: redis_wire.Lane, commands: Sequence[tuple[bytes, ...]]
    ) -> list[Any]:
        """Standalone: ``commands`` in one round trip on ``lane``, their replies (errors as
        ``ResponseError`` values), within the command deadline of the caller. Like a batch, it
        runs once more on a fresh connection when a kept one was closed while idle (the
        commands sent here are all idempotent)."""
        data = b"".join(redis_wire.command(*args) for args in commands)
        limit = max(INFO_MAX_BYTES, self._value_bytes)
        for attempt in (1, 2):
            try:
                with lane.on(client) as wire:
                    wire.send([data])
                    return [wire.reply(limit) for _ in commands]
            except RedisConnectionError:
                deadline = redis_deadline.current()
                if attempt == 2 or not lane.reused or (deadline is not None and deadline.fired):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

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
                    (pairs,) = self._ask(client, lane, [(b"CONFIG", b"GET", b"maxmemory*")])
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

    def _mark_unhealthy(self, exc: BaseException) -> None:
        with self._lock:
            if not self._healthy:
                return
            self._healthy = False
            self._probe_needed.set()
        log.warning(
            "redis tier %s: %s unhealthy (%s); going on without it",
            self.name,
            masked_url(self.options.url),
            describe(exc, self.options),
        )

    def _health_loop(self) -> None:
        opts = self.options
        try:
            while not self._stop.is_set():
                if not self._probe_needed.wait(opts.health_interval_s):
                    self._check_alive()
                    continue
                delay = opts.reconnect_initial_s
                while not self._stop.is_set():
                    # Jitter keeps many engines from probing a restarted server in lockstep.
                    if self._stop.wait(delay * random.uniform(0.5, 1.0)):
                        return
                    if self._try_recover():
                        break
                    delay = min(delay * 2, opts.reconnect_max_s)
        finally:
            self._health_lane.close()

    def _check_alive(self) -> None:
        """Periodic probe while healthy: an idle tier notices a lost (or replaced) server too,
        and a server that restarted (new run id, nothing persisted) invalidates what we
        believed it held."""
        client = self._client
        if client is None or self._closed or not self._healthy:
            return
        try:
            self._probe(client, self._health_lane, refresh=False)
        except Exception as exc:
            self._io_failed(exc, 0)
            self._mark_unhealthy(exc)  # no PONG: whatever answered, it is no working Redis
            return
        run_ids = self._run_ids(client, self._health_lane)
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
                    (text,) = self._ask(client, lane, [(b"INFO", b"server")])
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
        lane = self._health_lane
        try:
            if self._client is None:
                with self._watchdog.command(self.options.timeout_s):
                    self._client = build_client(self.options)
                self._probe(self._client, lane, at_start=True)
            else:
                self._probe(self._client, lane)
        except Exception as exc:
            log.debug("redis tier %s: probe failed: %s", self.name, describe(exc, self.options))
            return False
        # The server may have restarted empty, or others changed it meanwhile.
        self._presence.clear()
        self._server_ids = self._run_ids(self._client, lane)
        with self._lock:
            self._probe_needed.clear()
            self._protocol_errors = 0
            self._healthy = True
        log.warning("redis tier %s: %s healthy again", self.name, masked_url(self.options.url))
        return True

    # -- I/O threads ----------------------------------------------------------------------------

    def _data_loop(self) -> None:
        lane = redis_wire.Lane()
        while True:
            _, _, batch = self._data_q.get()
            if batch is None:
                lane.close()
                return
            ok = [False] * (batch.stop - batch.start)
            with self._lock:
                self._running.add(batch)
            try:
                ok = self._run_batch(lane, batch)
            except Exception:  # pragma: no cover - defensive: the batch is still reported
                log.exception("redis tier %s: batch failed", self.name)
                self._bump(errors=len(ok))
            finally:
                self._batch_done(batch, ok)

    def _run_batch(self, lane: redis_wire.Lane, batch: _Batch) -> list[bool]:
        job = batch.state.job
        keys = job.keys[batch.start : batch.stop]
        slots = job.slots[batch.start : batch.stop]
        reading = job.kind is JobKind.READ
        client = self._client
        if not self._healthy or client is None or self._aborting:
            self._bump(**{"errors" if reading else "rejected": len(keys)})
            return [False] * len(keys)
        run = self._read if reading else self._write
        with self._watchdog.command(self.options.timeout_s) as deadline:
            try:
                try:
                    ok = run(client, lane, keys, slots)
                except RedisConnectionError:
                    # A kept connection the server closed while it sat idle (its ``timeout``):
                    # SET and GET are idempotent, so the batch runs once more on a fresh one
                    # (within the same deadline).
                    if not lane.reused or deadline.fired:
                        raise
                    ok = run(client, lane, keys, slots)
            except Exception as exc:
                if deadline.fired and not is_timeout(exc):
                    # The watchdog cut the socket: the reason is the deadline, not the server.
                    exc = RedisTimeoutError(f"command deadline passed ({exc})")
                self._io_failed(exc, len(keys))
                if not reading:
                    self._presence.forget(keys)
                return [False] * len(keys)
        with self._lock:
            self._protocol_errors = 0  # every reply of the batch was valid RESP
        return ok

    def _write(
        self, client: Client, lane: redis_wire.Lane, keys: list[BlockKey], slots: list[int]
    ) -> list[bool]:
        digest, view = self._digest, self.pool.view
        ttl = self.options.ttl_ms
        payloads = [view(slot) for slot in slots]
        headers = [encode_header(digest, k, p) for k, p in zip(keys, payloads, strict=True)]
        rkeys = [self.redis_key(key) for key in keys]
        replies: list[Any]
        if self._wire:
            with lane.on(client) as wire:
                wire.send(redis_wire.set_chunks(rkeys, headers, payloads, ttl))
                replies = [wire.simple() for _ in keys]
        else:
            pipe = client.pipeline(transaction=False)
            for rkey, header, payload in zip(rkeys, headers, payloads, strict=True):
                value = BlockValue(header, payload)
                if ttl is None:
                    pipe.execute_command("SET", rkey, value)
                else:
                    pipe.execute_command("SET", rkey, value, "PX", ttl)
            replies = pipe.execute(raise_on_error=False)
        until = self._present_until()
        ok: list[bool] = []
        for key, reply in zip(keys, replies, strict=True):
            if isinstance(reply, Exception):
                self._io_failed(reply, 1)
                self._presence.forget([key])
                ok.append(False)
            elif reply is True or reply == b"OK" or reply == "OK":
                self._presence.set(key, True, until)
                ok.append(True)
            else:
                # SET answers OK or an error, nothing else: the batch fails as a protocol error.
                raise redis_wire.ProtocolError(f"SET answered {str(reply)[:60]!r}")
        written = sum(ok)
        self._bump(write_blocks=written, write_bytes=written * self.pool.slot_bytes)
        return ok

    def _read(
        self, client: Client, lane: redis_wire.Lane, keys: list[BlockKey], slots: list[int]
    ) -> list[bool]:
        ttl = self.options.ttl_ms if self.options.ttl_touch_on_read else None
        rkeys = [self.redis_key(key) for key in keys]
        ok: list[bool] = []
        if self._wire:
            header = memoryview(bytearray(HEADER_BYTES))
            with lane.on(client) as wire:
                wire.send([redis_wire.get_command(rkeys, ttl)])
                for key, slot in zip(keys, slots, strict=True):
                    target = self.pool.view(slot)
                    got = wire.block(header, target)
                    if got is redis_wire.Got.VALUE:
                        ok.append(self._verify(key, header, target))
                    else:
                        ok.append(self._not_read(key, got))
                    if got is redis_wire.Got.TOO_BIG:
                        # Its bytes were not read: the replies after it cannot be either.
                        unread = len(keys) - len(ok)
                        self._bump(errors=unread)
                        ok += [False] * unread
                        break
        else:
            pipe = client.pipeline(transaction=False)
            for rkey in rkeys:
                if ttl is None:
                    pipe.execute_command("GET", rkey)
                else:
                    pipe.execute_command("GETEX", rkey, "PX", ttl)
            replies = pipe.execute(raise_on_error=False)
            for key, slot, reply in zip(keys, slots, replies, strict=True):
                if isinstance(reply, bytes) and len(reply) == self._value_bytes:
                    data = memoryview(reply)
                    target = self.pool.view(slot)
                    target[:] = data[HEADER_BYTES:]  # the one unavoidable copy here
                    ok.append(self._verify(key, data[:HEADER_BYTES], target))
                elif isinstance(reply, bytes):
                    ok.append(self._not_read(key, redis_wire.Got.WRONG_SIZE))
                elif reply is None:
                    ok.append(self._not_read(key, redis_wire.Got.MISSING))
                else:
                    ok.append(self._not_read(key, reply))
        got_blocks = sum(ok)
        self._bump(read_blocks=got_blocks, read_bytes=got_blocks * self.pool.slot_bytes)
        return ok

    def _verify(self, key: BlockKey, header: memoryview, payload: memoryview) -> bool:
        """A value's header and the checksum of the bytes now in the slot."""
        if block_matches(header, self._digest, key, payload):
            self._presence.set(key, True, self._present_until())
            return True
        return self._corrupt(key)

    def _not_read(self, key: BlockKey, outcome: Any) -> bool:
        """A read that found no usable value: missing, of the wrong size, or an error."""
        if outcome is redis_wire.Got.MISSING:
            # The server dropped it (TTL, maxmemory) or never had it: a miss, not an error.
            self._presence.set(key, False, _now() + self.options.negative_cache_s)
            self._report_evicted(key)
            self._bump(evictions=1)
        elif (
            outcome in (redis_wire.Got.WRONG_SIZE, redis_wire.Got.TOO_BIG)
            or not isinstance(outcome, BaseException)
            or (isinstance(outcome, ResponseError) and str(outcome).startswith("WRONGTYPE"))
        ):
            # Not a block of ours: another size, or a list, hash, set... at a kvtier key.
            self._corrupt(key)
        else:
            self._io_failed(outcome, 1)
        return False

    def _corrupt(self, key: BlockKey) -> bool:
        """A value that is not a valid block of this key: count it, drop it, report it."""
        self._bump(corrupt=1)
        log.warning("redis tier %s: corrupt value for key %s dropped", self.name, key.hex())
        self._presence.set(key, False, _now() + self.options.negative_cache_s)
        self._report_evicted(key)
        self._meta_q.put((_MetaOp.DELETE, [key]))
        return False

    def _meta_loop(self) -> None:
        lane = redis_wire.Lane()
        while True:
            item = self._meta_q.get()
            if item is None:
                lane.close()
                return
            op, keys = item
            client = self._client
            if not self._healthy or client is None or self._aborting:
                if op is _MetaOp.EXISTS:
                    self._presence.forget(keys)
                continue
            with self._watchdog.command(self.options.timeout_s) as deadline:
                try:
                    if op is _MetaOp.EXISTS:
                        self._exists(client, lane, keys)
                    else:
                        self._delete(client, lane, keys)
                except Exception as exc:
                    if deadline.fired and not is_timeout(exc):
                        exc = RedisTimeoutError(f"command deadline passed ({exc})")
                    self._io_failed(exc, 0)
                    if op is _MetaOp.EXISTS:
                        self._presence.forget(keys)

    def _meta_replies(
        self, client: Client, lane: redis_wire.Lane, command: bytes, keys: list[BlockKey]
    ) -> list[Any]:
        """``command <redis key>`` for each key in one round trip; each reply must be an
        integer or an error reply (anything else is a ``ProtocolError``)."""
        rkeys = [self.redis_key(key) for key in keys]
        if self._wire:
            replies = self._ask(client, lane, [(command, rkey) for rkey in rkeys])
        else:
            pipe = client.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.execute_command(command.decode(), rkey)
            replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if not isinstance(reply, int | Exception) or isinstance(reply, bool):
                raise redis_wire.ProtocolError(f"{command.decode()} answered {str(reply)[:60]!r}")
        with self._lock:
            self._protocol_errors = 0
        return replies

    def _delete(self, client: Client, lane: redis_wire.Lane, keys: list[BlockKey]) -> None:
        # Only keys of this tier's namespace: redis_key() puts every one under self._prefix.
        for reply in self._meta_replies(client, lane, b"DEL", keys):
            if isinstance(reply, Exception):
                self._io_failed(reply, 0)

    def _exists(self, client: Client, lane: redis_wire.Lane, keys: list[BlockKey]) -> None:
        replies = self._meta_replies(client, lane, b"EXISTS", keys)
        known: list[BlockKey] = []
        present: list[bool] = []
        failed: list[BlockKey] = []
        for key, reply in zip(keys, replies, strict=True):
            if isinstance(reply, Exception):
                failed.append(key)
                self._io_failed(reply, 0)
            else:
                known.append(key)
                present.append(reply > 0)
        now = _now()
        self._presence.resolve(
            known, present, self._present_until(now), now + self.options.negative_cache_s
        )
        if failed:
            self._presence.forget(failed)

    # -- helpers --------------------------------------------------------------------------------

    def _present_until(self, now: float | None = None) -> float:
        ttl_s = self.options.ttl_s
        if ttl_s is None:
            return math.inf
        return (now if now is not None else _now()) + ttl_s * POSITIVE_TTL_MARGIN

    def _io_failed(self, exc: BaseException, blocks: int) -> None:
        """Count a failed call (``blocks`` blocks lost with it); unreachable -> unhealthy."""
        if is_timeout(exc):
            self._bump(timeouts=blocks)
        else:
            self._bump(errors=blocks)
        if is_unreachable(exc):
            self._mark_unhealthy(exc)
            return
        if is_protocol_error(exc):
            # One garbled reply may be a fluke; several in a row mean the server (or whatever
            # took its port) cannot answer: stop sending it work until the probe sees PONG.
            with self._lock:
                self._protocol_errors += 1
                streak = self._protocol_errors
            if streak >= PROTOCOL_ERRORS_UNHEALTHY:
                self._mark_unhealthy(exc)
                return
        # Server refusals (OOM under noeviction, ACL, WRONGTYPE) repeat per block: log a few.
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.warning("redis tier %s: %s", self.name, describe(exc, self.options))

    def _batch_done(self, batch: _Batch, ok: list[bool]) -> None:
        state = batch.state
        with self._lock:
            if batch.reported:  # close() reported it for a thread that was stuck
                return
            batch.reported = True
            self._running.discard(batch)
            state.ok[batch.start : batch.stop] = ok
            state.remaining -= 1
            done = state.remaining == 0
        if done:
            self._finish(state.job.job_id, state.ok)

    def _bump(self, **deltas: int) -> None:
        counters = self.counters
        with self._lock:
            for name, delta in deltas.items():
                setattr(counters, name, getattr(counters, name) + delta)
