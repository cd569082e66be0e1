"""The tiered block cache: ``manager.TieredCache`` (which keys live where, pins, open tier jobs,
cascade, promotion) and the helpers that are its parts only (records, reports, the tier-job table,
write-back, retries, promotion rules, the event log, invariants), ``shared.SharedTieredCache``
over a node's shared pool (``kvtier.shared_pool``), built from a config by
``factory.build_cache``."""

from kvtier.cache.factory import build_cache
from kvtier.cache.manager import LookupResult, TierBinding, TieredCache

__all__ = ["LookupResult", "TierBinding", "TieredCache", "build_cache"]
