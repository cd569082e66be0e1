"""Helpers for redis tier tests: a synchronous job driver with deadlines and tier construction
from config mappings; block keys and bytes come from the tier tests' helpers."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tiers.helpers import POISON, payload_for

from kvtier.keys import BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import JobKind, JobResult, TierJob
from kvtier.tiers.redis import Options, RedisTier
from kvtier.validation import Section

DEADLINE_S = 15.0


def options(**values: Any) -> Options:
    """Options parsed from a config mapping, as config.py would."""
    return Options.parse(Section(dict(values), "tiers[0]"))


def make_tier(
    pool: HostPool, namespace: Namespace, name: str = "redis", **values: Any
) -> RedisTier:
    values.setdefault("timeout_s", 2.0)
    values.setdefault("reconnect_initial_s", 0.05)
    values.setdefault("reconnect_max_s", 0.5)
    return RedisTier(name, namespace, pool, options(**values))


def wait_for(predicate: Callable[[], bool], deadline_s: float = DEADLINE_S, what: str = "") -> None:
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, f"timed out after {deadline_s} s waiting for {what}"
        time.sleep(0.005)


class Driver:
    """Drives one tier synchronously: submit, then poll with a deadline."""

    _ids = itertools.count(1)

    def __init__(self, tier: RedisTier) -> None:
        self.tier = tier
        self.pool = tier.pool
        self.results: dict[int, JobResult] = {}

    def submit(self, kind: JobKind, keys: Sequence[BlockKey], slots: Sequence[int]) -> int:
        job_id = next(self._ids)
        self.tier.submit(TierJob(job_id, kind, list(keys), list(slots)))
        return job_id

    def wait(self, job_id: int, deadline_s: float = DEADLINE_S) -> list[bool]:
        end = time.monotonic() + deadline_s
        while job_id not in self.results:
            for result in self.tier.poll():
                assert result.job_id not in self.results, "a job was reported twice"
                self.results[result.job_id] = result
            if job_id in self.results:
                break
            assert time.monotonic() < end, f"job {job_id} not reported within {deadline_s} s"
            time.sleep(0.002)
        return self.results.pop(job_id).ok

    def write(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> list[bool]:
        return self.wait(self.submit(JobKind.WRITE, keys, slots))

    def read(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> list[bool]:
        return self.wait(self.submit(JobKind.READ, keys, slots))

    def store(self, keys: Sequence[BlockKey], first_slot: int = 0) -> list[bool]:
        """Fill slots with each key's bytes and write them."""
        slots = list(range(first_slot, first_slot + len(keys)))
        for key, slot in zip(keys, slots, strict=True):
            self.pool.view(slot)[:] = payload_for(key, self.pool.slot_bytes)
        return self.write(keys, slots)

    def load_exact(self, keys: Sequence[BlockKey], first_slot: int = 0) -> list[bool]:
        """Read into poisoned slots; a block reported ok must be bit-exact."""
        slots = list(range(first_slot, first_slot + len(keys)))
        for slot in slots:
            self.pool.view(slot)[:] = bytes([POISON]) * self.pool.slot_bytes
        ok = self.read(keys, slots)
        for key, slot, good in zip(keys, slots, ok, strict=True):
            if good:
                assert bytes(self.pool.view(slot)) == payload_for(key, self.pool.slot_bytes)
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


def counters(tier: RedisTier) -> Mapping[str, int]:
    from dataclasses import asdict

    return asdict(tier.counters)
