"""Secondary tiers, created by kind name from config.

Each tier class has an ``Options`` dataclass with ``parse(section) -> Options`` (validation with
field-named errors) and a constructor ``(name, namespace, pool, options)``. Modules are imported on
demand so an optional dependency (the ``redis`` client) is only needed when its tier is used.
"""

from __future__ import annotations

import importlib
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tiers.base import JobKind, JobResult, Tier, TierJob, WriteMode

TIER_KINDS: dict[str, str] = {
    "memory": "kvtier.tiers.memory:MemoryTier",
    "fs": "kvtier.tiers.fs:FsTier",
    "redis": "kvtier.tiers.redis:RedisTier",
}


def tier_class(kind: str, field: str = "kind") -> Any:
    """The tier class for ``kind`` (``ConfigError`` for an unknown kind or a missing dependency)."""
    target = TIER_KINDS.get(kind)
    if target is None:
        raise ConfigError(field, kind, f"one of {', '.join(repr(k) for k in TIER_KINDS)}")
    module_name, class_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(field, kind, f"its dependency is not installed ({exc})") from exc
    return getattr(module, class_name)


__all__ = ["TIER_KINDS", "JobKind", "JobResult", "Tier", "TierJob", "WriteMode", "tier_class"]
