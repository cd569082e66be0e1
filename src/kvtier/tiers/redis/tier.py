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
  know are answered ``None`` and checked with one pipelined ``EXISTS`` batch on the aside thread;
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
* Connection errors and timeouts mark the tier unhealthy, and so do
  ``health.PROTOCOL_ERRORS_UNHEALTHY`` replies in a row that are no valid RESP (another
  program on the port, a broken or hostile server): ``lookup`` answers ``False`` at once, new
  jobs fail at once (counted in ``rejected`` for writes, ``errors`` for reads), and a
  background probe (``PING``, which must answer ``PONG``, with capped exponential backoff)
  marks it healthy again by itself. The presence cache is dropped then (the server may have
  restarted empty).
* Every command on the network (a pipelined batch counts as one: connect, send, every reply)
  has one total deadline of ``timeout_s``, enforced by ``deadline``: a server that
  trickles its replies fails the command at its deadline, and the job is reported. Nothing
  read is allocated from a length the server sent (``wire``). Nothing retries in a loop
  but the probe. Wrong credentials, ACL denials and TLS failures at start raise ``ConfigError``
  (password masked); an unreachable server (or another program on the port) at start only
  starts the tier unhealthy.
* ``close`` returns within ``timeout_s + CLOSE_ABORT_S`` whatever the server does: queued jobs
  run until ``timeout_s`` after the call, then every command still running is cut off, and
  every job is reported (failed if not done).
* Capacity is the server's: configure ``maxmemory`` and ``maxmemory-policy allkeys-lru`` there
  (see docs/redis.md).

``RedisTier`` is a ``BlockTier`` (``block_tier.py``: validation, header and checksum, corrupt ->
drop, pins, counters, fan-out to threads): its batches are ``pipeline_blocks`` blocks, one
pipelined round trip each, on ``io_threads`` threads that keep one connection each (their
``thread_state``), reads ahead of writes; ``EXISTS`` checks and ``DEL`` of corrupt values run on
the skeleton's aside thread, never behind block batches; the health gate is the server's health,
and ``close`` cuts off commands still running at ``timeout_s``. The work is done by one module per
concern: ``options`` (options), ``keys`` (key naming), ``presence`` (the
presence cache), ``health`` (start, probe, health thread, failed commands),
``blocks`` (one pipelined round trip of a batch), ``wire`` (the standalone data path
and reply parser), ``client`` (redis-py clients and error sorting) and ``deadline``
(the total deadline per command).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtier.keys import BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.block_tier import BlockTier, Got, Put, Views
from kvtier.tiers.redis import wire as redis_wire
from kvtier.tiers.redis.blocks import BlockStore, Parts
from kvtier.tiers.redis.client import Client, close_client, is_timeout
from kvtier.tiers.redis.deadline import Watchdog
from kvtier.tiers.redis.health import Health
from kvtier.tiers.redis.keys import KeySpace
from kvtier.tiers.redis.options import Options
from kvtier.tiers.redis.presence import Presence, clock

__all__ = ["CLOSE_ABORT_S", "Options", "RedisTier"]

log = logging.getLogger("kvtier.tiers.redis")

CLOSE_ABORT_S = 1.0
"""``close`` waits this long for threads after cutting off their commands."""
EXISTS_BATCH = 1024
"""Keys per pipelined EXISTS round trip."""

T = TypeVar("T")
RoundTrip = Callable[[Client, redis_wire.Lane], T]


RedisOptions = Options
"""``Options`` under a name the tier class's ``Options`` attribute does not hide."""


