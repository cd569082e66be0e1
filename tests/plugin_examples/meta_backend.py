"""A copy backend outside kvtier, for KV tensors on PyTorch's ``meta`` device (shapes, no data).

Registered for a device type (``COPY_BACKENDS.register("meta", ...)``): a device type is not a
config field. It copies nothing and reports every job done, and keeps what it was built with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.copy.base import CopyBackend, CopyJob, CopyResults
from kvtier.pool import HostPool


class MetaCopyBackend(CopyBackend):
    def __init__(
        self,
        kv_caches: Sequence[Any],
        pool: HostPool,
        options: Any = None,
        *,
        blocks_per_slot: int = 1,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        self.built_with = (len(kv_caches), pool, options, blocks_per_slot, tp_rank, tp_size)
        self._done: list[int] = []

    def submit(self, job: CopyJob) -> None:
        self._done.append(job.job_id)

    def poll(self) -> CopyResults:
        done, self._done = self._done, []
        return CopyResults(done, [])

    def wait(self, job_ids: Sequence[int]) -> None:
        pass

    def close(self) -> None:
        pass

    @property
    def slot_part_bytes(self) -> int:
        return 0
