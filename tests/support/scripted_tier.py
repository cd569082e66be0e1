"""A deterministic secondary tier for manager tests: jobs finish only when the test says so."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.keys import BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import JobResult, Tier, TierJob, TierJobKind


class ScriptedTier(Tier):
    """Stores bytes in a dict. ``release()`` finishes pending jobs; ``fail_keys`` makes reads or
    writes of those keys fail; ``unknown`` keys answer None on lookup; ``raise_on`` makes the named
    methods raise."""

    def __init__(self, name: str, namespace: Namespace, pool: HostPool) -> None:
        super().__init__(name, namespace, pool)
        self.stored: dict[BlockKey, bytes] = {}
        self.pending: list[TierJob] = []
        self.fail_keys: set[BlockKey] = set()
        self.unknown: set[BlockKey] = set()
        self.raise_on: set[str] = set()
        self.submitted: list[TierJob] = []

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        if "lookup" in self.raise_on:
            raise RuntimeError("scripted lookup failure")
        return [None if k in self.unknown else k in self.stored for k in keys]

    def submit(self, job: TierJob) -> None:
        if "submit" in self.raise_on:
            raise RuntimeError("scripted submit failure")
        self.submitted.append(job)
        self.pending.append(job)

    def release(self, count: int | None = None) -> None:
        """Run ``count`` pending jobs (all by default) and queue their results for ``poll``."""
        jobs = self.pending[:count] if count is not None else list(self.pending)
        del self.pending[: len(jobs)]
        for job in jobs:
            ok = []
            for key, slot in zip(job.keys, job.slots, strict=True):
                if key in self.fail_keys:
                    ok.append(False)
                elif job.kind is TierJobKind.WRITE:
                    self.stored[key] = bytes(self.pool.view(slot))
                    ok.append(True)
                elif key in self.stored:
                    self.pool.view(slot)[:] = self.stored[key]
                    ok.append(True)
                else:
                    ok.append(False)
            self._finish(job.job_id, ok)

    def poll(self) -> list[JobResult]:
        if "poll" in self.raise_on:
            raise RuntimeError("scripted poll failure")
        return super().poll()

    def close(self) -> None:
        self.release()
