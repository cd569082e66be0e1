"""The secondary-tier interface: asynchronous jobs that move whole blocks between pool slots and
storage.

Contract every tier keeps (the manager relies on it):

* ``lookup``, ``submit`` and ``poll`` are called from one thread (the manager's) and never block on
  I/O and never raise: I/O runs on the tier's own threads or event loop.
* A job's bytes go straight from/to ``pool.view(slot)``; a read writes only the slots of its job.
* A read reports ``ok=True`` for a block only after its full payload was read and verified (header
  and checksum); anything else is ``False`` (a miss), counted in ``counters``.
* Every submitted job is reported by ``poll`` exactly once, failures included.
* ``close`` waits for running jobs and releases threads and connections; later calls are no-ops.

How a tier class is built from the config, the same for every kind (built-in or a plugin): its
``Options`` record parses the tier's keys (``Options.parse(section)``, ``TierOptions``), and
``create(name, namespace, pool, options)`` builds it (by default ``cls(name, namespace, pool,
options)``: a constructor of these four is all a tier needs).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Protocol

from kvtier.keys import BlockKey, Namespace
from kvtier.metrics import TierCounters
from kvtier.pool import HostPool
from kvtier.validation import Section


class TierJobKind(Enum):
    READ = "read"
    """Storage -> pool slots (promotion)."""
    WRITE = "write"
    """Pool slots -> storage (cascade)."""


@dataclass(slots=True)
class TierJob:
    job_id: int
    kind: TierJobKind
    keys: list[BlockKey]
    slots: list[int]


@dataclass(slots=True)
class JobResult:
    job_id: int
    ok: list[bool]
    """One flag per key of the job, in order."""
    busy_s: float | None = None
    """Seconds the tier worked on the job, from its first block to its last (waiting in the
    tier's queue excluded); None: not measured. The manager learns the tier's read speed from it
    (``kvtier.cache.promotion.ReadCost``)."""


class TierOptions(Protocol):
    """A tier's options record: ``parse`` validates the tier's keys of its config section, with
    field-named ``ConfigError`` s, and refuses unknown keys (``section.done()``)."""

    @classmethod
    def parse(cls, section: Section) -> Any: ...


class Tier(ABC):
    """A secondary tier. Subclasses implement the abstract methods and keep the contract above."""

    Options: ClassVar[type[TierOptions]]
    """The tier's options record (a class attribute: ``Options = Options``)."""

    @classmethod
    def create(cls, name: str, namespace: Namespace, pool: HostPool, options: Any) -> Tier:
        """The one call that builds a tier from its config (``cache.factory``), with
        ``Options.parse``'s record: ``cls(name, namespace, pool, options)`` unless overridden."""
        build: Callable[[str, Namespace, HostPool, Any], Tier] = cls  # type: ignore[assignment]
        return build(name, namespace, pool, options)

    def __init__(self, name: str, namespace: Namespace, pool: HostPool) -> None:
        self.name = name
        self.namespace = namespace
        self.pool = pool
        self.counters = TierCounters()
        self._done: deque[JobResult] = deque()
        self._evicted: deque[BlockKey] = deque()

    @abstractmethod
    def lookup(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        """For each key: True (stored here), False (not here) or None (not known yet: ask again)."""

    def is_empty(self) -> bool:
        """True only when the tier surely holds no block (the manager then skips its lookup)."""
        return False

    def generation(self) -> int | None:
        """A number that changes after every change of what ``lookup`` would answer (a block
        stored, dropped, evicted or found gone): while it stays the same, the manager reuses a
        waiting request's answers instead of asking again. None (the default): answers are not
        kept, the tier is asked every time. Called on the manager's thread; never blocks."""
        return None

    @abstractmethod
    def submit(self, job: TierJob) -> None:
        """Start a job; its result arrives through ``poll``."""

    def poll(self) -> list[JobResult]:
        """Results of finished jobs since the last call (thread-safe hand-off from I/O threads)."""
        done = self._done
        out: list[JobResult] = []
        while done:
            out.append(done.popleft())
        return out

    def take_evicted(self) -> list[BlockKey]:
        """Keys this tier dropped on its own (capacity, corruption) since the last call."""
        evicted = self._evicted
        out: list[BlockKey] = []
        while evicted:
            out.append(evicted.popleft())
        return out

    @abstractmethod
    def close(self) -> None:
        """Finish or cancel running jobs, release resources."""

    # -- helpers for subclasses -----------------------------------------------------------------

    def _finish(self, job_id: int, ok: list[bool], busy_s: float | None = None) -> None:
        """Hand a result to ``poll``; callable from any thread (deque appends are atomic)."""
        self._done.append(JobResult(job_id, ok, busy_s))

    def _report_evicted(self, key: BlockKey) -> None:
        self._evicted.append(key)


class WriteMode(Enum):
    """When the manager copies a pool block to a secondary tier."""

    THROUGH = "through"
    """As soon as the block is stored in the pool."""
    ON_EVICT = "on_evict"
    """When the pool evicts the block (the slot stays reserved until the write finished)."""
