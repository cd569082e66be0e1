"""Secondary tiers, created by kind name from config.

Each tier class has an ``Options`` dataclass with ``parse(section) -> Options`` (validation with
field-named errors) and a constructor ``(name, namespace, pool, options)``. Kind names live in
``kvtier.registry.TIERS`` (a ``package.module:Class`` path names a tier outside kvtier); modules are
imported on demand so an optional dependency (the ``redis`` client) is only needed when its tier is
used.
"""

from __future__ import annotations

from typing import Any

from kvtier.registry import TIERS
from kvtier.tiers.base import JobResult, Tier, TierJob, TierJobKind, WriteMode

TIER_KINDS: dict[str, str] = TIERS.entries
"""The built-in kinds (the registry's own mapping)."""


def tier_class(kind: str, field: str = "kind") -> Any:
    """The tier class for ``kind``, a registered name or ``package.module:Class``
    (``ConfigError`` for ``field`` when unknown, not importable or not a ``Tier``)."""
    return TIERS.load(kind, field)


__all__ = ["TIER_KINDS", "JobResult", "Tier", "TierJob", "TierJobKind", "WriteMode", "tier_class"]
