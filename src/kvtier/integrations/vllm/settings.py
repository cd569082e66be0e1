"""The ``vllm`` section of a kvtier config: options only the vLLM connector reads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvtier.validation import Section


@dataclass(frozen=True, slots=True)
class VllmSettings:
    blocks_per_slot: int = 1
    """vLLM blocks per kvtier block (a kvtier block is ``blocks_per_slot * block_size`` tokens)."""
    store_generated: bool = False
    """Also store blocks filled by generated tokens (not only prompt tokens)."""
    stats_path: str | None = None
    """Write the scheduler's kvtier stats as JSON to this file (each second and at shutdown)."""

    @classmethod
    def parse(cls, data: Mapping[str, Any]) -> VllmSettings:
        s = Section(data, "vllm")
        settings = cls(
            blocks_per_slot=s.integer("blocks_per_slot", 1, minimum=1, maximum=1024),
            store_generated=s.boolean("store_generated", False),
            stats_path=s.optional_string("stats_path"),
        )
        s.done()
        return settings