class RedisTier(BlockTier):
    """Blocks in Redis / Valkey; see the module docstring (options: ``Options`` here)."""

    kind = "redis"
    Options = Options
    cut_off_grace_s = CLOSE_ABORT_S

    def __init__(
        self, name: str, namespace: Namespace, pool: HostPool, options: RedisOptions | None = None
    ) -> None:
        opts = options if options is not None else RedisOptions()
        super().__init__(
            name,
            namespace,
            pool,
            threads=opts.io_threads,
            # Never "stuck": every command has its deadline, and queued batches wait their turn.
            stuck_after_s=math.inf,
            batch_size=opts.batch_blocks(pool.slot_bytes),
            reads_first=True,
            aside_thread=True,
            thread_state=redis_wire.Lane,
            close_timeout_s=opts.timeout_s,
        )
        self.options = opts
        self._keys = KeySpace.of(opts.key_prefix, namespace, pool.slot_bytes)
        self._presence = Presence(opts.presence_entries)
        self._aborting = False
        """``close`` cut off running commands: batches still queued fail unsent."""
        self._watchdog = Watchdog(f"kvtier-redis-{name}-watchdog")
        self._health = Health(name, opts, self._keys, self._presence, self._watchdog, self._count)
        self._store = BlockStore(
            Parts(
                opts,
                pool,
                self._keys,
                self._presence,
                self._health,
                self._count,
                self._report_evicted,
            )
        )
        self._health_thread = threading.Thread(
            target=self._health.loop, name=f"kvtier-redis-{name}-health", daemon=True
        )
        try:
            self._health.connect_at_start()
        except BaseException:
            self.close()
            raise
        self._health_thread.start()

    # -- the storage ----------------------------------------------------------------------------

    def exists(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        """From the presence cache; unknown keys are checked with ``EXISTS`` on the aside
        thread (``None`` until then). ``False`` at once while unhealthy."""
        if self._closed or not self._health.healthy:
            return [False] * len(keys)
        out, ask = self._presence.answer(keys, clock())
        for start in range(0, len(ask), EXISTS_BATCH):
            self._check(ask[start : start + EXISTS_BATCH])
        return out

    def put(self, key: BlockKey, header: bytes, payload: memoryview) -> Put:
        return self.put_batch([key], [header], [payload])[0]

    def get(self, key: BlockKey, header: memoryview, payload: memoryview) -> Got:
        return self.get_batch([key], [header], [payload])[0]

    def put_batch(
        self, keys: Sequence[BlockKey], headers: Sequence[bytes], payloads: Views
    ) -> list[Put]:
        """One pipelined ``SET`` round trip."""
        store = self._store
        return self._round_trip(lambda c, lane: store.write(c, lane, keys, headers, payloads))

    def get_batch(self, keys: Sequence[BlockKey], headers: Views, payloads: Views) -> list[Got]:
        """One pipelined ``GET`` (``GETEX``) round trip into the header buffers and slots."""
        store = self._store
        return self._round_trip(lambda c, lane: store.read(c, lane, keys, headers, payloads))

    def delete(self, key: BlockKey) -> bool:
        """A value that is no block of ours: absent from now on, its ``DEL`` sent on the aside
        thread (off the data path)."""
        self._presence.set(key, False, clock() + self.options.negative_cache_s)
        keys = [key]
        self._aside(lambda c, lane: self._store.delete(c, lane, keys), lambda: None, "DEL")
        return True

    # -- the skeleton's hooks -------------------------------------------------------------------

    def _healthy(self) -> bool:
        return not self._aborting and self._health.healthy and self._health.client is not None

    def _batch_failed(self, exc: Exception, keys: list[BlockKey], reading: bool) -> None:
        """Counted as timeouts or errors; an unreachable server makes the tier unhealthy."""
        self._health.failed(exc, len(keys))
        if not reading:
            self._presence.forget(keys)  # a SET may or may not have landed

    def _cut_off(self) -> None:
        self._aborting = True
        self._watchdog.abort_all()

    def _close_jobs(self) -> bool:
        """Stop the health thread too, within the same bound as the I/O threads."""
        started = time.monotonic()
        health = self._health
        health.closed = True
        health.stop.set()
        health.probe_needed.set()
        abandoned = super()._close_jobs()
        thread = self._health_thread
        if thread.ident is not None:  # started
            thread.join(max(0.0, started + self.options.timeout_s - time.monotonic()))
            if thread.is_alive():
                self._cut_off()
                thread.join(
                    max(0.0, started + self.options.timeout_s + CLOSE_ABORT_S - time.monotonic())
                )
            if thread.is_alive():
                log.warning("redis tier %s: thread %s did not stop", self.name, thread.name)
        return abandoned

    def _close_storage(self, abandoned: bool) -> None:
        self._watchdog.stop()
        if self._health.client is not None:
            close_client(self._health.client)

    # -- extras ---------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """False while the server is unreachable (lookups answer False, jobs fail fast)."""
        return self._health.healthy and not self._closed

    def redis_key(self, key: BlockKey) -> bytes:
        """The Redis key of ``key`` in this tier's namespace."""
        return self._keys.redis_key(key)

    # -- commands -------------------------------------------------------------------------------

    def _round_trip(self, run: RoundTrip[T]) -> T:
        """One command on this I/O thread's kept connection within one deadline of
        ``timeout_s``. A kept connection the server closed while idle (its ``timeout``) is
        replaced and the command runs once more within that deadline (every command the tier
        sends this way is idempotent). Raises what failed, a cut-off socket as a timeout."""
        client = self._health.client
        if client is None:
            raise RedisConnectionError("no connection to the server yet")
        lane = self._thread_state()
        assert isinstance(lane, redis_wire.Lane)
        with self._watchdog.command(self.options.timeout_s) as deadline:
            try:
                try:
                    out = run(client, lane)
                except RedisConnectionError:
                    if not lane.reused or deadline.fired:
                        raise
                    out = run(client, lane)
            except Exception as exc:
                if deadline.fired and not is_timeout(exc):
                    # The watchdog cut the socket: the reason is the deadline, not the server.
                    raise RedisTimeoutError(f"command deadline passed ({exc})") from exc
                raise
        self._health.replied()  # every reply of the command was valid RESP
        return out

    def _check(self, keys: list[BlockKey]) -> None:
        """``EXISTS`` of ``keys`` on the aside thread; its answers reach the presence cache
        (unknown again when it fails: the next lookup asks again)."""
        forget = lambda: self._presence.forget(keys)  # noqa: E731
        self._aside(lambda c, lane: self._store.exists(c, lane, keys), forget, "EXISTS")

    def _aside(self, run: RoundTrip[None], failed: Callable[[], None], label: str) -> None:
        """``run`` as one command on the aside thread; ``failed`` when it cannot run or fails
        (counted in nothing: no block is lost with a key check)."""

        def task() -> None:
            if not self._healthy():
                failed()
                return
            try:
                self._round_trip(run)
            except Exception as exc:
                self._health.failed(exc, 0)
                failed()

        if not self._run_on_worker(task, failed, label, aside=True):
            failed()
