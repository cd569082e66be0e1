"""The tier skeleton: everything a secondary tier does around its storage, so that a storage
supplies only ``put`` / ``get`` / ``exists`` / ``delete`` of single blocks.

``BlockTier`` keeps the ``Tier`` contract (``base.py``) for its subclasses:

* **Validation.** A job whose key and slot lists differ in length fails whole (``errors`` += its
  keys); a block whose key is not ``KEY_BYTES`` bytes or whose slot is not a slot of the pool fails
  alone (``errors`` += 1). The storage never sees either.
* **Header and checksum.** A write hands the storage the 64-byte header (``payload.py``) to keep in
  front of the payload; a read hands it a header buffer and the pool slot to fill. A block counts
  as read only after the header matched (namespace, key, length) and the payload's checksum did.
* **Corrupt -> drop.** A header or checksum mismatch, or a storage answer ``Got.DAMAGED`` (not a
  block of ours: a wrong size, a FIFO), is a miss counted in ``corrupt``; the block is deleted and
  reported through ``take_evicted``.
* **Pins.** Every key of a job is pinned from ``submit`` until its block is done:
  ``pinned(key)`` tells a storage's own eviction what it must not drop.
* **Counters.** Jobs, blocks and bytes moved, errors, rejections and corrupt blocks are counted
  here, under one lock, from whichever thread.
* **Fan-out.** ``threads`` = 0 runs a job inside ``submit`` (its result is in the next ``poll``);
  otherwise up to ``threads`` tasks per job take its blocks one by one on a ``WorkerPool`` that
  stays usable when threads hang (``workers.py``): a job is failed at once while every thread is
  stuck, queued blocks fail after ``stuck_after_s``. A subclass may schedule jobs its own way by
  overriding ``_dispatch``.
* **Faults.** ``_draw_faults`` (none by default) lets a tier fail or corrupt chosen blocks, for
  tests and simulation (the memory tier's ``failure_rate`` and ``corrupt_rate``).

Storage methods run on I/O threads (or inside ``submit``), may block, and may raise: an exception
fails that block (``errors``), never the job's report. ``exists`` runs on the manager's thread
inside ``lookup`` and must not block on I/O.
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvtier.keys import KEY_BYTES, BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import JobResult, Tier, TierJob, TierJobKind
from kvtier.tiers.payload import HEADER_BYTES, block_matches, encode_header
from kvtier.tiers.workers import WorkerPool

log = logging.getLogger(__name__)


class Put(Enum):
    """What a storage did with a block handed to ``put``."""

    STORED = "stored"
    """Written; visible to ``exists`` and ``get`` from now on."""
    KEPT = "kept"
    """Already held (blocks never change): nothing written, the write succeeds."""
    REJECTED = "rejected"
    """No room (capacity, every candidate pinned): counted in ``rejected``."""
    FAILED = "failed"
    """The write failed: counted in ``errors``."""


class Got(Enum):
    """What a storage found for a block asked of ``get``."""

    FOUND = "found"
    """Header and payload were read into the buffers: the skeleton verifies them."""
    MISSING = "missing"
    """Not held: a plain miss."""
    DAMAGED = "damaged"
    """Something that cannot be a block of ours is there: corrupt (counted, dropped)."""
    FAILED = "failed"
    """The read failed (I/O error): counted in ``errors``; the block is kept."""


class Fault(Enum):
    """An injected fault of one block (``_draw_faults``)."""

    NONE = "none"
    FAIL = "fail"
    """The block's I/O fails (a read still finds out whether the block is held)."""
    CORRUPT = "corrupt"
    """A read lands a damaged payload in the slot."""


def valid_block(key: object, slot: object, num_slots: int) -> bool:
    """A key of ``KEY_BYTES`` bytes (a longer one would be cut in the header and could collide)
    and a slot index of the pool."""
    try:
        index = operator.index(slot)  # type: ignore[arg-type]
    except TypeError:
        return False
    return isinstance(key, bytes) and len(key) == KEY_BYTES and 0 <= index < num_slots


def valid_job(job: TierJob, num_slots: int) -> bool:
    """Every block of ``job`` valid and as many slots as keys."""
    return len(job.keys) == len(job.slots) and all(
        valid_block(key, slot, num_slots) for key, slot in zip(job.keys, job.slots, strict=True)
    )


@dataclass(slots=True, eq=False)
class JobState:
    """A job on its way through the skeleton (the block lists are the job's own copies)."""

    job_id: int
    kind: TierJobKind
    keys: list[BlockKey]
    slots: list[int]
    faults: list[Fault] | None
    ok: list[bool] = field(init=False)
    remaining: int = field(init=False)
    """Blocks not done yet (guarded by the tier's lock)."""
    cursor: Iterator[int] = field(init=False, default_factory=itertools.count)
    """Next block to take; shared by the job's tasks (``next`` on a count is atomic)."""

    def __post_init__(self) -> None:
        self.ok = [False] * len(self.keys)
        self.remaining = len(self.keys)


