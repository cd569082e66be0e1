"""An in-process tier for tests and simulation: a dict of block copies with fault injection.

What callers may rely on (besides the ``Tier`` contract):

* Capacity (``capacity`` bytes of payload and/or ``capacity_blocks``) is never exceeded; blocks not
  pinned by an in-flight job are evicted in the order of the ``eviction`` policy (``lru`` by
  default) and reported by ``take_evicted``.
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
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.errors import ConfigError
from kvtier.keys import BlockKey, Namespace
from kvtier.policies import DEFAULT_TIER_EVICTION, EvictionPolicy, parse_eviction
from kvtier.pool import HostPool
from kvtier.tiers.base import TierJob, TierJobKind
from kvtier.tiers.block_tier import BlockTier, Fault, Got, JobState, Put
from kvtier.tiers.eviction import tier_policy, victims_for
from kvtier.tiers.payload import HEADER_BYTES
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
    eviction: str = DEFAULT_TIER_EVICTION
    """Which blocks go first when a capacity is reached, as the top-level ``eviction``."""

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
            eviction=parse_eviction(section, DEFAULT_TIER_EVICTION),
        )
        if section.has("eviction") and options.capacity is None and options.capacity_blocks is None:
            raise ConfigError(
                section.field("eviction"),
                options.eviction,
                "a tier with a capacity or capacity_blocks (an unbounded tier evicts nothing)",
            )
        section.done()
        return options


MemoryOptions = Options
"""``Options`` under a name the tier class's ``Options`` attribute does not hide."""


