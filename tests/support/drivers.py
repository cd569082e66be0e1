"""Driving a tier synchronously in tests: submit a job, then poll for its result with a deadline.
One driver for every tier kind (memory, fs, redis)."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import overload

from kvtier.keys import BlockKey
from kvtier.tiers.base import JobResult, Tier, TierJob, TierJobKind
from support.blocks import fill, payload_for, poison

DEADLINE_S = 15.0
"""Generous: a slow shared CI machine must not fail a test that is only waiting."""


def wait_for(predicate: Callable[[], bool], deadline_s: float = DEADLINE_S, what: str = "") -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, f"timed out after {deadline_s} s waiting for {what}"
        time.sleep(0.005)


def run_job(tier: Tier, job: TierJob, deadline_s: float = DEADLINE_S) -> JobResult:
    """Submit ``job`` and poll until its result arrives; any other result is a test failure."""
    tier.submit(job)
    end = time.monotonic() + deadline_s
    while True:
        for result in tier.poll():
            assert result.job_id == job.job_id, f"unexpected result {result}"
            assert len(result.ok) == len(job.keys)
            return result
        assert time.monotonic() < end, f"job {job.job_id} not reported within {deadline_s} s"
        time.sleep(0.001)


class Driver:
    """Submits jobs and waits for their results, keeping results of other jobs for later.

    ``store`` and ``load_exact`` take one key (and its ``slot``) or a list of keys (consecutive
    slots from ``first_slot``)."""

    _ids = itertools.count(1)

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.pool = tier.pool
        self.results: dict[int, JobResult] = {}

    def submit(self, kind: TierJobKind, keys: Sequence[BlockKey], slots: Sequence[int]) -> int:
        job_id = next(self._ids)
        self.tier.submit(TierJob(job_id, kind, list(keys), list(slots)))
        return job_id

    def collect(self) -> None:
        for result in self.tier.poll():
            assert result.job_id not in self.results, "a job was reported twice"
            self.results[result.job_id] = result

    def wait(self, job_id: int, deadline_s: float = DEADLINE_S) -> list[bool]:
        end = time.monotonic() + deadline_s
        while job_id not in self.results:
            self.collect()
            if job_id in self.results:
                break
            assert time.monotonic() < end, f"job {job_id} not reported within {deadline_s} s"
            time.sleep(0.001)
        return self.results.pop(job_id).ok

    def write(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> list[bool]:
        return self.wait(self.submit(TierJobKind.WRITE, keys, slots))

    def read(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> list[bool]:
        return self.wait(self.submit(TierJobKind.READ, keys, slots))

    @overload
    def store(self, key: BlockKey, slot: int = 0) -> bool: ...
    @overload
    def store(self, key: Sequence[BlockKey], *, first_slot: int = 0) -> list[bool]: ...

    def store(
        self, key: BlockKey | Sequence[BlockKey], slot: int = 0, *, first_slot: int = 0
    ) -> bool | list[bool]:
        """Fill a slot (or consecutive slots from ``first_slot``) with each key's bytes and write
        them."""
        if isinstance(key, bytes):
            return self._store([key], slot)[0]
        return self._store(list(key), first_slot)

    def _store(self, keys: list[BlockKey], first: int) -> list[bool]:
        slots = list(range(first, first + len(keys)))
        for k, s in zip(keys, slots, strict=True):
            fill(self.pool, s, k)
        return self.write(keys, slots)

    @overload
    def load_exact(self, key: BlockKey, slot: int = 1) -> bool: ...
    @overload
    def load_exact(self, key: Sequence[BlockKey], *, first_slot: int = 0) -> list[bool]: ...

    def load_exact(
        self, key: BlockKey | Sequence[BlockKey], slot: int = 1, *, first_slot: int = 0
    ) -> bool | list[bool]:
        """Read into poisoned slots; a block reported ok must be bit-exact.

        One key reads into slot 1 by default, away from ``store``'s slot 0, so the bytes can
        only have come from the tier; a list reads into consecutive slots from ``first_slot``."""
        if isinstance(key, bytes):
            return self._load_exact([key], slot)[0]
        return self._load_exact(list(key), first_slot)

    def _load_exact(self, keys: list[BlockKey], first: int) -> list[bool]:
        slots = list(range(first, first + len(keys)))
        for s in slots:
            poison(self.pool, s)
        ok = self.read(keys, slots)
        for k, s, good in zip(keys, slots, ok, strict=True):
            if good:
                assert bytes(self.pool.view(s)) == payload_for(k, self.pool.slot_bytes)
        return ok

    def lookup(self, keys: Sequence[BlockKey], deadline_s: float = DEADLINE_S) -> list[bool]:
        """Ask until every answer is known (None means "ask again")."""
        end = time.monotonic() + deadline_s
        while True:
            answers = self.tier.lookup(keys)
            if all(a is not None for a in answers):
                return [bool(a) for a in answers]
            assert time.monotonic() < end, "lookup stayed unknown"
            time.sleep(0.002)
