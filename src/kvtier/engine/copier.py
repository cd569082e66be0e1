"""The worker side of an engine adapter: executes each step's copy orders on one rank's KV tensors.

Loads run before the forward pass and are complete when ``start_load`` returns, except
asynchronous ones (``CopyOrder.request_id``): those are submitted and left running while the
step's forward pass (of other requests) goes on, and ``take_finished_loads`` names their requests
once their copies ended, failed or not (a failed one's blocks are in ``take_load_errors`` by
then). Stores are
submitted after the forward pass (``save``) and never waited for on the host: a CPU backend copies
at once, a CUDA backend copies on its own streams after the forward pass that wrote the blocks. A
store still in flight when the next step begins may read blocks that the engine freed and handed
to another request meanwhile, so at the start of every step (``fence``, before anything writes KV)
the engine's stream waits, on the device, for the stores still in flight that read a block this
step's scheduling handed out again (``StepOrders.fresh_blocks``); other stores go on overlapping
the step. Results go back to the planner as a ``RankReport``; failed loads are also kept for the
engine (``take_load_errors``) so it recomputes those blocks.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Sequence
from typing import Any

from kvtier import series
from kvtier.copy.base import SKIP, BackendSetup, CopyBackend, CopyJob, Direction
from kvtier.copy.options import CopyConfig
from kvtier.engine.backends import BackendFactory, make_backend
from kvtier.engine.orders import CopyOrder, RankReport, StepOrders
from kvtier.pool import HostPool, PoolHandle

log = logging.getLogger(__name__)

FAULT_ENV = "KVTIER_TEST_FAIL_LOADS"
"""Testing only: a fraction in [0, 1] of load orders this worker fails on purpose."""


class Copier:
    """One rank's copier: ``register`` the KV tensors, then per step ``fence``, ``start_load``,
    ``save`` and ``take_report`` (see the module docstring)."""

    def __init__(
        self,
        blocks_per_slot: int,
        tp_rank: int,
        tp_size: int,
        copy: CopyConfig | None = None,
        allow_pageable: bool = False,
        backend_factory: BackendFactory = make_backend,
    ) -> None:
        self.blocks_per_slot = blocks_per_slot
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self._copy = copy or CopyConfig()
        """The config's ``copy`` section, for the backend (``BackendSetup``)."""
        self._allow_pageable = allow_pageable
        self._backend_factory = backend_factory
        self._kv: list[Any] = []
        self._pool: HostPool | None = None
        self._backend: CopyBackend | None = None
        self._broken: str | None = None
        self._suspended = False
        self._done: dict[int, int] = {}
        self._failed: dict[int, int] = {}
        self._stores_in_flight: dict[int, frozenset[int]] = {}
        """Store job -> the engine blocks it reads."""
        self._store_started: dict[int, tuple[float, int]] = {}
        """Store job -> (submit time, bytes), for the copy stats."""
        self._stats = series.empty_payload()
        """Copy bytes, seconds and jobs per direction since the last ``take_stats``."""
        self._load_errors: set[int] = set()
        self._async_loads: dict[int, tuple[str, CopyOrder, float, int]] = {}
        """Asynchronous load job -> (request, order, submit time, bytes)."""
        self._finished_loads: set[str] = set()
        self._fault_rate = float(os.environ.get(FAULT_ENV, "0") or 0)
        self._faults = random.Random(1234 + tp_rank)

    def register(self, kv_caches: Sequence[Any]) -> None:
        """The engine's per-layer KV tensors, in layer order."""
        self._kv = list(kv_caches)

    def suspend(self) -> None:
        """The engine's KV memory is about to be released (a sleep): finish every copy
        that touches it and drop the backend, which holds its addresses. Until ``resume``, loads
        fail (the engine recomputes) and stores are dropped. Idempotent."""
        self._suspended = True
        self._drop_backend()

    def resume(self) -> None:
        """The KV memory is back (maybe at other physical pages): the next copy builds a new
        backend over the same tensors. Idempotent."""
        self._suspended = False

    def _ensure_backend(self, handle: PoolHandle) -> CopyBackend | None:
        if self._suspended:
            return None
        if self._backend is not None or self._broken is not None:
            return self._backend
        try:
            if self._pool is None:
                self._pool = HostPool.attach(handle)
            setup = BackendSetup(
                self._pool,
                self.blocks_per_slot,
                self.tp_rank,
                self.tp_size,
                self._copy,
                self._allow_pageable,
            )
            self._backend = self._new_backend(self._kv, setup)
        except Exception as exc:
            # Every order then fails: loads are recomputed by the engine, stores are dropped.
            self._broken = f"{type(exc).__name__}: {exc}"
            log.error("kvtier worker cannot copy, caching disabled on this rank: %s", exc)
        return self._backend

    def _new_backend(self, kv_caches: Sequence[Any], setup: BackendSetup) -> CopyBackend:
        return self._backend_factory(kv_caches, setup)

    def fence(self, orders: StepOrders | None) -> None:
        """Before this step writes any KV: its work waits for the stores still in flight that
        read a block this step may overwrite (``orders.fresh_blocks``, or any when unknown)."""
        if self._backend is None or not self._stores_in_flight:
            return
        self._collect()
        fresh: set[int] | None = None  # None: unknown, every store in flight counts
        if orders is not None and orders.fresh_blocks is not None:
            fresh = set(orders.fresh_blocks)
            fresh.update(b for order in orders.loads for b in order.engine_blocks if b != SKIP)
        jobs = [
            job
            for job, blocks in self._stores_in_flight.items()
            if fresh is None or not fresh.isdisjoint(blocks)
        ]
        if jobs:
            self._backend.fence(sorted(jobs))

    def start_load(self, orders: StepOrders) -> None:
        if not orders.loads:
            return
        backend = self._ensure_backend(orders.pool)
        self.fence(orders)  # in case the engine did not fence this step
        submitted: list[CopyOrder] = []
        start = time.perf_counter()
        for order in orders.loads:
            if backend is None or order.fail or self._inject_fault():
                self._fail_load(order)
                continue
            job = CopyJob(
                order.job_id, Direction.LOAD, order.engine_blocks, order.slots, order.groups
            )
            backend.submit(job)
            if order.request_id is None:
                submitted.append(order)
            else:
                size = self._order_bytes(backend, order)
                self._async_loads[order.job_id] = (order.request_id, order, start, size)
        if backend is not None and submitted:
            backend.wait([o.job_id for o in submitted])
            seconds = time.perf_counter() - start
            failed = self._collect()
            copied = 0
            for order in submitted:
                if order.job_id in failed:
                    self._fail_load(order)
                else:
                    copied += self._order_bytes(backend, order)
            done = len(submitted) - len(failed & {o.job_id for o in submitted})
            stats = self._stats
            series.add_counter(stats, "kvtier_copy_bytes", copied, "load")
            series.add_counter(stats, "kvtier_copy_seconds", seconds, "load")
            series.add_counter(stats, "kvtier_copy_jobs", done, "load")
            series.add_sample(stats, "kvtier_load_seconds", seconds)

    def _order_bytes(self, backend: CopyBackend, order: CopyOrder) -> int:
        """Bytes an order moves on this rank (a skipped position moves none)."""
        positions = sum(1 for b in order.engine_blocks if b != SKIP)
        return positions * backend.slot_part_bytes // self.blocks_per_slot

    def save(self, orders: StepOrders) -> None:
        if not orders.stores:
            return
        backend = self._ensure_backend(orders.pool)
        for order in orders.stores:
            if backend is None:
                self._failed[order.job_id] = self._failed.get(order.job_id, 0) + 1
                continue
            self._stores_in_flight[order.job_id] = frozenset(order.engine_blocks)
            self._store_started[order.job_id] = (
                time.perf_counter(),
                self._order_bytes(backend, order),
            )
            job = CopyJob(
                order.job_id, Direction.STORE, order.engine_blocks, order.slots, order.groups
            )
            backend.submit(job)
        if backend is not None:
            self._collect()

    def _collect(self) -> set[int]:
        """Record the jobs the backend finished since the last call; returns the failed ones
        (load failures are the caller's to report)."""
        assert self._backend is not None
        results = self._backend.poll()
        now = time.perf_counter()
        stats, started = self._stats, self._store_started
        for job_id in results.done:
            self._done[job_id] = self._done.get(job_id, 0) + 1
            if self._async_loads and self._async_load_ended(job_id, True, now):
                continue
            self._stores_in_flight.pop(job_id, None)
            if (store := started.pop(job_id, None)) is not None:
                # Submit to the poll that saw it end: an asynchronous (CUDA) store's end is seen
                # at the worker's next poll, so its seconds are an upper bound.
                series.add_counter(stats, "kvtier_copy_bytes", store[1], "store")
                series.add_counter(stats, "kvtier_copy_seconds", now - store[0], "store")
                series.add_counter(stats, "kvtier_copy_jobs", 1, "store")
        for job_id in results.failed:
            if self._async_loads and self._async_load_ended(job_id, False, now):
                continue
            if self._stores_in_flight.pop(job_id, None) is not None:
                self._failed[job_id] = self._failed.get(job_id, 0) + 1
                started.pop(job_id, None)
                series.add_counter(stats, "kvtier_copy_failed_jobs", 1, "store")
        return set(results.failed)

    def _fail_load(self, order: CopyOrder) -> None:
        self._failed[order.job_id] = self._failed.get(order.job_id, 0) + 1
        self._load_errors.update(b for b in order.engine_blocks if b != SKIP)
        series.add_counter(self._stats, "kvtier_copy_failed_jobs", 1, "load")
        if order.request_id is not None:
            self._finished_loads.add(order.request_id)

    def _async_load_ended(self, job_id: int, ok: bool, now: float) -> bool:
        """Settle an asynchronous load the backend reported; False if ``job_id`` is none."""
        entry = self._async_loads.pop(job_id, None)
        if entry is None:
            return False
        request_id, order, started, size = entry
        if not ok:
            self._fail_load(order)
            return True
        self._finished_loads.add(request_id)
        stats = self._stats
        series.add_counter(stats, "kvtier_copy_bytes", size, "load")
        series.add_counter(stats, "kvtier_copy_seconds", now - started, "load")
        series.add_counter(stats, "kvtier_copy_jobs", 1, "load")
        series.add_sample(stats, "kvtier_load_seconds", now - started)
        return True

    def take_finished_loads(self) -> set[str]:
        """Requests whose asynchronous loads ended since the last call (vLLM's
        ``finished_recving``); a failed one's blocks are in ``take_load_errors`` already."""
        if self._backend is not None and self._async_loads:
            self._collect()
        finished, self._finished_loads = self._finished_loads, set()
        return finished

    def _inject_fault(self) -> bool:
        return self._fault_rate > 0 and self._faults.random() < self._fault_rate

    def take_report(self) -> RankReport | None:
        """The jobs this rank finished or failed since the last call (None: none)."""
        if self._backend is not None and (self._stores_in_flight or self._async_loads):
            self._collect()
        if not self._done and not self._failed:
            return None
        report = RankReport(self._done, self._failed)
        self._done, self._failed = {}, {}
        return report

    def take_stats(self) -> series.Payload | None:
        """This rank's copy stats since the last call (None: nothing happened)."""
        if self._backend is not None and self._stores_in_flight:
            self._collect()
        if series.is_empty(self._stats):
            return None
        stats, self._stats = self._stats, series.empty_payload()
        return stats

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def _drop_backend(self) -> None:
        if self._backend is None:
            return
        # Copies in flight touch engine memory: let them finish before it goes away.
        self._backend.wait(sorted([*self._stores_in_flight, *self._async_loads]))
        self._collect()
        self._backend.close()
        self._backend = None

    def close(self) -> None:
        self._drop_backend()
        if self._pool is not None:
            self._pool.close()
            self._pool = None
