"""``TieredCache`` over a pool that several engines share (``pool.share``).

The engine's planner calls the same methods as on a private pool; here the pool's block index,
pins and eviction are the shared ones (``SharedIndex``), and this object keeps only what is this
engine's own: its pins per key (the index keeps one bit per engine), its reservations, and the
index calls that must be retried because the lock could not be had in time (an unpin or a
publication waits for the next step; it never blocks the engine). No secondary tier sits behind a
shared pool yet (``factory.build_shared_cache`` refuses the combination).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from kvtier.cache import promotion as promo
from kvtier.cache.manager import TieredCache
from kvtier.cache.records import LookupResult, StoreReservation
from kvtier.events import POOL_TIER, EventKind
from kvtier.keys import BlockKey
from kvtier.metrics import CacheStats
from kvtier.policies.hints import RequestHint
from kvtier.policies.lru import LRUPolicy
from kvtier.pool import HostPool
from kvtier.shared_pool.index import EngineShare, SharedIndex


class SharedTieredCache(TieredCache):
    def __init__(
        self,
        pool: HostPool,
        index: SharedIndex,
        record_events: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(pool, LRUPolicy(), record_events=record_events, clock=clock)
        self.index = index
        self._pin_slots: dict[BlockKey, int] = {}
        """Keys this engine pinned -> their slot (while ``_pins`` counts them)."""
        self._unpin_later: list[int] = []
        self._publish_later: tuple[list[int], list[bool]] = ([], [])
        self._last_share: EngineShare | None = None
        self._last_used = 0
        """This engine's line and the pool's used slots as they were when it left the index:
        ``stats`` after ``close`` (the planner writes its stats file once more then)."""

    # -- lookups and loads ----------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey], owner: promo.Owner | None = None) -> LookupResult:
        """Leading ``keys`` visible in the shared pool (stored by any engine). Pending only while
        one of them is being loaded for another request of this engine."""
        counters = self._counters
        counters.lookups += 1
        hits = self.index.leading_hits(keys)
        if self._loading and hits and not self._loading.keys().isdisjoint(keys[:hits]):
            return self._pending(hits)
        counters.lookup_blocks += len(keys)
        counters.hit_blocks += hits
        return LookupResult(hits, True)

    def prepare_load(self, keys: Sequence[BlockKey], owner: promo.Owner | None = None) -> list[int]:
        """Pin the leading visible ``keys`` in the shared index; their slots (none when the
        index lock could not be had in time: a miss)."""
        slots = self.index.pin(keys)
        pins, loading, pin_slots = self._pins, self._loading, self._pin_slots
        for key, slot in zip(keys, slots, strict=False):
            pin_slots[key] = slot
            pins[key] = pins.get(key, 0) + 1
            loading[key] = loading.get(key, 0) + 1
        return slots

    def release_load(self, keys: Sequence[BlockKey]) -> None:
        """Drop one load pin per key (the index's pin goes with this engine's last one)."""
        slots = [self._drop_pin(key) for key in keys if self._loading.get(key, 0) > 0]
        if slots and not self.index.unpin(self._unpin_later + slots):
            self._unpin_later += slots  # the lock was busy: next step
        elif slots:
            self._unpin_later = []

    def _drop_pin(self, key: BlockKey) -> int:
        for counts in (self._loading, self._pins):
            left = counts[key] - 1
            if left:
                counts[key] = left
            else:
                del counts[key]
        return self._pin_slots[key] if key in self._pins else self._pin_slots.pop(key)

    def touch(self, keys: Sequence[BlockKey]) -> None:
        self.index.touch(keys)

    def hint_request(self, keys: Sequence[BlockKey], hint: RequestHint) -> None:
        """The shared pool evicts the least recently used blocks of all engines: hints are not
        used."""

    # -- stores ---------------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[BlockKey]) -> StoreReservation:
        """Slots for the keys no engine holds or writes yet (the leading ones when room is
        short); each returned key must later be passed to ``complete_store``."""
        inflight = self._inflight
        todo = list(dict.fromkeys(k for k in keys if k not in inflight))
        reserved, slots = self.index.reserve(todo)
        counters = self._counters
        counters.store_skipped_present += len(keys) - len(todo)
        counters.store_skipped_full += len(todo) - len(reserved)
        inflight.update(zip(reserved, slots, strict=True))
        return StoreReservation(reserved, slots)

    def complete_store(self, keys: Sequence[BlockKey], ok: bool | Sequence[bool] = True) -> None:
        """Publish reserved keys whose bytes are written (``ok``) to every engine, or free them."""
        oks = [ok] * len(keys) if isinstance(ok, bool) else list(ok)
        slots: list[int] = []
        flags: list[bool] = []
        stored: list[BlockKey] = []
        for key, good in zip(keys, oks, strict=True):
            slot = self._inflight.pop(key, None)
            if slot is None:
                continue
            slots.append(slot)
            flags.append(good)
            if good:
                stored.append(key)
        counters = self._counters
        counters.stored_blocks += len(stored)
        counters.store_failed += len(slots) - len(stored)
        later_slots, later_flags = self._publish_later
        if not self.index.publish(later_slots + slots, later_flags + flags):
            self._publish_later = (later_slots + slots, later_flags + flags)
        else:
            self._publish_later = ([], [])
        if self._record and stored:
            self._events.add(EventKind.STORED, stored, POOL_TIER)

    # -- housekeeping ---------------------------------------------------------------------------

    def step(self) -> int:
        """Retry what waited for the index lock; reap engines that died."""
        if self._unpin_later and self.index.unpin(self._unpin_later):
            self._unpin_later = []
        later_slots, later_flags = self._publish_later
        if later_slots and self.index.publish(later_slots, later_flags):
            self._publish_later = ([], [])
        self.index.maintain()
        return 0

    def close(self) -> None:
        """Leave the shared index: this engine's pins and unfinished stores are released."""
        if self._closed:
            return
        self.step()
        self._last_share, self._last_used = self.engine_share(), self.index.used_slots()
        self._closed = True
        self.index.close()

    def stats(self) -> CacheStats:
        self._counters.events_dropped = self._events.dropped
        share = self.engine_share() or self._last_share
        if share is not None:
            self._counters.pool_evictions = share.evictions
        return CacheStats(
            cache=replace(self._counters),
            pool_slots=self._pool.num_slots,
            pool_used=self._last_used if self._closed else self.index.used_slots(),
            pool_pinned=len(self._pins),
            share=share,
        )

    def engine_share(self) -> EngineShare | None:
        """This engine's counters in the shared pool (hits on its own and on others' blocks,
        evictions it caused); None once closed (``stats`` then keeps the last)."""
        if self._closed:
            return None
        me = self.index.me
        return next((s for s in self.index.engine_shares() if s.engine == me), None)

    def check_invariants(self, settled: bool = False) -> None:
        self.index.check_invariants(settled)
        assert self._loading.keys() <= self._pins.keys(), "a load without a pin"
        assert self._pins.keys() == self._pin_slots.keys(), "a pin without its slot"
        if settled:
            assert not self._pins and not self._inflight, "pins or stores left"
