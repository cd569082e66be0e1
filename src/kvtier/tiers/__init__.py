"""Secondary tiers, created by kind name from config.

Each tier class has an ``Options`` record with ``parse(section)`` (validation with field-named
errors) and is built by ``create(name, namespace, pool, options)`` (``base.Tier``). A built-in kind
is the module ``tiers/<kind>.py`` or the package ``tiers/<kind>/`` whose tier class declares
``kind = "<kind>"``; ``kvtier.registry.TIERS``
lists them (a ``package.module:Class`` path names a tier outside kvtier) and imports a module only
when its kind is used, so an optional dependency (the ``redis`` client) is needed only then.
"""

from __future__ import annotations

from kvtier.registry import TIERS
from kvtier.tiers.base import JobResult, Tier, TierJob, TierJobKind, WriteMode


def tier_class(kind: str, field: str = "kind") -> type[Tier]:
    """The tier class for ``kind``, a built-in kind or ``package.module:Class``
    (``ConfigError`` for ``field`` when unknown, not importable or not a ``Tier``)."""
    cls: type[Tier] = TIERS.load(kind, field)
    return cls


__all__ = ["JobResult", "Tier", "TierJob", "TierJobKind", "WriteMode", "tier_class"]
