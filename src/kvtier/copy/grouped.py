"""A copy backend for hybrid models: one backend per KV cache group, each over that group's layers.

A hybrid model's groups (full attention, sliding window, ...) have their own layers and block
tables; a slot holds one group's pages of one kvtier block (``CopyJob.groups`` names the group of
each slot). A job is split into one job per group, given to that group's backend, and reported
once every part ended: done when all were, failed when one failed. Each group's pages move as the
bytes they are (the group's backend is the device's usual one, built over its layers only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.copy.base import BackendSetup, CopyBackend, CopyJob, CopyResults


class GroupedCopyBackend(CopyBackend):
    """Routes each slot of a job to the backend of its KV cache group (see the module docstring).
    Declares no ``kind``: the worker builds it around the device's backends, never by name."""

    @classmethod
    def create(cls, kv_caches: Sequence[Any], setup: BackendSetup) -> GroupedCopyBackend:
        raise TypeError("GroupedCopyBackend is built around one backend per group, not by name")

    def __init__(self, backends: Mapping[int, CopyBackend], blocks_per_slot: int) -> None:
        if not backends:
            raise ValueError("no KV cache groups to copy")
        self._backends = dict(backends)
        self._bps = blocks_per_slot
        self._next_part = 0
        self._parts: dict[int, set[tuple[int, int]]] = {}
        """Job -> its unfinished parts, (group, part job id)."""
        self._owner: dict[tuple[int, int], int] = {}
        self._bad: set[int] = set()
        """Jobs one of whose parts failed."""
        self._done: list[int] = []
        self._failed: list[int] = []

    @property
    def slot_part_bytes(self) -> int:
        return max(b.slot_part_bytes for b in self._backends.values())

    def submit(self, job: CopyJob) -> None:
        split = self._split(job)
        if split is None:
            self._failed.append(job.job_id)
            return
        parts: set[tuple[int, int]] = set()
        self._parts[job.job_id] = parts
        for group, (blocks, slots) in split.items():
            self._next_part += 1
            part = (group, self._next_part)
            parts.add(part)
            self._owner[part] = job.job_id
            self._backends[group].submit(CopyJob(part[1], job.direction, blocks, slots))
        if not parts:
            self._end(job.job_id)

    def _split(self, job: CopyJob) -> dict[int, tuple[list[int], list[int]]] | None:
        """Per group, its engine blocks and slots of the job; None for a job that names no
        group per slot, or a group without a backend."""
        groups = job.groups
        bps = self._bps
        if groups is None or len(groups) != len(job.slots):
            return None
        if len(job.engine_blocks) != len(job.slots) * bps:
            return None
        out: dict[int, tuple[list[int], list[int]]] = {}
        for i, (group, slot) in enumerate(zip(groups, job.slots, strict=True)):
            if group not in self._backends:
                return None
            blocks, slots = out.setdefault(group, ([], []))
            blocks.extend(job.engine_blocks[i * bps : (i + 1) * bps])
            slots.append(slot)
        return out

    def _end(self, job_id: int) -> None:
        del self._parts[job_id]
        if job_id in self._bad:
            self._bad.discard(job_id)
            self._failed.append(job_id)
        else:
            self._done.append(job_id)

    def poll(self) -> CopyResults:
        for group, backend in self._backends.items():
            results = backend.poll()
            for part_id, ok in [(p, True) for p in results.done] + [
                (p, False) for p in results.failed
            ]:
                job_id = self._owner.pop((group, part_id), None)
                if job_id is None:
                    continue
                if not ok:
                    self._bad.add(job_id)
                parts = self._parts[job_id]
                parts.discard((group, part_id))
                if not parts:
                    self._end(job_id)
        done, failed = self._done, self._failed
        self._done, self._failed = [], []
        return CopyResults(done, failed)

    def _by_group(self, job_ids: Sequence[int]) -> dict[int, list[int]]:
        out: dict[int, list[int]] = {}
        for job_id in job_ids:
            for group, part_id in self._parts.get(job_id, ()):
                out.setdefault(group, []).append(part_id)
        return out

    def wait(self, job_ids: Sequence[int]) -> None:
        for group, parts in self._by_group(job_ids).items():
            self._backends[group].wait(parts)

    def fence(self, job_ids: Sequence[int]) -> None:
        for group, parts in self._by_group(job_ids).items():
            self._backends[group].fence(parts)

    def close(self) -> None:
        for backend in self._backends.values():
            backend.close()