class BlockTier(Tier):
    """A tier over a block storage; see the module docstring. Subclasses implement ``exists``,
    ``put``, ``get`` and ``delete`` and may override ``_draw_faults``, ``_dispatch`` and
    ``_close_storage``."""

    def __init__(
        self,
        name: str,
        namespace: Namespace,
        pool: HostPool,
        *,
        threads: int = 0,
        stuck_after_s: float = 10.0,
    ) -> None:
        super().__init__(name, namespace, pool)
        self._digest = namespace.digest
        self._lock = threading.Lock()
        """Guards counters, pins and job states; a subclass may guard its storage with it too
        (never held while a storage method is called by the skeleton)."""
        self._pins: dict[BlockKey, int] = {}
        self._closed = False
        self._close_timeout_s = stuck_after_s
        self._workers = (
            WorkerPool(f"kvtier-{name}", threads, stuck_after_s) if threads > 0 else None
        )
        self._threads = threads

    # -- the storage (subclasses) ---------------------------------------------------------------

    @abstractmethod
    def exists(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        """For each key: held (True), not held (False), not known yet (None); never blocks."""

    @abstractmethod
    def put(self, key: BlockKey, header: bytes, payload: memoryview) -> Put:
        """Keep ``header`` followed by ``payload`` (a pool slot: copy it, do not keep the view)."""

    @abstractmethod
    def get(self, key: BlockKey, header: memoryview, payload: memoryview) -> Got:
        """Read the block's header into ``header`` and its payload into ``payload`` (a pool
        slot); both must be filled exactly for ``Got.FOUND``."""

    @abstractmethod
    def delete(self, key: BlockKey) -> bool:
        """Drop the block; True when it was held (it is then reported as evicted)."""

    # -- the Tier interface ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        try:
            out = self.exists(keys)
        except Exception:  # the contract: never raise into the engine's thread
            log.exception("tier %s: lookup failed", self.name)
            out = [False] * len(keys)
        hits = out.count(True)  # answers are True, False or None
        counters = self.counters
        with self._lock:  # counted inline: lookups are the manager's hot path
            counters.lookups += len(out)
            counters.lookup_hits += hits
        return out

    def submit(self, job: TierJob) -> None:
        n = len(job.keys)
        faults = self._draw_faults(job)
        self._count(**{"read_jobs" if job.kind is TierJobKind.READ else "write_jobs": 1})
        if n != len(job.slots):
            self._count(errors=n)
            self._finish(job.job_id, [False] * n)
            return
        if self._closed or n == 0:
            self._finish(job.job_id, [False] * n)
            return
        state = JobState(job.job_id, job.kind, list(job.keys), list(job.slots), faults)
        with self._lock:
            # Pinned from submit on, so a write submitted later cannot evict what this job moves.
            pins = self._pins
            for key in state.keys:
                pins[key] = pins.get(key, 0) + 1
        self._dispatch(state)

    def poll(self) -> list[JobResult]:
        if self._workers is not None:
            # Blocks queued behind stuck threads for longer than stuck_after_s fail here.
            self._workers.expire()
        return super().poll()

    def close(self) -> None:
        """Let queued jobs finish (their results still arrive through ``poll``) for up to
        ``stuck_after_s``, then fail the blocks not started and abandon those on stuck threads;
        then ``_close_storage``. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        abandoned = self._close_jobs()
        self._close_storage(abandoned)

    @property
    def stuck_threads(self) -> int:
        """I/O threads busy on one block for longer than ``stuck_after_s`` (0 without threads)."""
        return 0 if self._workers is None else self._workers.stuck

    # -- hooks ----------------------------------------------------------------------------------

    def _draw_faults(self, job: TierJob) -> list[Fault] | None:
        """Faults to inject into the job's blocks (called in ``submit``, in job order)."""
        return None

    def _dispatch(self, state: JobState) -> None:
        """Run the job's blocks: inline without threads, else a few tasks per job on the worker
        pool, each taking the next block until none is left (blocks spread over the threads
        without one queued task, and its cost on this thread, per block)."""
        workers = self._workers
        if workers is None:
            self._run_blocks(state)
            return
        label = f"{state.kind.value} job {state.job_id}"
        started = 0
        for _ in range(min(len(state.keys), self._threads)):
            if not workers.submit(
                lambda: self._run_blocks(state), lambda: self._fail_rest(state), label
            ):
                break  # closed, or every thread stuck: fail fast rather than queue forever
            started += 1
        if started == 0:
            self._fail_rest(state)

    def _run_on_worker(self, run: Callable[[], None], fail: Callable[[], None], label: str) -> bool:
        """Queue a task of the tier's own (a rescan, say) on its I/O threads; False (nothing
        queued) when the tier has no threads, is closed or every thread is stuck. ``fail`` runs
        instead of ``run`` when the task expires in the queue or the tier closes first."""
        if self._workers is None or self._closed:
            return False
        return self._workers.submit(run, fail, label)

    def _close_jobs(self) -> bool:
        """Finish or fail queued jobs; True when some block was abandoned on a stuck thread."""
        if self._workers is None:
            return False
        return bool(self._workers.close(self._close_timeout_s))

    def _close_storage(self, abandoned: bool) -> None:
        """Release the storage (``abandoned``: a stuck thread may still be using it)."""

    # -- per block ------------------------------------------------------------------------------

    def pinned(self, key: BlockKey) -> bool:
        """Under the lock: a job moves this key now, so the storage must not evict it."""
        return key in self._pins

    def _run_blocks(self, state: JobState) -> None:
        n = len(state.keys)
        reading = state.kind is TierJobKind.READ
        for i in state.cursor:
            if i >= n:
                return
            key = state.keys[i]
            fault = Fault.NONE if state.faults is None else state.faults[i]
            ok = False
            try:
                if not valid_block(key, state.slots[i], self.pool.num_slots):
                    self._count(errors=1)
                elif reading:
                    ok = self._read_block(key, state.slots[i], fault)
                else:
                    ok = self._write_block(key, state.slots[i], fault)
            except Exception:  # last line of defence: every job must be reported, as a failure
                log.debug("tier %s: block failed", self.name, exc_info=True)
                self._count(errors=1)
            finally:
                self._block_done(state, i, ok)

    def _fail_rest(self, state: JobState) -> None:
        """Fail the blocks of a job no thread has taken yet (refused or expired work)."""
        n = len(state.keys)
        for i in state.cursor:
            if i >= n:
                return
            self._count(errors=1)
            self._block_done(state, i, False)

    def _read_block(self, key: BlockKey, slot: int, fault: Fault) -> bool:
        header = memoryview(bytearray(HEADER_BYTES))
        payload = self.pool.view(slot)
        got = self.get(key, header, payload)
        if got is Got.MISSING:
            return False
        if got is Got.FAILED or (got is Got.FOUND and fault is Fault.FAIL):
            self._count(errors=1)
            return False
        if got is Got.FOUND and fault is Fault.CORRUPT:
            payload[0] ^= 0xFF  # as a torn read would land: only the checksum protects it
        if got is Got.FOUND and block_matches(header, self._digest, key, payload):
            self._count(read_blocks=1, read_bytes=len(payload))
            return True
        self.drop_corrupt(key)
        return False

    def _write_block(self, key: BlockKey, slot: int, fault: Fault) -> bool:
        payload = self.pool.view(slot)
        if fault is Fault.FAIL:
            if self.exists([key])[0]:
                return True  # held already: nothing to write, so nothing fails
            self._count(errors=1)
            return False
        result = self.put(key, encode_header(self._digest, key, payload), payload)
        if result is Put.STORED:
            self._count(write_blocks=1, write_bytes=len(payload))
        elif result is Put.REJECTED:
            self._count(rejected=1)
        elif result is Put.FAILED:
            self._count(errors=1)
        return result is Put.STORED or result is Put.KEPT

    def drop_corrupt(self, key: BlockKey) -> None:
        """Count a block that is not a valid block of ``key``, delete it, report it evicted."""
        self._count(corrupt=1)
        log.warning("tier %s: corrupt block %s dropped", self.name, key.hex())
        try:
            held = self.delete(key)
        except Exception:
            log.debug("tier %s: delete failed", self.name, exc_info=True)
            self._count(errors=1)
            held = True  # whatever is there is not ours to serve: forget it either way
        if held:
            self._report_evicted(key)

    def _block_done(self, state: JobState, i: int, ok: bool) -> None:
        key = state.keys[i]
        with self._lock:
            state.ok[i] = ok
            pins = self._pins.get(key, 0) - 1
            if pins > 0:
                self._pins[key] = pins
            else:
                self._pins.pop(key, None)
            state.remaining -= 1
            last = state.remaining == 0
        if last:
            self._finish(state.job_id, state.ok)

    def _count(self, **deltas: int) -> None:
        counters = self.counters
        with self._lock:
            for name, delta in deltas.items():
                setattr(counters, name, getattr(counters, name) + delta)
