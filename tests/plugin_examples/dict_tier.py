"""A secondary tier outside kvtier: blocks in a dict, at most ``capacity_blocks`` of them.

Written against kvtier's tier skeleton only (``BlockTier``: validation, header and checksum,
corrupt -> drop, pins, counters and threads are its); the config names it
``plugin_examples.dict_tier:DictTier`` and passes its own options (``capacity_blocks``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvtier.keys import BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.block_tier import BlockTier, Got, Put
from kvtier.validation import Section


@dataclass(frozen=True, slots=True)
class Options:
    capacity_blocks: int = 16
    threads: int = 2

    @classmethod
    def parse(cls, section: Section) -> Options:
        options = cls(
            capacity_blocks=section.integer("capacity_blocks", 16, minimum=1),
            threads=section.integer("threads", 2, minimum=0, maximum=16),
        )
        section.done()
        return options


class DictTier(BlockTier):
    Options = Options
    instances: ClassVar[list[DictTier]] = []
    """Every tier built, newest last (so a test can reach the one a config built)."""

    def __init__(self, name: str, namespace: Namespace, pool: HostPool, options: Options) -> None:
        super().__init__(name, namespace, pool, threads=options.threads)
        self.options = options
        self.blocks: dict[BlockKey, bytes] = {}
        self._guard = threading.Lock()
        DictTier.instances.append(self)

    def exists(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        with self._guard:
            return [key in self.blocks for key in keys]

    def put(self, key: BlockKey, header: bytes, payload: memoryview) -> Put:
        with self._guard:
            if key in self.blocks:
                return Put.KEPT
            if len(self.blocks) >= self.options.capacity_blocks:
                oldest = next(iter(self.blocks))
                del self.blocks[oldest]
                self._report_evicted(oldest)
            self.blocks[key] = header + bytes(payload)
        return Put.STORED

    def get(self, key: BlockKey, header: memoryview, payload: memoryview) -> Got:
        with self._guard:
            data = self.blocks.get(key)
        if data is None:
            return Got.MISSING
        header[:] = data[: len(header)]
        payload[:] = data[len(header) :]
        return Got.FOUND

    def delete(self, key: BlockKey) -> bool:
        with self._guard:
            return self.blocks.pop(key, None) is not None
