"""Build a host pool and a ``TieredCache`` from a validated ``KVTierConfig``: the engine's own pool,
or the node's shared pool of ``pool.share`` (``SharedTieredCache`` over ``kvtier.shared_pool``)."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from typing import Any

from kvtier.cache.manager import TierBinding, TieredCache
from kvtier.cache.promotion import PromotionSettings
from kvtier.cache.shared import SharedTieredCache
from kvtier.config import KVTierConfig, TierConfig
from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.policies import DEFAULT_TIER_EVICTION, make_policy
from kvtier.policies.admission import AdmissionFilter
from kvtier.pool import HostPool, ShmDirError, slot_stride
from kvtier.registry import describe
from kvtier.shared_pool.segment import open_shared
from kvtier.tiers import Tier, contract, tier_class
from kvtier.tiers.base import WriteMode
from kvtier.tiers.fs.shared import SharedFsTier, ShareSettings
from kvtier.validation import format_size


def pool_slots(config: KVTierConfig, slot_bytes: int) -> int:
    """How many slots of ``slot_bytes`` fit in ``pool.size`` (``ConfigError`` when none does).

    Counted in aligned slots (``slot_stride``): the region never exceeds ``pool.size``."""
    if slot_bytes <= 0:
        raise ConfigError("slot_bytes", slot_bytes, "a positive byte count")
    stride = slot_stride(slot_bytes)
    num_slots = config.pool.size // stride
    if num_slots < 1:
        raise ConfigError(
            "pool.size",
            config.pool.size,
            f"at least one block of {slot_bytes} bytes, {stride} aligned ({format_size(stride)})",
        )
    return num_slots


def build_tier(tier_config: TierConfig, namespace: Namespace, pool: HostPool, field: str) -> Tier:
    """A new tier of ``tier_config``. A tier from outside kvtier is the plugin boundary: whatever
    building it raises (``KeyboardInterrupt`` aside), or an object that lacks what the manager
    reads of every tier (a ``name``, ``counters``: a constructor that skipped ``Tier.__init__``),
    is a ``ConfigError`` for ``field``."""
    cls = tier_class(tier_config.kind, field)
    if cls.__module__.startswith("kvtier."):
        tier: Tier = cls.create(tier_config.name, namespace, pool, tier_config.options)
        return tier
    try:
        tier = cls.create(tier_config.name, namespace, pool, tier_config.options)
    except (KeyboardInterrupt, ConfigError):
        raise
    except BaseException as exc:  # SystemExit included: a plugin does not end kvtier
        allowed = f"a tier that can be built ({describe(exc)})"
        raise ConfigError(field, tier_config.kind, allowed) from exc
    lacks = contract.tier_lacks(tier)
    if lacks is not None:
        with contextlib.suppress(Exception):
            tier.close()
        raise ConfigError(field, tier_config.kind, f"a tier class that {lacks}")
    return tier


def build_cache(
    config: KVTierConfig,
    namespace: Namespace,
    slot_bytes: int,
    clock: Callable[[], float] = time.monotonic,
) -> tuple[HostPool, TieredCache]:
    """A new host pool of ``pool_slots(config, slot_bytes)`` slots and the cache over it, with
    the secondary tiers in config order (fastest first). ``clock``: the cache's (a benchmark's
    simulated time; the engine's own pool only).

    The caller owns both: ``cache.close()`` closes the tiers, ``pool.close()`` the pool. When a
    step fails, everything built before it is closed and the error propagates (``ConfigError`` for
    a bad value, ``pool.shm_dir`` included when that directory is unusable, ``PoolError`` when
    the shared memory cannot be created).
    """
    num_slots = pool_slots(config, slot_bytes)
    if config.pool.share is not None:
        return build_shared_cache(config, namespace, slot_bytes, num_slots)
    try:
        pool = HostPool.create(num_slots, slot_bytes, config.pool.shm_dir)
    except ShmDirError as exc:
        raise ConfigError("pool.shm_dir", config.pool.shm_dir, str(exc)) from exc
    tiers: list[Any] = []
    try:
        secondary: list[TierBinding] = []
        for i, tier_config in enumerate(config.tiers):
            tier = build_tier(tier_config, namespace, pool, f"tiers[{i}].kind")
            tiers.append(tier)
            secondary.append(TierBinding(tier, tier_config.write))
        admission = (
            AdmissionFilter(config.admission.min_seen, config.admission.max_tracked)
            if config.admission.enabled
            else None
        )
        cache = TieredCache(
            pool,
            make_policy(config.eviction, num_slots),
            secondary=secondary,
            admission=admission,
            job_timeout_s=config.job_timeout_s,
            record_events=config.events,
            writeback_window=math.ceil(config.pool.writeback_window * num_slots),
            promotion=PromotionSettings(
                config.pool.promotion_budget, config.pool.promotion_costs, namespace.block_tokens
            ),
            clock=clock,
        )
    except BaseException:
        for tier in reversed(tiers):
            with contextlib.suppress(Exception):
                tier.close()
        pool.close()
        raise
    return pool, cache


def build_shared_cache(
    config: KVTierConfig, namespace: Namespace, slot_bytes: int, num_slots: int
) -> tuple[HostPool, SharedTieredCache]:
    """The shared pool of ``config.pool.share`` for ``namespace`` (created with ``num_slots``
    slots when no engine made it yet) and this engine's cache over it. The caller owns both, as
    with a private pool: ``cache.close()`` leaves the index, ``pool.close()`` the pool (the last
    engine out removes the file)."""
    share = config.pool.share
    assert share is not None
    _check_shared_tiers(config, share)
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
    tiers: list[Tier] = []
    try:
        settings = ShareSettings(config.pool.shm_dir, config.pool.share_lock_timeout_s)
        for tier_config in config.tiers:
            tiers.append(
                SharedFsTier(tier_config.name, namespace, pool, tier_config.options, settings)
            )
        cache = SharedTieredCache(
            pool,
            index,
            record_events=config.events,
            secondary=[TierBinding(tier, WriteMode.THROUGH) for tier in tiers],
            job_timeout_s=config.job_timeout_s,
            promotion=PromotionSettings(
                config.pool.promotion_budget, config.pool.promotion_costs, namespace.block_tokens
            ),
        )
    except BaseException:
        for tier in tiers:
            tier.close()
        index.close()
        pool.close()
        raise
    return pool, cache


def _check_shared_tiers(config: KVTierConfig, share: str) -> None:
    """Behind a shared pool: at most one secondary tier, of kind ``fs``, written through, with
    the shared index's eviction (``kvtier.tiers.fs.shared``). A tier of another kind keeps its
    own index and capacity per engine: each engine would account the same blocks again."""
    if not config.tiers:
        return
    allowed = "a pool with at most one secondary tier, of kind fs (others are not shared yet)"
    if len(config.tiers) > 1 or config.tiers[0].kind != "fs":
        raise ConfigError("pool.share", share, allowed)
    tier = config.tiers[0]
    if tier.write is not WriteMode.THROUGH:
        raise ConfigError("tiers[0].write", tier.write.value, "through behind a shared pool")
    if tier.options.eviction != DEFAULT_TIER_EVICTION:
        raise ConfigError(
            "tiers[0].eviction",
            tier.options.eviction,
            f"{DEFAULT_TIER_EVICTION} behind a shared pool",
        )
