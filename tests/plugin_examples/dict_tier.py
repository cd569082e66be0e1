"""A secondary tier outside kvtier: blocks in a dict, at most ``capacity_blocks`` of them.

Written against kvtier's public tier interface only; the config names it
``plugin_examples.dict_tier:DictTier`` and passes its own options (``capacity_blocks``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvtier.keys import BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import JobKind, Tier, TierJob
from kvtier.validation import Section


@dataclass(frozen=True, slots=True)
class Options:
    capacity_blocks: int = 16

    @classmethod
    def parse(cls, section: Section) -> Options:
        options = cls(capacity_blocks=section.integer("capacity_blocks", 16, minimum=1))
        section.done()
        return options


class DictTier(Tier):
    Options = Options
    instances: ClassVar[list[DictTier]] = []
    """Every tier built, newest last (so a test can reach the one a config built)."""

    def __init__(self, name: str, namespace: Namespace, pool: HostPool, options: Options) -> None:
        super().__init__(name, namespace, pool)
        self.options = options
        self.blocks: dict[BlockKey, bytes] = {}
        DictTier.instances.append(self)

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        return [key in self.blocks for key in keys]

    def submit(self, job: TierJob) -> None:
        ok: list[bool] = []
        for key, slot in zip(job.keys, job.slots, strict=True):
            view = self.pool.view(slot)
            if job.kind is JobKind.WRITE:
                if key not in self.blocks and len(self.blocks) >= self.options.capacity_blocks:
                    oldest = next(iter(self.blocks))
                    del self.blocks[oldest]
                    self._report_evicted(oldest)
                self.blocks[key] = bytes(view)
                self.counters.write_blocks += 1
                ok.append(True)
            elif key in self.blocks:
                view[:] = self.blocks[key]
                self.counters.read_blocks += 1
                ok.append(True)
            else:
                ok.append(False)
        self._finish(job.job_id, ok)

    def close(self) -> None:
        self.blocks.clear()
