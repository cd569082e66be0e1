"""An in-process tier for tests and simulation: a dict of block copies with fault injection.

What callers may rely on (besides the ``Tier`` contract):

* Capacity (``capacity`` bytes of payload and/or ``capacity_blocks``) is never exceeded; the least
  recently used blocks not pinned by an in-flight job are evicted and reported by ``take_evicted``.
* With ``latency_ms`` > 0 a job completes on a worker thread that long after ``submit``; the slot
  bytes are copied at completion, so slots must stay reserved until the result arrives (as with
  real tiers). With 0 the job completes inside ``submit`` and its result is in the next ``poll``.
* Faults are drawn from ``random.Random(seed)`` at submit, in job order, so the same job sequence
  fails the same way every run. A failed write stores nothing and a failed read returns
  ``ok=False`` (both count ``errors``); a corrupt read scribbles a damaged copy into the slot,
  returns ``ok=False``, counts ``corrupt`` and drops the block, as a real tier does.
* ``close()`` completes queued jobs at once and returns within ``CLOSE_TIMEOUT_S`` (its worker is
  a daemon thread that only copies bytes in memory; the bound guards against it being wedged).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import operator
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.keys import KEY_BYTES, BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import JobKind, Tier, TierJob
from kvtier.validation import Section

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0
"""The most ``close()`` waits for the worker thread."""
MAX_WAIT_S = 1.0
"""The worker wakes at least this often: a due time that is not a finite number (a latency the
config check missed) cannot make it sleep forever, fail its wait or spin."""


@dataclass(frozen=True, slots=True)
class Options:
    capacity: int | None = None
    """Payload bytes; None: no byte limit."""
    capacity_blocks: int | None = None
    """Blocks; None: no block limit. Both limits apply when both are set."""
    latency_ms: float = 0.0
    failure_rate: float = 0.0
    corrupt_rate: float = 0.0
    seed: int = 0

    @classmethod
    def parse(cls, section: Section) -> Options:
        options = cls(
            capacity=section.size("capacity", minimum=1) if section.has("capacity") else None,
            capacity_blocks=(
                section.integer("capacity_blocks", minimum=1)
                if section.has("capacity_blocks")
                else None
            ),
            latency_ms=section.number("latency_ms", 0.0, minimum=0.0, maximum=3_600_000.0),
            failure_rate=section.number("failure_rate", 0.0, minimum=0.0, maximum=1.0),
            corrupt_rate=section.number("corrupt_rate", 0.0, minimum=0.0, maximum=1.0),
            seed=section.integer("seed", 0),
        )
        section.done()
        return options


@dataclass(slots=True)
class _Pending:
    job: TierJob
    fail: list[bool]
    corrupt: list[bool]


class MemoryTier(Tier):
    """Blocks as ``bytes`` copies in a dict; see the module docstring."""

    def __init__(
        self, name: str, namespace: Namespace, pool: HostPool, options: Options | None = None
    ) -> None:
        super().__init__(name, namespace, pool)
        self.options = options if options is not None else Options()
        self._rng = random.Random(self.options.seed)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # Guarded by _lock. Ordered oldest -> most recently used.
        self._store: OrderedDict[BlockKey, bytes] = OrderedDict()
        self._bytes = 0
        self._pins: dict[BlockKey, int] = {}
        self._queue: list[tuple[float, int, _Pending]] = []  # heap by due time
        self._order = itertools.count()
        self._closed = False
        self._worker: threading.Thread | None = None

    # -- the Tier interface ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        with self._lock:
            out: list[bool | None] = [key in self._store for key in keys]
            self.counters.lookups += len(out)
            self.counters.lookup_hits += sum(1 for hit in out if hit)
        return out

    def submit(self, job: TierJob) -> None:
        pending = self._draw_faults(job)
        with self._lock:
            if job.kind is JobKind.READ:
                self.counters.read_jobs += 1
            else:
                self.counters.write_jobs += 1
            if self._closed or len(job.keys) != len(job.slots):
                if len(job.keys) != len(job.slots):
                    self.counters.errors += len(job.keys)
                self._finish(job.job_id, [False] * len(job.keys))
                return
            for key in job.keys:
                self._pins[key] = self._pins.get(key, 0) + 1
            if self.options.latency_ms <= 0:
                self._run(pending)
                return
            due = time.monotonic() + self.options.latency_ms / 1000.0
            heapq.heappush(self._queue, (due, next(self._order), pending))
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._work, name=f"kvtier-mem-{self.name}", daemon=True
                )
                self._worker.start()
            self._wake.notify()

    def close(self) -> None:
        """Complete queued jobs at once (results still arrive through ``poll``); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._wake.notify()
            worker = self._worker
        if worker is not None:
            worker.join(CLOSE_TIMEOUT_S)
            if worker.is_alive():
                log.warning(
                    "memory tier %s: worker still busy after %.0f s; closed without it",
                    self.name,
                    CLOSE_TIMEOUT_S,
                )

    # -- extras ---------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._store)

    # -- internals ------------------------------------------------------------------------------

    def _draw_faults(self, job: TierJob) -> _Pending:
        rng = self._rng
        opts = self.options
        n = len(job.keys)
        fail = [opts.failure_rate > 0 and rng.random() < opts.failure_rate for _ in range(n)]
        corrupt = [False] * n
        if job.kind is JobKind.READ and opts.corrupt_rate > 0:
            corrupt = [rng.random() < opts.corrupt_rate for _ in range(n)]
        return _Pending(job, fail, corrupt)

    def _work(self) -> None:
        with self._wake:
            while True:
                if self._queue:
                    delay = self._queue[0][0] - time.monotonic()
                    # "not delay > 0": a NaN due time counts as due instead of a busy loop.
                    if not delay > 0 or self._closed:
                        self._run(heapq.heappop(self._queue)[2])
                    else:
                        self._wake.wait(min(delay, MAX_WAIT_S))
                elif self._closed:
                    return
                else:
                    self._wake.wait()

    def _run(self, pending: _Pending) -> None:
        """Under the lock: do the job's copies, unpin its keys, hand over the result."""
        job = pending.job
        ok: list[bool] = []
        for i, (key, slot) in enumerate(zip(job.keys, job.slots, strict=True)):
            try:
                if job.kind is JobKind.READ:
                    ok.append(self._read(key, slot, pending.fail[i], pending.corrupt[i]))
                else:
                    ok.append(self._write(key, slot, pending.fail[i]))
            except Exception:  # every job must be reported, as a failure if need be
                self.counters.errors += 1
                ok.append(False)
            pins = self._pins.get(key, 0) - 1
            if pins > 0:
                self._pins[key] = pins
            else:
                self._pins.pop(key, None)
        self._finish(job.job_id, ok)

    def _read(self, key: BlockKey, slot: int, fail: bool, corrupt: bool) -> bool:
        if not self._valid(key, slot):
            return False
        data = self._store.get(key)
        if data is None:
            return False  # a plain miss
        view = self.pool.view(slot)
        if fail:
            self.counters.errors += 1
            return False
        if corrupt or len(data) != len(view):
            # Land damaged bytes in the slot, as a real torn read would: only ok=False protects it.
            damaged = bytearray(data[: len(view)].ljust(len(view), b"\0"))
            damaged[0] ^= 0xFF
            view[:] = damaged
            self.counters.corrupt += 1
            self._drop(key)
            return False
        view[:] = data
        self._store.move_to_end(key)
        self.counters.read_blocks += 1
        self.counters.read_bytes += len(data)
        return True

    def _write(self, key: BlockKey, slot: int, fail: bool) -> bool:
        if not self._valid(key, slot):
            return False
        if key in self._store:
            self._store.move_to_end(key)
            return True
        if fail:
            self.counters.errors += 1
            return False
        size = self.pool.slot_bytes
        if not self._make_room(size):
            self.counters.rejected += 1
            return False
        self._store[key] = bytes(self.pool.view(slot))
        self._bytes += size
        self.counters.write_blocks += 1
        self.counters.write_bytes += size
        return True

    def _make_room(self, size: int) -> bool:
        """Evict least-recent unpinned blocks until one more of ``size`` fits; all or nothing."""
        cap_bytes = self.options.capacity
        cap_blocks = self.options.capacity_blocks
        excess_bytes = 0 if cap_bytes is None else self._bytes + size - cap_bytes
        excess_blocks = 0 if cap_blocks is None else len(self._store) + 1 - cap_blocks
        victims: list[BlockKey] = []
        for key, data in self._store.items():
            if excess_bytes <= 0 and excess_blocks <= 0:
                break
            if self._pins.get(key):
                continue
            victims.append(key)
            excess_bytes -= len(data)
            excess_blocks -= 1
        if excess_bytes > 0 or excess_blocks > 0:
            return False
        for key in victims:
            self._drop(key)
            self.counters.evictions += 1
        return True

    def _drop(self, key: BlockKey) -> None:
        self._bytes -= len(self._store.pop(key))
        self._report_evicted(key)

    def _valid(self, key: BlockKey, slot: int) -> bool:
        try:
            index = operator.index(slot)
        except TypeError:
            index = -1
        if isinstance(key, bytes) and len(key) == KEY_BYTES and 0 <= index < self.pool.num_slots:
            return True
        self.counters.errors += 1
        return False
