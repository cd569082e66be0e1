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
  here, under one lock, from whichever thread; lookups by the manager's thread alone, unlocked.
* **Fan-out.** ``threads`` = 0 runs a job inside ``submit`` (its result is in the next ``poll``);
  otherwise up to ``threads`` tasks per job take its batches (``batch_size`` blocks each, 1 by
  default) one by one on a ``WorkerPool`` that stays usable when threads hang (``workers.py``): a
  job is failed at once while every thread is stuck, queued blocks fail after ``stuck_after_s``.
  A subclass may schedule jobs its own way by overriding ``_dispatch``.
* **Faults.** ``_draw_faults`` (none by default) lets a tier fail or corrupt chosen blocks, for
  tests and simulation (the memory tier's ``failure_rate`` and ``corrupt_rate``).

Hooks for a storage with round trips and a server (the ``redis`` tier), all off by default:

* ``batch_size`` > 1 hands ``put_batch`` / ``get_batch`` up to that many blocks (one pipelined
  round trip; the defaults loop over ``put`` / ``get``). An exception fails the batch's blocks and
  goes to ``_batch_failed`` (default: ``errors``).
* ``thread_state``: a per-thread object (a kept connection) made on a thread's first
  ``_thread_state()`` call and closed by the pool when the thread ends.
* ``reads_first``: read jobs (promotions, on a request's path) are queued ahead of write jobs, and
  a write task lets queued reads run between its batches; ``aside_thread``: one more thread for
  ``_run_on_worker(..., aside=True)`` tasks (key checks) that never wait behind batches.
* ``_healthy()``, the health gate, asked in ``submit`` and before each batch: while False, a job
  (or a batch, unsent) fails at once, counted in ``errors`` for reads and ``rejected`` for writes.
* ``close_timeout_s`` (default ``stuck_after_s``) bounds how long ``close`` lets queued work run;
  with ``cut_off_grace_s`` > 0, ``_cut_off()`` is called then (to make running calls return) and
  ``close`` waits that much longer before failing what is queued.

Storage methods run on I/O threads (or inside ``submit``), may block, and may raise: an exception
fails that block's batch (``_batch_failed``), never the job's report. ``exists`` runs on the
manager's thread inside ``lookup`` and must not block on I/O; better if it takes no lock the I/O
threads take per block either (waiting for one costs the engine's step a GIL hand-over).
"""

from __future__ import annotations

import itertools
import logging
import operator
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum

from kvtier.keys import KEY_BYTES, BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import JobResult, Tier, TierJob, TierJobKind
from kvtier.tiers.payload import HEADER_BYTES, block_matches, encode_header
from kvtier.tiers.workers import Line, ThreadState, WorkerPool

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


Views = Sequence[memoryview]
"""Header buffers or pool slots of a batch, one per block."""


def valid_block(key: object, slot: object, num_slots: int) -> bool:
    """A key of ``KEY_BYTES`` bytes (a longer one would be cut in the header and could collide)
    and a slot index of the pool."""
    try:
        index = operator.index(slot)  # type: ignore[arg-type]
    except TypeError:
        return False
    return isinstance(key, bytes) and len(key) == KEY_BYTES and 0 <= index < num_slots


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
    """Next batch to take; shared by the job's tasks (``next`` on a count is atomic)."""
    started: float | None = field(init=False, default=None)
    """When a thread took the job's first batch (``JobResult.busy_s``)."""

    def __post_init__(self) -> None:
        self.ok = [False] * len(self.keys)
        self.remaining = len(self.keys)


class BlockTier(Tier):
    """A tier over a block storage; see the module docstring. Subclasses implement ``exists``,
    ``put``, ``get`` and ``delete`` (or ``put_batch`` / ``get_batch`` as well) and may override
    ``_draw_faults``, ``_dispatch``, ``_healthy``, ``_batch_failed``, ``_cut_off`` and
    ``_close_storage``."""

    cut_off_grace_s = 0.0
    """How long ``close`` waits for running jobs after ``_cut_off`` (0: ``_cut_off`` is not
    called and stuck jobs are abandoned at ``close_timeout_s``)."""

    def __init__(
        self,
        name: str,
        namespace: Namespace,
        pool: HostPool,
        *,
        threads: int = 0,
        stuck_after_s: float = 10.0,
        batch_size: int = 1,
        reads_first: bool = False,
        aside_thread: bool = False,
        thread_state: Callable[[], ThreadState] | None = None,
        close_timeout_s: float | None = None,
    ) -> None:
        super().__init__(name, namespace, pool)
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self._digest = namespace.digest
        self._lock = threading.Lock()
        """Guards counters, pins and job states; a subclass may guard its storage with it too
        (never held while a storage method is called by the skeleton)."""
        self._pins: dict[BlockKey, int] = {}
        self._closed = False
        self.batch_size = batch_size
        self._reads_first = reads_first
        self._close_timeout_s = stuck_after_s if close_timeout_s is None else close_timeout_s
        self._workers = (
            WorkerPool(
                f"kvtier-{name}",
                threads,
                stuck_after_s,
                aside_threads=1 if aside_thread else 0,
                thread_state=thread_state,
            )
            if threads > 0
            else None
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

    def put_batch(
        self, keys: Sequence[BlockKey], headers: Sequence[bytes], payloads: Views
    ) -> list[Put]:
        """``put`` of up to ``batch_size`` blocks (a storage with round trips sends them in one)."""
        return [self.put(k, h, p) for k, h, p in zip(keys, headers, payloads, strict=True)]

    def get_batch(self, keys: Sequence[BlockKey], headers: Views, payloads: Views) -> list[Got]:
        """``get`` of up to ``batch_size`` blocks."""
        return [self.get(k, h, p) for k, h, p in zip(keys, headers, payloads, strict=True)]

    # -- the Tier interface ---------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        try:
            out = self.exists(keys)
        except Exception:  # the contract: never raise into the engine's thread
            log.exception("tier %s: lookup failed", self.name)
            out = [False] * len(keys)
        counters = self.counters
        # Without the lock: only the manager's thread looks up (the contract), so nobody else
        # writes these two, and the I/O threads take the lock for every block they move (a
        # lookup that found it busy waited for the GIL's hand-over, on the engine's step).
        counters.lookups += len(out)
        counters.lookup_hits += out.count(True)  # answers are True, False or None
        return out

    def submit(self, job: TierJob) -> None:
        n = len(job.keys)
        faults = self._draw_faults(job)
        reading = job.kind is TierJobKind.READ
        # Without the lock, as the lookup counters (only the manager's thread submits): one
        # lock fewer a job that the engine's thread may find held by an I/O thread.
        if reading:
            self.counters.read_jobs += 1
        else:
            self.counters.write_jobs += 1
        if n != len(job.slots):
            self._count(errors=n)
            self._finish(job.job_id, [False] * n)
            return
        if self._closed or n == 0:
            self._finish(job.job_id, [False] * n)
            return
        if not self._healthy():
            self._count(**{_refused(reading): n})
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
        ``close_timeout_s`` (then ``_cut_off`` and ``cut_off_grace_s`` more, if set), then fail
        the blocks not started and abandon those on stuck threads; then ``_close_storage``.
        Idempotent."""
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

    def _healthy(self) -> bool:
        """The health gate, asked in ``submit`` and before each batch: False fails the job (or
        the batch, unsent), counted in ``errors`` for reads and ``rejected`` for writes."""
        return True

    def _batch_failed(self, exc: Exception, keys: list[BlockKey], reading: bool) -> None:
        """A batch raised ``exc``: every block of it failed. Counted in ``errors``; a storage
        may sort failures its own way (timeouts, an unreachable server)."""
        log.debug("tier %s: batch failed", self.name, exc_info=exc)
        self._count(errors=len(keys))

    def _cut_off(self) -> None:
        """``close`` waited ``close_timeout_s``: make running storage calls return now (with
        ``cut_off_grace_s`` > 0 only)."""

    def _dispatch(self, state: JobState) -> None:
        """Run the job's batches: inline without threads, else a few tasks per job on the worker
        pool, each taking the next batch until none is left (batches spread over the threads
        without one queued task, and its cost on this thread, per batch)."""
        workers = self._workers
        if workers is None:
            self._run_blocks(state)
            return
        line = Line.NORMAL
        if self._reads_first and state.kind is TierJobKind.READ:
            line = Line.FIRST
        label = f"{state.kind.value} job {state.job_id}"
        batches = -(-len(state.keys) // self.batch_size)
        if not workers.submit(
            lambda: self._run_blocks(state),
            lambda: self._fail_rest(state),
            label,
            line,
            copies=min(batches, self._threads),
        ):
            self._fail_rest(state)  # closed, or every thread stuck: fail fast, never queue forever

    def _run_on_worker(
        self, run: Callable[[], None], fail: Callable[[], None], label: str, aside: bool = False
    ) -> bool:
        """Queue a task of the tier's own (a rescan, say) on its I/O threads, or with ``aside``
        on its aside thread (a key check: never behind block I/O); False (nothing queued) when
        the tier has no such thread, is closed or every such thread is stuck. ``fail`` runs
        instead of ``run`` when the task expires in the queue or the tier closes first."""
        if self._workers is None or self._closed:
            return False
        return self._workers.submit(run, fail, label, Line.ASIDE if aside else Line.NORMAL)

    def _thread_state(self) -> ThreadState:
        """The calling I/O thread's ``thread_state`` (made on its first call)."""
        if self._workers is None:
            raise RuntimeError(f"tier {self.name}: no I/O threads")
        return self._workers.state()

    def _close_jobs(self) -> bool:
        """Finish or fail queued jobs; True when some block was abandoned on a stuck thread."""
        if self._workers is None:
            return False
        grace = self.cut_off_grace_s
        cut_off = self._cut_off if grace > 0 else None
        return bool(self._workers.close(self._close_timeout_s, cut_off, grace))

    def _close_storage(self, abandoned: bool) -> None:
        """Release the storage (``abandoned``: a stuck thread may still be using it)."""

    # -- per batch ------------------------------------------------------------------------------

    def pinned(self, key: BlockKey) -> bool:
        """Under the lock: a job moves this key now, so the storage must not evict it."""
        return key in self._pins

    def _run_blocks(self, state: JobState) -> None:
        n = len(state.keys)
        size = self.batch_size
        workers = self._workers
        run_first = None
        if workers is not None and self._reads_first and state.kind is TierJobKind.WRITE:
            run_first = workers.run_first  # queued reads run between a write's batches
        for batch in state.cursor:
            start = batch * size
            if start >= n:
                return
            self._run_batch(state, range(start, min(start + size, n)))
            if run_first is not None:
                run_first()

    def _run_batch(self, state: JobState, positions: range) -> None:
        if state.started is None:
            state.started = time.perf_counter()
        keys, slots = state.keys, state.slots
        num_slots = self.pool.num_slots
        valid = [i for i in positions if valid_block(keys[i], slots[i], num_slots)]
        reading = state.kind is TierJobKind.READ
        good: list[int] = []
        try:
            if len(valid) < len(positions):
                self._count(errors=len(positions) - len(valid))
            if valid and not self._healthy():
                self._count(**{_refused(reading): len(valid)})
            elif valid:
                good = (
                    self._read_batch(state, valid) if reading else self._write_batch(state, valid)
                )
        except Exception as exc:  # every job must be reported: the batch fails, never the job
            self._batch_failed(exc, [keys[i] for i in valid], reading)
        finally:
            self._blocks_done(state, positions, good)

    def _fail_rest(self, state: JobState) -> None:
        """Fail the blocks of a job no thread has taken yet (refused or expired work)."""
        n = len(state.keys)
        size = self.batch_size
        for batch in state.cursor:
            start = batch * size
            if start >= n:
                return
            positions = range(start, min(start + size, n))
            self._count(errors=len(positions))
            self._blocks_done(state, positions, [])

    def _read_batch(self, state: JobState, positions: list[int]) -> list[int]:
        """Read the blocks at ``positions`` into their slots; the positions verified."""
        keys = [state.keys[i] for i in positions]
        buffer = memoryview(bytearray(HEADER_BYTES * len(positions)))
        headers = [buffer[j * HEADER_BYTES : (j + 1) * HEADER_BYTES] for j in range(len(keys))]
        payloads = [self.pool.view(state.slots[i]) for i in positions]
        answers = self.get_batch(keys, headers, payloads)
        faults = state.faults
        good: list[int] = []
        failed = 0
        for i, key, header, payload, got in zip(
            positions, keys, headers, payloads, answers, strict=True
        ):
            fault = Fault.NONE if faults is None else faults[i]
            if got is Got.MISSING:
                continue
            if got is Got.FAILED or (got is Got.FOUND and fault is Fault.FAIL):
                failed += 1
                continue
            if got is Got.FOUND and fault is Fault.CORRUPT:
                payload[0] ^= 0xFF  # as a torn read would land: only the checksum protects it
            if got is Got.FOUND and block_matches(header, self._digest, key, payload):
                good.append(i)
            else:
                self.drop_corrupt(key)
        slot_bytes = self.pool.slot_bytes
        self._count(errors=failed, read_blocks=len(good), read_bytes=len(good) * slot_bytes)
        return good

    def _write_batch(self, state: JobState, positions: list[int]) -> list[int]:
        """Write the blocks at ``positions`` from their slots; the positions held now."""
        faults = state.faults
        good: list[int] = []
        failed = 0
        todo: list[int] = []
        for i in positions:
            if faults is not None and faults[i] is Fault.FAIL:
                if self.exists([state.keys[i]])[0]:
                    good.append(i)  # held already: nothing to write, so nothing fails
                else:
                    failed += 1
            else:
                todo.append(i)
        keys = [state.keys[i] for i in todo]
        payloads = [self.pool.view(state.slots[i]) for i in todo]
        headers = [encode_header(self._digest, k, p) for k, p in zip(keys, payloads, strict=True)]
        stored = rejected = 0
        for i, result in zip(
            todo, self.put_batch(keys, headers, payloads) if todo else [], strict=True
        ):
            if result is Put.STORED:
                stored += 1
            elif result is Put.REJECTED:
                rejected += 1
            elif result is Put.FAILED:
                failed += 1
            if result is Put.STORED or result is Put.KEPT:
                good.append(i)
        slot_bytes = self.pool.slot_bytes
        self._count(
            errors=failed, rejected=rejected, write_blocks=stored, write_bytes=stored * slot_bytes
        )
        return good

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

    def _blocks_done(self, state: JobState, positions: range, good: list[int]) -> None:
        keys = state.keys
        with self._lock:
            for i in good:
                state.ok[i] = True
            pins = self._pins
            for i in positions:
                key = keys[i]
                left = pins.get(key, 0) - 1
                if left > 0:
                    pins[key] = left
                else:
                    pins.pop(key, None)
            state.remaining -= len(positions)
            last = state.remaining == 0
        if last:
            started = state.started
            busy = None if started is None else time.perf_counter() - started
            self._finish(state.job_id, state.ok, busy)

    def _count(self, **deltas: int) -> None:
        counters = self.counters
        with self._lock:
            for name, delta in deltas.items():
                setattr(counters, name, getattr(counters, name) + delta)


def _refused(reading: bool) -> str:
    """The counter of blocks failed by the health gate."""
    return "errors" if reading else "rejected"
