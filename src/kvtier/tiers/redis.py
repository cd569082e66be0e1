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
* Connection errors and timeouts mark the tier unhealthy, and so do
  ``redis_health.PROTOCOL_ERRORS_UNHEALTHY`` replies in a row that are no valid RESP (another
  program on the port, a broken or hostile server): ``lookup`` answers ``False`` at once, new
  jobs fail at once (counted in ``rejected`` for writes, ``errors`` for reads), and a
  background probe (``PING``, which must answer ``PONG``, with capped exponential backoff)
  marks it healthy again by itself. The presence cache is dropped then (the server may have
  restarted empty).
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

This module is the ``Tier`` interface; the work is done by one module per concern:
``redis_options`` (options), ``redis_keys`` (key naming, value encoding), ``redis_presence``
(the presence cache), ``redis_health`` (start, probe, health thread, failed commands),
``redis_jobs`` (batches, queues and I/O threads), ``redis_blocks`` (one pipelined round trip of
a batch), ``redis_wire`` (the standalone data path and reply parser), ``redis_client``
(redis-py clients and error sorting) and ``redis_deadline`` (the total deadline per command).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from kvtier.keys import BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import Tier, TierJob, TierJobKind
from kvtier.tiers.block_tier import valid_job
from kvtier.tiers.redis_blocks import Parts
from kvtier.tiers.redis_client import close_client
from kvtier.tiers.redis_deadline import Watchdog
from kvtier.tiers.redis_health import Health
from kvtier.tiers.redis_jobs import Runner
from kvtier.tiers.redis_keys import KeySpace
from kvtier.tiers.redis_options import Options
from kvtier.tiers.redis_presence import Presence, clock

__all__ = ["CLOSE_ABORT_S", "Options", "RedisTier"]

log = logging.getLogger("kvtier.tiers.redis")

CLOSE_ABORT_S = 1.0
"""``close`` waits this long for threads after cutting off their commands."""


class RedisTier(Tier):
    """Blocks in Redis / Valkey; see the module docstring (options: ``Options`` here)."""

    kind = "redis"

    def __init__(
        self, name: str, namespace: Namespace, pool: HostPool, options: Options | None = None
    ) -> None:
        super().__init__(name, namespace, pool)
        self.options = opts = options if options is not None else Options()
        self._keys = KeySpace.of(opts.key_prefix, namespace, pool.slot_bytes)
        self._presence = Presence(opts.presence_entries)
        self._lock = threading.Lock()
        """Guards counters bumped off the manager's thread."""
        self._closed = False
        self._watchdog = Watchdog(f"kvtier-redis-{name}-watchdog")
        self._health = Health(name, opts, self._keys, self._presence, self._watchdog, self._bump)
        parts = Parts(
            name,
            opts,
            pool,
            self._keys,
            self._presence,
            self._health,
            self._bump,
            self._report_evicted,
        )
        self._jobs = Runner(parts, self._watchdog, self._finish)
        try:
            self._health.connect_at_start()
        except BaseException:
            self._watchdog.stop()
            raise
        self._threads = self._jobs.threads()
        self._threads.append(
            threading.Thread(
                target=self._health.loop, name=f"kvtier-redis-{name}-health", daemon=True
            )
        )
        for thread in self._threads:
            thread.start()

    # -- the Tier interface ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        n = len(keys)
        try:
            if self._closed or not self._health.healthy:
                self._bump(lookups=n)
                return [False] * n
            out, ask = self._presence.answer(keys, clock())
            if ask:
                self._jobs.check(ask)
            self._bump(lookups=n, lookup_hits=sum(1 for answer in out if answer))
            return out
        except Exception:  # the contract: never raise into the engine's thread
            log.exception("redis tier %s: lookup failed", self.name)
            return [False] * n

    def submit(self, job: TierJob) -> None:
        n = len(job.keys)
        reading = job.kind is TierJobKind.READ
        self._bump(**{"read_jobs" if reading else "write_jobs": 1})
        try:
            if self._closed or not valid_job(job, self.pool.num_slots):
                self._bump(errors=n)
                self._finish(job.job_id, [False] * n)
                return
            if not self._health.healthy:
                self._bump(**{"errors" if reading else "rejected": n})
                self._finish(job.job_id, [False] * n)
                return
            if n == 0:
                self._finish(job.job_id, [])
                return
            self._jobs.submit(job)
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
            self._health.closed = True
        started = time.monotonic()
        self._jobs.stop()
        self._health.stop.set()
        self._health.probe_needed.set()
        if not self._join(started + self.options.timeout_s):
            # Queued batches fail unsent, running commands are cut off now.
            self._jobs.aborting = True
            self._watchdog.abort_all()
            if not self._join(time.monotonic() + CLOSE_ABORT_S):
                for thread in self._threads:
                    if thread.is_alive():
                        log.warning("redis tier %s: thread %s did not stop", self.name, thread.name)
        # Jobs still queued or held by a stuck thread are reported as failed, never dropped.
        self._jobs.fail_unfinished()
        self._watchdog.stop()
        if self._health.client is not None:
            close_client(self._health.client)

    def _join(self, until: float) -> bool:
        """Wait for every thread until ``until``; True when all stopped."""
        for thread in self._threads:
            thread.join(max(0.0, until - time.monotonic()))
        return not any(thread.is_alive() for thread in self._threads)

    # -- extras ---------------------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """False while the server is unreachable (lookups answer False, jobs fail fast)."""
        return self._health.healthy and not self._closed

    def redis_key(self, key: BlockKey) -> bytes:
        """The Redis key of ``key`` in this tier's namespace."""
        return self._keys.redis_key(key)

    def _bump(self, **deltas: int) -> None:
        counters = self.counters
        with self._lock:
            for name, delta in deltas.items():
                setattr(counters, name, getattr(counters, name) + delta)
