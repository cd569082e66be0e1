"""What a ``TieredCache`` reports about itself: events, counters, where pool blocks came from,
open jobs and its invariants. Reads the cache's state and changes nothing (except handing over
events)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from kvtier.cache import invariants
from kvtier.cache.event_log import EventLog
from kvtier.cache.promotion import PromotionRules
from kvtier.cache.tier_jobs import TierJobs
from kvtier.events import POOL_TIER, CacheEvent
from kvtier.keys import BlockKey
from kvtier.metrics import CacheCounters, CacheStats
from kvtier.policies.base import EvictionPolicy
from kvtier.pool import HostPool
from kvtier.tiers.base import Tier


class CacheReports:
    """The reporting half of ``TieredCache`` (which sets these attributes)."""

    _pool: HostPool
    _policy: EvictionPolicy
    _tiers: list[Tier]
    _index: dict[BlockKey, int]
    _inflight: dict[BlockKey, int]
    _pins: dict[BlockKey, int]
    _loading: dict[BlockKey, int]
    _held: dict[int, int]
    _jobs: TierJobs
    _events: EventLog
    _counters: CacheCounters
    _promoted: dict[str, int]
    _rules: PromotionRules
    _origin: dict[BlockKey, int]
    _clock: Callable[[], float]

    def take_events(self) -> list[CacheEvent]:
        """Events since the last call, oldest first (at most ``max_events``: when nobody takes
        them, the oldest are dropped and counted in ``stats().cache.events_dropped``)."""
        return self._events.take()

    def now(self) -> float:
        """The cache's clock (``time.monotonic`` unless given another): an engine times its
        waits for the cache on it."""
        return self._clock()

    @property
    def engine_step_s(self) -> float:
        """An engine step's duration, as the promotion rules measure it (0.0: not yet)."""
        return self._rules.compute.step_s

    def stats(self) -> CacheStats:
        self._counters.events_dropped = self._events.dropped
        return CacheStats(
            cache=replace(self._counters),
            pool_slots=self._pool.num_slots,
            pool_used=self._pool.num_slots - self._pool.num_free,
            pool_pinned=len(self._pins),
            tiers={t.name: replace(t.counters) for t in self._tiers},
            promoted=dict(self._promoted),
            prefill_tokens_per_s=self._rules.compute.tokens_per_s,
            read_tokens_per_s=self._rules.read_tokens_per_s([t.name for t in self._tiers]),
        )

    def origins(self, keys: Sequence[BlockKey]) -> list[str]:
        """For each key in the pool: the secondary tier it was promoted from, or ``pool`` when
        the engine stored it (or it is not in the pool)."""
        origin = self._origin
        if not origin:
            return [POOL_TIER] * len(keys)
        names = [tier.name for tier in self._tiers]
        return [POOL_TIER if i is None else names[i] for i in map(origin.get, keys)]

    @property
    def pinned_full(self) -> bool:
        """No slot free and every visible block pinned: none can be reserved until a pin ends,
        so a request already waiting for room is not looked up in the tiers again (an engine
        asks for each waiting request every step, hundreds of keys each time)."""
        return not self._pool.num_free and len(self._index) <= len(self._pins)

    @property
    def jobs_in_flight(self) -> int:
        """Tier jobs not reported yet, timed-out (abandoned) ones included: their slots stay
        held until their tier really returns."""
        return len(self._jobs)

    def jobs_waiting(self) -> dict[str, int]:
        """Per tier name: jobs not reported yet and not timed out (what is worth waiting for)."""
        return self._jobs.waiting()

    def check_invariants(self, settled: bool = False) -> None:
        """Raise ``AssertionError`` naming the first broken slot or pin invariant (for tests and
        soaks: it walks every slot). See ``kvtier.cache.invariants.check``."""
        state = invariants.CacheState(
            num_slots=self._pool.num_slots,
            visible=self._index,
            inflight=self._inflight,
            held=self._held.keys(),
            free=self._pool.free_slots(),
            policy_size=len(self._policy),
            pins=self._pins,
            loading=self._loading,
            jobs=len(self._jobs),
        )
        invariants.check(state, settled)
