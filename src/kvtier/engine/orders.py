"""Step orders: what the planner hands the workers each engine step, and what a rank reports back.

Plain records of ints (and a pool handle): engines pickle them between processes. An engine
adapter may subclass them to satisfy its own base classes (vLLM's connector metadata does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.copy.base import SKIP
from kvtier.pool import PoolHandle

__all__ = ["SKIP", "CopyOrder", "RankReport", "StepOrders"]


@dataclass(slots=True)
class CopyOrder:
    """One copy job: a load (slots -> engine blocks) or a store (engine blocks -> slots)."""

    job_id: int
    slots: list[int]
    engine_blocks: list[int]
    """``blocks_per_slot`` engine block ids per slot; ``SKIP`` = already in the engine (loads)."""
    fail: bool = False
    """Report these engine blocks as failed loads without copying (the plan went stale)."""
    request_id: str | None = None
    """A load the engine does not wait for in this step (asynchronous: the request waits while
    other requests run, and the worker names it in ``Copier.take_finished_loads`` once its copy
    ended); None: the step's forward pass waits for it."""
    groups: list[int] | None = None
    """Per slot, the engine's KV cache group its blocks belong to (hybrid models: each group has
    its own layers and block table); None: the model has one group."""


@dataclass(slots=True)
class StepOrders:
    """One engine step's copy orders, the same for every rank."""

    pool: PoolHandle
    loads: list[CopyOrder] = field(default_factory=list)
    stores: list[CopyOrder] = field(default_factory=list)
    fresh_blocks: list[int] | None = None
    """Engine blocks (re)allocated by this step's scheduling: the only blocks whose contents this
    step may overwrite. None: unknown (the worker then treats every block as fresh)."""


@dataclass(slots=True)
class RankReport:
    """Per job id, how many ranks finished it well and how many failed (one rank's report, or
    several merged)."""

    done: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)

    def merged(self, other: RankReport) -> RankReport:
        """Both reports summed, as a new record of this record's class."""
        done = dict(self.done)
        for job, n in other.done.items():
            done[job] = done.get(job, 0) + n
        failed = dict(self.failed)
        for job, n in other.failed.items():
            failed[job] = failed.get(job, 0) + n
        return type(self)(done, failed)
