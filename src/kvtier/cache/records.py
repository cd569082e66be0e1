"""The records ``TieredCache`` takes and returns, and the one it keeps per open tier job."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvtier.keys import BlockKey
from kvtier.tiers.base import Tier, TierJobKind, WriteMode


class LookupResult(NamedTuple):
    hits: int
    """Leading keys available in the pool now."""
    final: bool
    """False: blocks are being promoted or loaded; call ``step()`` and ask again."""


class StoreReservation(NamedTuple):
    keys: list[BlockKey]
    """The keys to write (not yet present, admitted, with a slot), in request order."""
    slots: list[int]


@dataclass(slots=True)
class TierBinding:
    """A secondary tier as the cache uses it: the tier and when blocks are written to it."""

    tier: Tier
    write_mode: WriteMode = WriteMode.THROUGH


@dataclass(slots=True)
class OpenTierJob:
    """A tier job (a promotion's read or a cascade's write) submitted and not yet finished."""

    tier_index: int
    kind: TierJobKind
    keys: list[BlockKey]
    slots: list[int]
    deadline: float
    holds_slots: bool = False
    """The job owns its slots (write-on-evict copies of evicted keys, abandoned promotions):
    they are freed when the job ends, not before."""
    abandoned: bool = False
