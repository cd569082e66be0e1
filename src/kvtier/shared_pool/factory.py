"""Build the cache over a shared pool (``pool.share``): ``kvtier.cache.factory.build_cache``
hands over here when the config names a share."""

from __future__ import annotations

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.pool import HostPool, ShmDirError
from kvtier.shared_pool.cache import SharedTieredCache
from kvtier.shared_pool.segment import open_shared


def build_shared_cache(
    config: KVTierConfig, namespace: Namespace, slot_bytes: int, num_slots: int
) -> tuple[HostPool, SharedTieredCache]:
    """The shared pool of ``config.pool.share`` for ``namespace`` (created with ``num_slots``
    slots when no engine made it yet) and this engine's cache over it. The caller owns both, as
    with a private pool: ``cache.close()`` leaves the index, ``pool.close()`` the pool (the last
    engine out removes the file)."""
    share = config.pool.share
    assert share is not None
    if config.tiers:
        # A tier's own index and capacity are per engine: behind a shared pool each engine would
        # account the same blocks again. Sharing the tiers too is left for later.
        raise ConfigError("pool.share", share, "a pool without secondary tiers (not shared yet)")
    if config.admission.enabled:
        raise ConfigError("pool.share", share, "a pool without admission.min_seen (per engine)")
    try:
        pool, index = open_shared(
            share,
            namespace.digest,
            num_slots,
            slot_bytes,
            config.pool.shm_dir,
            config.pool.share_lock_timeout_s,
            config.pool.share_quota,
        )
    except ShmDirError as exc:
        raise ConfigError("pool.shm_dir", config.pool.shm_dir, str(exc)) from exc
    try:
        cache = SharedTieredCache(pool, index, record_events=config.events)
    except BaseException:
        index.close()
        pool.close()
        raise
    return pool, cache
