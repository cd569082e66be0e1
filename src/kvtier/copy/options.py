"""The config's ``copy`` section (``CopyConfig``), owned by the copy backends: the core config keeps
it as given and the engine adapter that builds a backend parses it (``CopyConfig.parse_mapping``).

``CopyStrategy`` is the one list of strategy names: this parser, ``CudaCopyOptions`` and the CUDA
backend's choice at registration all read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kvtier.validation import Section


class CopyStrategy(Enum):
    """How a worker's copy backend moves engine blocks to and from pool slots."""

    AUTO = "auto"
    """The backend picks per device and block layout."""
    DMA = "dma"
    """Copy engines only (batched ``cudaMemcpyAsync`` of contiguous runs); no SM used."""
    STAGED = "staged"
    """Small pieces gathered/scattered by a kernel (at most ``max_sms`` SMs) through a device
    staging buffer, whole blocks over PCIe by the copy engines (vLLM's per-layer layout)."""
    KERNEL = "kernel"
    """A gather/scatter kernel reading/writing the pinned pool directly, on ``max_sms`` SMs."""


STRATEGY_NAMES = tuple(strategy.value for strategy in CopyStrategy)


@dataclass(frozen=True, slots=True)
class CopyConfig:
    """The config's ``copy`` section."""

    strategy: CopyStrategy = CopyStrategy.AUTO
    max_sms: int = 0
    """Upper bound on SMs a copy kernel may occupy; 0 lets the backend choose."""

    @classmethod
    def parse(cls, section: Section) -> CopyConfig:
        copy = cls(
            strategy=section.choice("strategy", CopyStrategy, CopyStrategy.AUTO),
            max_sms=section.integer("max_sms", 0, minimum=0),
        )
        section.done()
        return copy

    @classmethod
    def parse_mapping(cls, data: Mapping[str, Any]) -> CopyConfig:
        """The ``copy`` section as the core config keeps it (``KVTierConfig.copy``); errors name
        ``copy.<key>``."""
        return cls.parse(Section(data, "copy"))
