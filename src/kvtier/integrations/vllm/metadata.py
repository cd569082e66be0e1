"""What the scheduler half sends the workers each step, and what workers send back.

Plain dataclasses of ints: vLLM pickles them between processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.pool import PoolHandle


@dataclass
class CopyOrder:
    job_id: int
    slots: list[int]
    engine_blocks: list[int]
    """``blocks_per_slot`` engine block ids per slot; ``-1`` = already in the engine (loads)."""
    fail: bool = False
    """Report these engine blocks as failed loads without copying (the plan went stale)."""


@dataclass
class KVTierMetadata(KVConnectorMetadata):
    pool: PoolHandle
    loads: list[CopyOrder] = field(default_factory=list)
    stores: list[CopyOrder] = field(default_factory=list)
    fresh_blocks: list[int] | None = None
    """Engine blocks (re)allocated by this step's scheduling: the only blocks whose contents this
    step may overwrite. None: unknown (the worker then treats every block as fresh)."""


@dataclass
class KVTierWorkerMetadata(KVConnectorWorkerMetadata):
    """Per job id, how many ranks finished it well and how many failed."""

    done: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata)
        done = dict(self.done)
        for job, n in other.done.items():
            done[job] = done.get(job, 0) + n
        failed = dict(self.failed)
        for job, n in other.failed.items():
            failed[job] = failed.get(job, 0) + n
        return KVTierWorkerMetadata(done, failed)
