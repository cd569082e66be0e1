"""The ``redis`` tier's job runner: a job's blocks split into batches of ``pipeline_blocks``,
each one pipelined round trip on one of ``io_threads`` I/O threads (each keeping its own
connection), reads before writes; ``EXISTS`` checks and ``DEL`` of corrupt values on a thread of
their own.

Every batch runs under one command deadline of ``timeout_s`` (``redis_deadline``); a kept
connection the server closed while idle is replaced and the batch runs once more within that
deadline (SET and GET are idempotent). Every job is reported exactly once: by the I/O threads, or
failed by ``fail_unfinished`` when the tier closes with batches queued or stuck.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from kvtier.keys import BlockKey
from kvtier.tiers import redis_wire
from kvtier.tiers.base import TierJob, TierJobKind
from kvtier.tiers.redis_blocks import BlockStore, Parts
from kvtier.tiers.redis_client import is_timeout
from kvtier.tiers.redis_deadline import Watchdog

log = logging.getLogger("kvtier.tiers.redis")

EXISTS_BATCH = 1024
"""Keys per pipelined EXISTS round trip."""
_READ_FIRST, _WRITE, _STOP = 0, 1, 2
"""Data queue priorities: promotions are on a request's critical path, cascades are not."""


class MetaOp(Enum):
    EXISTS = "exists"
    DELETE = "delete"


@dataclass(slots=True)
class JobState:
    job: TierJob
    ok: list[bool]
    remaining: int
    """Batches not finished yet (guarded by the runner's lock)."""


@dataclass(slots=True, eq=False)
class Batch:
    state: JobState
    start: int
    stop: int
    """Positions ``[start, stop)`` of the job's keys."""
    reported: bool = False
    """Its result was handed over (once: by its I/O thread or, for a stuck one, by close)."""


class Runner:
    """Queues, threads and batches of one tier; see the module docstring."""

    def __init__(
        self, parts: Parts, watchdog: Watchdog, finish: Callable[[int, list[bool]], None]
    ) -> None:
        self.name = parts.name
        self.options = parts.options
        self._presence = parts.presence
        self._health = parts.health
        self._watchdog = watchdog
        self._count = parts.count
        self._finish = finish
        self._batch_blocks = parts.options.batch_blocks(parts.pool.slot_bytes)
        self.store = BlockStore(parts, self.delete_later)
        self._lock = threading.Lock()
        """Guards job states and ``_running``."""
        self._data_q: queue.PriorityQueue[tuple[int, int, Batch | None]] = queue.PriorityQueue()
        self._meta_q: queue.SimpleQueue[tuple[MetaOp, list[BlockKey]] | None] = queue.SimpleQueue()
        self._order = itertools.count()
        self._running: set[Batch] = set()
        """Batches an I/O thread is working on."""
        self.aborting = False
        """``close`` gave up waiting: batches still queued fail without being sent."""

    def threads(self) -> list[threading.Thread]:
        """The I/O threads and the meta thread (not started)."""
        name = self.name
        threads = [
            threading.Thread(target=self._data_loop, name=f"kvtier-redis-{name}-io{i}", daemon=True)
            for i in range(self.options.io_threads)
        ]
        threads.append(
            threading.Thread(target=self._meta_loop, name=f"kvtier-redis-{name}-meta", daemon=True)
        )
        return threads

    # -- from the manager's thread ----------------------------------------------------------------

    def submit(self, job: TierJob) -> None:
        """Queue a valid, non-empty job's batches (reads ahead of writes)."""
        n = len(job.keys)
        step = self._batch_blocks
        starts = range(0, n, step)
        state = JobState(job, [False] * n, len(starts))
        priority = _READ_FIRST if job.kind is TierJobKind.READ else _WRITE
        for start in starts:
            batch = Batch(state, start, min(start + step, n))
            self._data_q.put((priority, next(self._order), batch))

    def check(self, keys: list[BlockKey]) -> None:
        """Queue ``EXISTS`` of ``keys`` (its answers reach the presence cache)."""
        for start in range(0, len(keys), EXISTS_BATCH):
            self._meta_q.put((MetaOp.EXISTS, keys[start : start + EXISTS_BATCH]))

    def delete_later(self, keys: list[BlockKey]) -> None:
        """Queue ``DEL`` of ``keys``."""
        self._meta_q.put((MetaOp.DELETE, keys))

    # -- closing ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask every thread to stop once the work queued before is done."""
        for _ in range(self.options.io_threads):
            self._data_q.put((_STOP, next(self._order), None))
        self._meta_q.put(None)

    def fail_unfinished(self) -> None:
        """Report the batches still queued, or held by a stuck thread, as failed (never
        dropped)."""
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

    # -- I/O threads ------------------------------------------------------------------------------

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
                self._count(errors=len(ok))
            finally:
                self._batch_done(batch, ok)

    def _run_batch(self, lane: redis_wire.Lane, batch: Batch) -> list[bool]:
        job = batch.state.job
        keys = job.keys[batch.start : batch.stop]
        slots = job.slots[batch.start : batch.stop]
        reading = job.kind is TierJobKind.READ
        client = self._health.client
        if not self._health.healthy or client is None or self.aborting:
            self._count(**{"errors" if reading else "rejected": len(keys)})
            return [False] * len(keys)
        run = self.store.read if reading else self.store.write
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
                self._health.failed(exc, len(keys))
                if not reading:
                    self._presence.forget(keys)
                return [False] * len(keys)
        self._health.replied()  # every reply of the batch was valid RESP
        return ok

    def _meta_loop(self) -> None:
        lane = redis_wire.Lane()
        while True:
            item = self._meta_q.get()
            if item is None:
                lane.close()
                return
            op, keys = item
            client = self._health.client
            if not self._health.healthy or client is None or self.aborting:
                if op is MetaOp.EXISTS:
                    self._presence.forget(keys)
                continue
            with self._watchdog.command(self.options.timeout_s) as deadline:
                try:
                    if op is MetaOp.EXISTS:
                        self.store.exists(client, lane, keys)
                    else:
                        self.store.delete(client, lane, keys)
                except Exception as exc:
                    if deadline.fired and not is_timeout(exc):
                        exc = RedisTimeoutError(f"command deadline passed ({exc})")
                    self._health.failed(exc, 0)
                    if op is MetaOp.EXISTS:
                        self._presence.forget(keys)

    def _batch_done(self, batch: Batch, ok: list[bool]) -> None:
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
