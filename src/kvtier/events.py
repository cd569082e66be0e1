"""Block events, for engines that publish where KV blocks live (e.g. vLLM's KV events)."""

from __future__ import annotations

from enum import Enum
from typing import NamedTuple

from kvtier.keys import BlockKey

POOL_TIER = "pool"


class EventKind(Enum):
    STORED = "stored"
    EVICTED = "evicted"


class CacheEvent(NamedTuple):
    kind: EventKind
    key: BlockKey
    tier: str
    """``"pool"`` or a secondary tier's name."""
