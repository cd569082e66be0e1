"""The ledger of copy jobs in flight: a job settles once every tensor-parallel rank reported it.

Each rank copies its own share of every block, so a job is done only when all ``ranks`` shares
are: one failed share fails the whole job (its blocks are then neither trusted in the pool nor
kept in the engine).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.copy.base import Direction
from kvtier.engine.orders import RankReport
from kvtier.keys import BlockKey


@dataclass(slots=True)
class OpenJob:
    """A copy job ordered from the workers and not yet reported by every rank."""

    direction: Direction
    keys: list[BlockKey]
    done: int = 0
    """Ranks that reported it finished well."""
    failed: int = 0
    """Ranks that reported it failed."""


@dataclass(frozen=True, slots=True)
class SettledJob:
    """A job every rank reported: ``ok`` when none failed."""

    job_id: int
    direction: Direction
    keys: list[BlockKey]
    ok: bool


class JobLedger:
    """Job ids -> open jobs; ``settle`` turns rank reports into settled jobs."""

    def __init__(self, ranks: int) -> None:
        if ranks <= 0:
            raise ValueError(f"ranks must be positive, got {ranks}")
        self.ranks = ranks
        self._open: dict[int, OpenJob] = {}
        self._next = 0

    def open(self, direction: Direction, keys: list[BlockKey]) -> int:
        """A new job's id (ids are never reused)."""
        job_id = self._next
        self._next += 1
        self._open[job_id] = OpenJob(direction, keys)
        return job_id

    def settle(self, report: RankReport) -> list[SettledJob]:
        """The jobs this report completes (done counts first, then failures). Reports of
        unknown (already settled) job ids are ignored."""
        settled: list[SettledJob] = []
        for counts, failed in ((report.done, False), (report.failed, True)):
            for job_id, n in counts.items():
                job = self._open.get(job_id)
                if job is None:
                    continue
                if failed:
                    job.failed += n
                else:
                    job.done += n
                if job.done + job.failed >= self.ranks:
                    del self._open[job_id]
                    settled.append(SettledJob(job_id, job.direction, job.keys, job.failed == 0))
        return settled

    def __len__(self) -> int:
        return len(self._open)
