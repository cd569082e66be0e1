"""Shared helpers for tier tests: deterministic block bytes and a synchronous job driver."""

from __future__ import annotations

import hashlib
import itertools
import time
from collections.abc import Sequence

from kvtier.keys import BlockKey
from kvtier.pool import HostPool
from kvtier.tiers.base import JobKind, JobResult, Tier, TierJob

DEADLINE_S = 10.0
POISON = 0xA5


def make_key(i: int, salt: str = "") -> BlockKey:
    return hashlib.blake2b(f"{salt}:{i}".encode(), digest_size=16).digest()


def make_keys(n: int, salt: str = "") -> list[BlockKey]:
    return [make_key(i, salt) for i in range(n)]


def payload_for(key: BlockKey, size: int) -> bytes:
    """Pseudo-random bytes that depend only on the key, so any read can be checked."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.blake2b(key + counter.to_bytes(8, "little"), digest_size=64).digest()
        counter += 1
    return bytes(out[:size])


def fill(pool: HostPool, slot: int, key: BlockKey) -> bytes:
    data = payload_for(key, pool.slot_bytes)
    pool.view(slot)[:] = data
    return data


def poison(pool: HostPool, slot: int) -> None:
    pool.view(slot)[:] = bytes([POISON]) * pool.slot_bytes


class Driver:
    """Submits jobs and waits for their results, keeping results of other jobs for later."""

    _ids = itertools.count(1)

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.results: dict[int, JobResult] = {}

    def submit(self, kind: JobKind, keys: Sequence[BlockKey], slots: Sequence[int]) -> int:
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
        return self.wait(self.submit(JobKind.WRITE, keys, slots))

    def read(self, keys: Sequence[BlockKey], slots: Sequence[int]) -> list[bool]:
        return self.wait(self.submit(JobKind.READ, keys, slots))

    def store(self, key: BlockKey, slot: int = 0) -> bool:
        """Fill ``slot`` with the key's bytes and write it."""
        fill(self.tier.pool, slot, key)
        return self.write([key], [slot])[0]

    def load_exact(self, key: BlockKey, slot: int = 1) -> bool:
        """Read into a poisoned slot; True when ok (and then the bytes must be exact)."""
        poison(self.tier.pool, slot)
        ok = self.read([key], [slot])[0]
        if ok:
            assert bytes(self.tier.pool.view(slot)) == payload_for(key, self.tier.pool.slot_bytes)
        return ok


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
