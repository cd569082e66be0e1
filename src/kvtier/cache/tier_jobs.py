"""The open tier jobs of ``TieredCache``: submit a job to its tier, settle it by its tier's report,
time it out after ``job_timeout_s``. What a job's end means for slots, pins and keys stays with the
cache; this table only tracks which jobs are open and since when."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from kvtier.cache.records import OpenTierJob
from kvtier.keys import BlockKey
from kvtier.tiers import contract
from kvtier.tiers.base import Tier, TierJob, TierJobKind

log = logging.getLogger(__name__)


class TierJobs:
    """Open jobs of ``tiers`` (by tier index and job id), timed-out (abandoned) ones included:
    they stay open until their tier really reports them."""

    __slots__ = ("_clock", "_jobs", "_late", "_next_id", "_tiers", "timeout_s")

    def __init__(self, tiers: Sequence[Tier], timeout_s: float, clock: Callable[[], float]) -> None:
        self._tiers = tiers
        self.timeout_s = timeout_s
        self._clock = clock
        self._jobs: dict[tuple[int, int], OpenTierJob] = {}
        self._next_id = 0
        self._late = [False] * len(tiers)
        """Per tier: a job of it timed out and none has ended in time since (warned once)."""

    def __len__(self) -> int:
        return len(self._jobs)

    def submit(
        self,
        tier_index: int,
        kind: TierJobKind,
        keys: list[BlockKey],
        slots: list[int],
        holds: bool,
    ) -> OpenTierJob | None:
        """Open a job and hand it to its tier. Returns the job when the tier refused it (it is not
        open then: the caller settles it as failed), else None."""
        job_id = self._next_id
        self._next_id += 1
        job = OpenTierJob(tier_index, kind, keys, slots, self._clock() + self.timeout_s, holds)
        self._jobs[(tier_index, job_id)] = job
        tier = self._tiers[tier_index]
        try:
            tier.submit(TierJob(job_id, kind, keys, slots))
        except Exception:
            log.exception("tier %s rejected a job", tier.name)
            tier.counters.errors += 1
            del self._jobs[(tier_index, job_id)]
            return job
        return None

    def settle(self, tier_index: int, job_id: int) -> OpenTierJob | None:
        """The open job a tier reported as ended, no longer open; None for an unknown id."""
        job = self._jobs.pop((tier_index, job_id), None)
        if job is not None and not job.abandoned and self._late[tier_index]:
            self._late[tier_index] = False
            log.warning("tier %s: jobs end in time again", self._tiers[tier_index].name)
        return job

    def time_out(self, now: float) -> list[OpenTierJob]:
        """Mark the jobs past their deadline at ``now`` abandoned (still open) and return them;
        counted in their tier's ``timeouts``, and a tier's first late job since it was last in
        time is named in a warning."""
        out: list[OpenTierJob] = []
        for job in self._jobs.values():
            if job.abandoned or job.deadline > now:
                continue
            job.abandoned = True
            out.append(job)
            tier = self._tiers[job.tier_index]
            tier.counters.timeouts += 1
            if not self._late[job.tier_index]:
                self._late[job.tier_index] = True
                log.warning(
                    "tier %s: a %s job of %d blocks did not end within job_timeout_s=%g s; "
                    "given up (its slots stay reserved until the tier returns)",
                    tier.name,
                    job.kind.value,
                    len(job.keys),
                    self.timeout_s,
                )
        return out

    def any_writes(self) -> bool:
        """Whether a write job is open (it releases its pins or slots when it ends)."""
        return any(job.kind is TierJobKind.WRITE for job in self._jobs.values())

    def waiting(self) -> dict[str, int]:
        """Per tier name: open jobs not timed out (what is worth waiting for)."""
        out: dict[str, int] = {}
        for job in self._jobs.values():
            if not job.abandoned:
                name = self._tiers[job.tier_index].name
                out[name] = out.get(name, 0) + 1
        return out


def ask_tier(tier: Tier, keys: Sequence[BlockKey]) -> list[bool | None]:
    """The tier's ``lookup`` of ``keys``; a tier that raises or answers malformed flags counts an
    error and holds none of them."""
    try:
        answer = tier.lookup(keys)
    except Exception:
        log.exception("tier %s lookup failed", tier.name)
        tier.counters.errors += 1
        return [False] * len(keys)
    flags = contract.lookup_flags(answer, len(keys))
    if flags is None:
        tier.counters.errors += 1
        return [False] * len(keys)
    return flags
