"""Counters. Plain slotted dataclasses: cheap to bump on the hot path, easy to snapshot."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.shared_pool.index import EngineShare


@dataclass(slots=True)
class TierCounters:
    """What one secondary tier did. Every failure path bumps one of these."""

    read_jobs: int = 0
    read_blocks: int = 0
    read_bytes: int = 0
    write_jobs: int = 0
    write_blocks: int = 0
    write_bytes: int = 0
    lookups: int = 0
    lookup_hits: int = 0
    evictions: int = 0
    errors: int = 0
    """I/O or server errors (each failed block once)."""
    corrupt: int = 0
    """Payloads whose header or checksum did not match; the copy was dropped."""
    timeouts: int = 0
    rejected: int = 0
    """Blocks not written because the tier was full, unhealthy or the block too large."""


@dataclass(slots=True)
class CacheCounters:
    """What the manager did, across tiers."""

    lookups: int = 0
    lookup_blocks: int = 0
    hit_blocks: int = 0
    """Leading blocks found in final lookup answers (promoted blocks included)."""
    promoted_blocks: int = 0
    """Blocks copied from a secondary tier into the pool (counted once, when they arrive)."""
    pending_lookups: int = 0
    stored_blocks: int = 0
    store_skipped_present: int = 0
    store_skipped_admission: int = 0
    store_skipped_full: int = 0
    store_failed: int = 0
    loaded_blocks: int = 0
    load_failed: int = 0
    pool_evictions: int = 0
    promotions: int = 0
    """Blocks whose promotion was started."""
    promotion_failures: int = 0
    promotions_declined: int = 0
    """Blocks found in a tier and not promoted: over the promotion budget, or expected to be read
    later than the engine would compute them (``kvtier.cache.promotion``)."""
    cascade_writes: int = 0
    cascade_failures: int = 0
    cascade_skipped: int = 0
    """Blocks not written to a tier: while its writes pause (it rejected a whole write for want
    of room: ``retry.RefusedWrites``), or as copies held their share of the pool
    (``copy_room.COPY_SHARE``: an evicted block, or one left waiting to be written through)."""
    job_timeouts: int = 0
    events_dropped: int = 0
    """Oldest events dropped because nobody took them (``TieredCache.take_events``) in time."""


@dataclass(slots=True)
class CacheStats:
    """A snapshot returned by ``TieredCache.stats()``."""

    cache: CacheCounters
    pool_slots: int
    pool_used: int
    pool_pinned: int
    tiers: dict[str, TierCounters] = field(default_factory=dict)
    promoted: dict[str, int] = field(default_factory=dict)
    """Blocks promoted into the pool, by the secondary tier they came from."""
    share: EngineShare | None = None
    """Over a shared pool (``pool.share``): this engine's line in its table (hits on its own and
    on others' blocks, evictions, blocks stored and held); None over a private pool."""
    prefill_tokens_per_s: float | None = None
    """A request's prefill rate as the promotion cost rules measure it from the engine's steps
    (``promotion.ComputeRate``): reading a tier's blocks must beat computing them at this rate
    (half of it while other requests share the steps: ``promotion.SHARED_WEIGHT``).
    None until an engine step with a prefill was timed."""
    read_tokens_per_s: dict[str, float] = field(default_factory=dict)
    """Per secondary tier whose reads were measured: the tokens per second it reads, as the
    promotion cost rules measure it (its jobs' busy time per block); beside
    ``prefill_tokens_per_s`` it shows why promotions from it are declined."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
