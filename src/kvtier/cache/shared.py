"""``TieredCache`` over a pool that several engines share (``pool.share``).

The engine's planner calls the same methods as on a private pool; here the pool's block index,
pins and eviction are the shared ones (``SharedIndex``), and this object keeps only what is this
engine's own: its pins per key (the index keeps one bit per engine), its reservations, and the
index calls that must be retried because the lock could not be had in time (an unpin or a
publication waits for the next step; it never blocks the engine).

A secondary tier behind a shared pool is shared too (``kvtier.tiers.fs.shared.SharedFsTier``: one
directory, one budget and one index for all engines; ``factory.build_shared_cache`` allows one
such tier, written through). Each block an engine stores is published pinned and copied to the
tier by that engine (a block is stored in the pool once, so it is written once); a lookup that
misses the pool asks the tier, and the blocks found there are read into slots this engine reserves
in the shared pool and published like a store (``_promote``): a hit for every engine from then
on. The promotion rules (budget, read costs, deadlines, pins for the waiting request) are
``TieredCache``'s own (``promotion.PromotionRules``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvtier.cache import promotion as promo
from kvtier.cache.closing import close_tiers
from kvtier.cache.manager import TieredCache
from kvtier.cache.records import LookupResult, OpenTierJob, StoreReservation, TierBinding
from kvtier.cache.tier_jobs import ask_tier
from kvtier.events import POOL_TIER, EventKind
from kvtier.keys import BlockKey
from kvtier.metrics import CacheStats
from kvtier.policies.hints import RequestHint
from kvtier.policies.lru import LRUPolicy
from kvtier.pool import HostPool
from kvtier.shared_pool.index import EngineShare, SharedIndex
from kvtier.tiers.base import TierJobKind

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Publication:
    """Reserved slots to publish (``SharedIndex.publish``), kept while the lock was busy."""

    slots: list[int]
    oks: list[bool]
    pin: list[BlockKey | None]
    """Per slot: the key to pin once published (None: no pin)."""
    write: bool
    """Copy the pinned blocks to the write-through tiers once published."""


class SharedTieredCache(TieredCache):
    def __init__(
        self,
        pool: HostPool,
        index: SharedIndex,
        record_events: bool = True,
        clock: Callable[[], float] = time.monotonic,
        secondary: Sequence[TierBinding] = (),
        job_timeout_s: float = 30.0,
        promotion: promo.PromotionSettings = promo.DEFAULT_SETTINGS,
    ) -> None:
        super().__init__(
            pool,
            LRUPolicy(),
            secondary=secondary,
            job_timeout_s=job_timeout_s,
            record_events=record_events,
            clock=clock,
            promotion=promotion,
        )
        self.index = index
        self._pin_slots: dict[BlockKey, int] = {}
        """Keys this engine pinned -> their slot (while ``_pins`` counts them)."""
        self._unpin_later: list[int] = []
        self._publish_later: list[Publication] = []
        self._last_share: EngineShare | None = None
        self._last_used = 0
        """This engine's line and the pool's used slots as they were when it left the index:
        ``stats`` after ``close`` (the planner writes its stats file once more then)."""

    # -- lookups and loads ----------------------------------------------------------------------

    def lookup(
        self, keys: Sequence[BlockKey], owner: promo.Owner | None = None, held: int = 0
    ) -> LookupResult:
        """Leading ``keys`` visible in the shared pool (stored by any engine). Pending while one
        of them is being loaded for another request of this engine, or while the next ones are
        promoted from the tier (``TieredCache.lookup``'s rules, ``held`` too)."""
        counters, rules = self._counters, self._rules
        counters.lookups += 1
        if owner is not None and owner in rules.promises:
            self.step()  # collect what landed since the engine's last step
        hits = self.index.leading_hits(keys)
        if self._loading and hits and self._loading_elsewhere(keys[:hits], held):
            return self._pending(hits)
        if self._tiers:
            waits = None if owner is None else rules.waits(owner, self._promoting, self._clock())
            if waits or (waits is None and hits < len(keys) and self._promote(keys, hits, owner)):
                return self._pending(hits)
        counters.lookup_blocks += len(keys)
        counters.hit_blocks += hits
        return LookupResult(hits, True)

    def _loading_elsewhere(self, hit_keys: Sequence[BlockKey], held: int) -> bool:
        """Whether a hit key is being loaded for another request (one load of each of the first
        ``held`` is the caller's own)."""
        loading = self._loading
        if not held:
            return not loading.keys().isdisjoint(hit_keys)
        return any(
            key in loading and (i >= held or loading[key] > 1) for i, key in enumerate(hit_keys)
        )

    def _promote(self, keys: Sequence[BlockKey], hits: int, owner: promo.Owner | None) -> bool:
        """Start reading the tier's run of blocks after the pool's hits into slots reserved in
        the shared pool, as far as the promotion rules allow; True while a promotion of them is
        in flight (the lookup is pending)."""
        rest = keys[hits:]
        if rest[0] in self._promoting:
            return True
        answers = promo.tier_answers(self._tiers, rest, ask_tier)
        if answers is None:
            return False
        now, failed = self._clock(), self._failed_promotions
        if failed:
            failed.expire(now)
        run: list[tuple[BlockKey, int]] = []
        for i, key in enumerate(rest):
            found = [t for t, answer in enumerate(answers) if answer[i] and (t, key) not in failed]
            if not found or key in self._inflight:
                break
            run.append((key, found[0]))
        claim = self._rules.claim([t for _, t in run], len(self._promoting), now)
        self._counters.promotions_declined += len(run) - claim.blocks
        if not claim.blocks:
            return False
        self.index.touch(keys[:hits])  # the request's hits are no victims of its promotion
        tier_of = dict(run[: claim.blocks])
        reserved, slots = self.index.reserve(list(tier_of))
        if not reserved:
            return False  # held or being written by another engine, no room, or the lock busy
        by_tier: dict[int, tuple[list[BlockKey], list[int]]] = {}
        for key, slot in zip(reserved, slots, strict=True):
            self._inflight[key] = slot
            self._promoting.add(key)
            group = by_tier.setdefault(tier_of[key], ([], []))
            group[0].append(key)
            group[1].append(slot)
        for tier_index, (tier_keys, tier_slots) in by_tier.items():
            self._counters.promotions += len(tier_keys)
            self._rules.reads[tier_index].started(len(tier_keys))
            self._submit(tier_index, TierJobKind.READ, tier_keys, tier_slots, False)
        if owner is not None:
            self._rules.promise(owner, reserved, claim.deadline, now)
        return True

    def prepare_load(
        self, keys: Sequence[BlockKey], owner: promo.Owner | None = None, held: int = 0
    ) -> list[int]:
        """Pin the leading visible ``keys`` in the shared index; their slots (none when the
        index lock could not be had in time: a miss). The blocks promoted for ``owner`` are
        released to these pins (its promotion ends). ``held`` first keys pinned for this load
        already are pinned again in the index after their pins were dropped (the index touches
        what it pins)."""
        if held:
            self.release_load(keys[:held])
        slots = self.index.pin(keys)
        pins, loading, pin_slots = self._pins, self._loading, self._pin_slots
        for key, slot in zip(keys, slots, strict=False):
            pin_slots[key] = slot
            pins[key] = pins.get(key, 0) + 1
            loading[key] = loading.get(key, 0) + 1
        if owner is not None:
            self.forget(owner)
        return slots

    def release_load(self, keys: Sequence[BlockKey]) -> None:
        """Drop one load pin per key (the index's pin goes with this engine's last one)."""
        slots = [self._drop_pin(key) for key in keys if self._loading.get(key, 0) > 0]
        self._index_unpin(slots)

    def _drop_pin(self, key: BlockKey) -> int:
        for counts in (self._loading, self._pins):
            left = counts[key] - 1
            if left:
                counts[key] = left
            else:
                del counts[key]
        return self._pin_slots[key] if key in self._pins else self._pin_slots.pop(key)

    def _unpin(self, key: BlockKey) -> None:
        """Drop a pin that is not a load's (a promotion held for its request, a tier write)."""
        count = self._pins.get(key, 0)
        if count <= 0:
            return
        if count == 1:
            del self._pins[key]
            slot = self._pin_slots.pop(key)
        else:
            self._pins[key] = count - 1
            slot = self._pin_slots[key]
        self._index_unpin([slot])

    def _unpin_all(self, keys: Sequence[BlockKey]) -> None:
        for key in keys:
            self._unpin(key)

    def _index_unpin(self, slots: list[int]) -> None:
        if slots and not self.index.unpin(self._unpin_later + slots):
            self._unpin_later += slots  # the lock was busy: next step
        elif slots:
            self._unpin_later = []

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
        """Publish reserved keys whose bytes are written (``ok``) to every engine, or free them;
        the published ones are copied to the write-through tier."""
        oks = [ok] * len(keys) if isinstance(ok, bool) else list(ok)
        write = bool(self._through)
        publication = Publication([], [], [], write)
        stored: list[BlockKey] = []
        for key, good in zip(keys, oks, strict=True):
            if key in self._promoting:
                continue  # not the caller's reservation
            slot = self._inflight.pop(key, None)
            if slot is None:
                continue
            publication.slots.append(slot)
            publication.oks.append(good)
            publication.pin.append(key if good and write else None)
            if good:
                stored.append(key)
        counters = self._counters
        counters.stored_blocks += len(stored)
        counters.store_failed += len(publication.slots) - len(stored)
        self._publish(publication)
        if self._record and stored:
            self._events.add(EventKind.STORED, stored, POOL_TIER)

    def _publish(self, publication: Publication) -> None:
        """Publish now, after the ones that waited for the lock, or keep it for the next step."""
        if publication.slots:
            self._publish_later.append(publication)
        while self._publish_later:
            first = self._publish_later[0]
            pins = [key is not None for key in first.pin]
            if not self.index.publish(first.slots, first.oks, pins):
                return
            self._publish_later.pop(0)
            self._published(first)

    def _published(self, publication: Publication) -> None:
        """Count the pins the publication took; copy its blocks to the write-through tier."""
        keys: list[BlockKey] = []
        slots: list[int] = []
        for key, slot, ok in zip(publication.pin, publication.slots, publication.oks, strict=True):
            if key is None or not ok:
                continue
            self._pins[key] = self._pins.get(key, 0) + 1
            self._pin_slots[key] = slot
            keys.append(key)
            slots.append(slot)
        if publication.write and keys:
            self._write_through(keys, slots)

    def _write_through(self, keys: list[BlockKey], slots: list[int]) -> None:
        """Copy published, pinned blocks to the write-through tier (one: the factory allows no
        more); the job's end unpins them (``TieredCache._finish_write``)."""
        tier_index = self._through[0]
        writing = self._writing[tier_index]
        if self._refused.paused(tier_index, self._clock()):
            self._counters.cascade_skipped += len(keys)
            todo: list[tuple[BlockKey, int]] = []
        else:
            todo = [(k, s) for k, s in zip(keys, slots, strict=True) if k not in writing]
        for key in set(keys) - {k for k, _ in todo}:
            self._unpin(key)
        if todo:
            job_keys = [k for k, _ in todo]
            writing.update(job_keys)
            # Pinned in the shared index for every engine: not bounded here, counted so that
            # ``_finish_write`` balances.
            self._copy_room.started(len(job_keys))
            self._submit(tier_index, TierJobKind.WRITE, job_keys, [s for _, s in todo], False)

    def _finish_promotion(self, job: OpenTierJob, ok: list[bool], busy_s: float | None) -> None:
        """A read from the tier ended: publish the blocks read (pinned for the request that
        waits for them), free the slots of the others."""
        if job.abandoned:
            self._release_held(job.slots)
            return
        now, rules = self._clock(), self._rules
        self._read_ended(job, now, busy_s)
        landed: list[BlockKey] = []
        for key, good in zip(job.keys, ok, strict=True):
            self._inflight.pop(key, None)
            self._promoting.discard(key)
            if good:
                landed.append(key)
                self._origin[key] = job.tier_index
            else:
                rules.dropped(key)
                self._failed_promotions.remember(job.tier_index, key, now)
        held = set(rules.landed(landed))  # landed keys only: read good
        pin: list[BlockKey | None] = [key if key in held else None for key in job.keys]
        while len(self._origin) > self._pool.num_slots:
            del self._origin[next(iter(self._origin))]  # evicted by some engine long ago
        self._publish(Publication(list(job.slots), list(ok), pin, False))
        promoted = sum(ok)
        self._promoted[self._tiers[job.tier_index].name] += promoted
        self._counters.promoted_blocks += promoted
        self._counters.promotion_failures += len(ok) - promoted
        if self._record and promoted:
            self._events.add(EventKind.STORED, landed, POOL_TIER)

    def _release_held(self, slots: list[int]) -> None:
        """A promotion that timed out ended at last: its slots, still reserved, are freed."""
        held = self._held
        for slot in slots:
            held[slot] = held.get(slot, 1) - 1
        free = [slot for slot in slots if held[slot] <= 0]
        for slot in free:
            del held[slot]
        self._publish(Publication(free, [False] * len(free), [None] * len(free), False))

    # -- housekeeping ---------------------------------------------------------------------------

    def step(self) -> int:
        """Collect the tier's reports; retry what waited for the index lock; reap engines that
        died."""
        ended = super().step() if self._tiers else 0
        if self._unpin_later and self.index.unpin(self._unpin_later):
            self._unpin_later = []
        self._publish(Publication([], [], [], False))
        self.index.maintain()
        return ended

    def close(self) -> None:
        """Close the tier (its jobs finish or are abandoned), then leave the shared index: this
        engine's pins and unfinished stores are released. While a tier job is still open (its
        thread stuck), the index is left open until the process ends: that thread may still read
        a pinned slot, which must not be handed to another engine meanwhile."""
        if self._closed:
            return
        close_tiers(self._tiers, self._close_timeout_s)
        self.step()
        self._last_share, self._last_used = self.engine_share(), self.index.used_slots()
        self._closed = True
        if self._jobs:
            log.warning("a tier job is still running: the shared pool's pins stay until exit")
            return
        self.index.close()

    def stats(self) -> CacheStats:
        """``TieredCache.stats`` with the shared index's occupancy and this engine's line."""
        share = self.engine_share() or self._last_share
        if share is not None:
            self._counters.pool_evictions = share.evictions
        used = self._last_used if self._closed else self.index.used_slots()
        return replace(super().stats(), pool_used=used, share=share)

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
