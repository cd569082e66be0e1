"""A copy backend outside kvtier, for KV tensors on PyTorch's ``meta`` device (shapes, no data).

Registered for a device type (``COPY_BACKENDS.register("meta", ...)``): a device type is not a
config field. It copies nothing and reports every job done, and keeps what it was built with.
Written against ``CopyBackend.create(kv_caches, setup)``, the one call that builds a backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.copy.base import BackendSetup, CopyBackend, CopyJob, CopyResults


class MetaCopyBackend(CopyBackend):
    @classmethod
    def create(cls, kv_caches: Sequence[Any], setup: BackendSetup) -> MetaCopyBackend:
        return cls(len(kv_caches), setup)

    def __init__(self, layers: int, setup: BackendSetup) -> None:
        self.built_with = (layers, setup)
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