class MemoryTier(BlockTier):
    """Blocks as ``bytes`` copies in a dict; see the module docstring. Validation, header and
    checksum, pins and counters are ``BlockTier``'s; this class keeps the dict, its capacity and
    the latency queue."""

    kind = "memory"
    Options = Options

    def __init__(
        self, name: str, namespace: Namespace, pool: HostPool, options: MemoryOptions | None = None
    ) -> None:
        self.options = options = options if options is not None else MemoryOptions()
        self._policy = _policy(options, pool.slot_bytes)  # before the worker can start
        """None without a capacity (nothing to evict); guarded by ``_lock``."""
        super().__init__(name, namespace, pool)
        self._rng = random.Random(options.seed)
        self._wake = threading.Condition(self._lock)
        # Guarded by _lock; each value a header + payload.
        self._store: dict[BlockKey, bytes] = {}
        self._bytes = 0
        """Payload bytes held (headers are not counted against ``capacity``)."""
        self._queue: list[tuple[float, int, JobState]] = []  # heap by due time
        self._order = itertools.count()
        self._worker: threading.Thread | None = None

    # -- the storage ----------------------------------------------------------------------------

    def exists(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        with self._lock:
            store = self._store
            return [key in store for key in keys]

    def put(self, key: BlockKey, header: bytes, payload: memoryview) -> Put:
        with self._lock:
            if key in self._store:
                self._used(key)
                return Put.KEPT
            if not self._make_room(len(payload)):
                return Put.REJECTED
            self._store[key] = header + bytes(payload)
            self._bytes += len(payload)
            if self._policy is not None:
                self._policy.insert(key)
        return Put.STORED

    def get(self, key: BlockKey, header: memoryview, payload: memoryview) -> Got:
        with self._lock:
            data = self._store.get(key)
            if data is None:
                return Got.MISSING
            if len(data) != len(header) + len(payload):
                return Got.DAMAGED
            self._used(key)
        header[:] = data[: len(header)]
        payload[:] = data[len(header) :]
        return Got.FOUND

    def delete(self, key: BlockKey) -> bool:
        with self._lock:
            return self._drop(key)

    # -- scheduling -----------------------------------------------------------------------------

    def _draw_faults(self, job: TierJob) -> list[Fault] | None:
        """Drawn in submit order from the seeded generator, so a job sequence fails the same
        way every run."""
        rng = self._rng
        opts = self.options
        n = len(job.keys)
        fail = [opts.failure_rate > 0 and rng.random() < opts.failure_rate for _ in range(n)]
        corrupt = [False] * n
        if job.kind is TierJobKind.READ and opts.corrupt_rate > 0:
            corrupt = [rng.random() < opts.corrupt_rate for _ in range(n)]
        if not any(fail) and not any(corrupt):
            return None
        return [
            Fault.FAIL if f else Fault.CORRUPT if c else Fault.NONE
            for f, c in zip(fail, corrupt, strict=True)
        ]

    def _dispatch(self, state: JobState) -> None:
        if self.options.latency_ms <= 0:
            self._run_blocks(state)
            return
        with self._lock:
            due = time.monotonic() + self.options.latency_ms / 1000.0
            heapq.heappush(self._queue, (due, next(self._order), state))
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._work, name=f"kvtier-mem-{self.name}", daemon=True
                )
                self._worker.start()
            self._wake.notify()

    def _close_jobs(self) -> bool:
        """Complete queued jobs at once (results still arrive through ``poll``)."""
        with self._lock:
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
                return True
        return False

    # -- extras ---------------------------------------------------------------------------------

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._bytes

    def is_empty(self) -> bool:
        return len(self) == 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._store)

    # -- internals ------------------------------------------------------------------------------

    def _work(self) -> None:
        while True:
            with self._wake:
                while True:
                    if self._queue:
                        delay = self._queue[0][0] - time.monotonic()
                        # "not delay > 0": a NaN due time counts as due instead of a busy loop.
                        if not delay > 0 or self._closed:
                            state = heapq.heappop(self._queue)[2]
                            break
                        self._wake.wait(min(delay, MAX_WAIT_S))
                    elif self._closed:
                        return
                    else:
                        self._wake.wait()
            self._run_blocks(state)  # outside the lock: the storage methods take it

    def _used(self, key: BlockKey) -> None:
        """Under the lock: a held block was read or stored again."""
        if self._policy is not None:
            self._policy.access(key)

    def _make_room(self, size: int) -> bool:
        """Under the lock: evict unpinned blocks, in the policy's order, until one more of
        ``size`` payload bytes fits; all or nothing."""
        cap_bytes = self.options.capacity
        cap_blocks = self.options.capacity_blocks
        excess_bytes = 0 if cap_bytes is None else self._bytes + size - cap_bytes
        excess_blocks = 0 if cap_blocks is None else len(self._store) + 1 - cap_blocks
        policy = self._policy
        if excess_bytes <= 0 and excess_blocks <= 0:
            return True
        if policy is None:  # no capacity: cannot happen
            return False
        store, pins = self._store, self._pins
        held = [len(store[key]) - HEADER_BYTES for key in pins if key in store]
        if len(store) - len(held) < excess_blocks or self._bytes - sum(held) < excess_bytes:
            return False  # not even every unpinned block would make room: evict none
        largest = max(size, self.pool.slot_bytes)  # every block is one pool slot
        victims = victims_for(
            policy,
            pins,
            store,
            lambda key: len(store[key]) - HEADER_BYTES,
            largest,
            excess_bytes,
            excess_blocks,
        )
        for key in victims:
            data = store.pop(key)  # out of the policy already
            self._bytes -= len(data) - HEADER_BYTES
            excess_bytes -= len(data) - HEADER_BYTES
            excess_blocks -= 1
            self._report_evicted(key)
            self.counters.evictions += 1
        return excess_bytes <= 0 and excess_blocks <= 0  # short: a policy broke its contract

    def _drop(self, key: BlockKey) -> bool:
        """Under the lock: forget ``key``; True when it was held."""
        data = self._store.pop(key, None)
        if data is None:
            return False
        self._bytes -= len(data) - HEADER_BYTES
        if self._policy is not None:
            self._policy.remove(key)
        return True


def _policy(options: MemoryOptions, slot_bytes: int) -> EvictionPolicy | None:
    """The tier's eviction policy, sized in blocks by its tightest limit; None when unbounded."""
    by_bytes = None if options.capacity is None else options.capacity // slot_bytes
    blocks = [n for n in (options.capacity_blocks, by_bytes) if n is not None]
    return tier_policy(options.eviction, min(blocks), "eviction") if blocks else None
