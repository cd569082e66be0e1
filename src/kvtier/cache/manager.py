"""The tiered block cache: which keys live where, pins, in-flight jobs, cascade and promotion.

``TieredCache`` runs on one thread (an engine's scheduler). It never waits on I/O: secondary tiers
run jobs on their own threads, and ``step()`` (once per engine step) collects what finished.

Life of a key in the pool::

    prepare_store -> in flight (slot reserved, invisible) -> complete_store -> visible
    visible -> evicted (slot freed, or held until write-on-evict copies finished)
    secondary hit -> lookup starts a promotion (in flight) -> visible

Invariants kept here (each one tested): a pinned key (being loaded or copied to a tier) is never
evicted; a key is visible only after its bytes were completely written; each key has at most one
job moving it into the pool at a time; the pool never holds more blocks than it has slots; tier
failures become misses or failed jobs, never exceptions into the caller.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from itertools import takewhile

from kvtier.cache import promotion as promo
from kvtier.cache.admitting import admit_new
from kvtier.cache.closing import close_tiers
from kvtier.cache.copy_room import COPY_SHARE, CopyRoom
from kvtier.cache.event_log import MAX_EVENTS, EventLog
from kvtier.cache.pins import release_held, unpin_all
from kvtier.cache.records import LookupResult, OpenTierJob, StoreReservation, TierBinding
from kvtier.cache.reports import CacheReports
from kvtier.cache.retry import FailedPromotions, RefusedWrites
from kvtier.cache.tier_jobs import TierJobs, ask_tier
from kvtier.cache.write_back import WriteBack
from kvtier.events import POOL_TIER, EventKind
from kvtier.keys import BlockKey
from kvtier.metrics import CacheCounters
from kvtier.policies.admission import AdmissionFilter
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.hints import RequestHint
from kvtier.pool import HostPool
from kvtier.tiers import contract
from kvtier.tiers.base import TierJobKind, WriteMode

__all__ = ["MAX_EVENTS", "LookupResult", "StoreReservation", "TierBinding", "TieredCache"]

log = logging.getLogger(__name__)


class TieredCache(CacheReports):
    def __init__(
        self,
        pool: HostPool,
        policy: EvictionPolicy,
        secondary: Sequence[TierBinding] = (),
        admission: AdmissionFilter | None = None,
        job_timeout_s: float = 30.0,
        record_events: bool = True,
        writeback_window: int = 0,
        clock: Callable[[], float] = time.monotonic,
        max_events: int = MAX_EVENTS,
        close_timeout_s: float | None = None,
        promotion: promo.PromotionSettings = promo.DEFAULT_SETTINGS,
        copy_share: float = COPY_SHARE,
    ) -> None:
        self._pool = pool
        self._policy = policy
        self._secondary = list(secondary)
        self._tiers = [s.tier for s in self._secondary]
        modes = [s.write_mode for s in self._secondary]
        self._through = [i for i, mode in enumerate(modes) if mode is WriteMode.THROUGH]
        self._admission = admission if admission is not None and admission.min_seen > 1 else None
        on_evict = [i for i, mode in enumerate(modes) if mode is WriteMode.ON_EVICT]
        self._writeback = WriteBack(on_evict, writeback_window, job_timeout_s, clock)
        self._close_timeout_s = job_timeout_s if close_timeout_s is None else close_timeout_s
        self._record = record_events
        self._clock = clock

        self._index: dict[BlockKey, int] = {}
        """Visible keys -> slot."""
        self._inflight: dict[BlockKey, int] = {}
        """Keys whose slot is being written (a store from the engine or a promotion) -> slot."""
        self._promoting: set[BlockKey] = set()
        self._pins: dict[BlockKey, int] = {}
        """Visible keys whose slot is being read (loads and cascade writes) -> count."""
        self._loading: dict[BlockKey, int] = {}
        """The subset of pins that are loads into the engine -> count."""
        self._held: dict[int, int] = {}
        """Slots owned by running jobs after their key left the pool -> number of such jobs."""
        self._writing: list[set[BlockKey]] = [set() for _ in self._secondary]
        self._copy_room = CopyRoom(math.ceil(copy_share * pool.num_slots), self._through)
        self._jobs = TierJobs(self._tiers, job_timeout_s, clock)
        self._rules = promo.PromotionRules(
            len(self._tiers), promotion, pool.num_slots, job_timeout_s
        )
        self._failed_promotions = FailedPromotions()
        self._answers = promo.KeptAnswers(self._tiers, ask_tier)
        self._refused = RefusedWrites(self._tiers)
        self._events = EventLog(max_events)
        self._counters = CacheCounters()
        self._promoted = {t.name: 0 for t in self._tiers}
        self._origin: dict[BlockKey, int] = {}
        """Pool keys promoted from a secondary tier -> its index, while they stay in the pool (an
        engine's hit metrics name the tier a hit came from)."""
        self._closed = False

    # -- lookups and loads ----------------------------------------------------------------------

    def lookup(
        self, keys: Sequence[BlockKey], owner: promo.Owner | None = None, held: int = 0
    ) -> LookupResult:
        """How many leading ``keys`` are in the pool, and whether that answer is final.

        Not final while a promotion of the next keys from a secondary tier is in flight (this call
        starts one when a tier has them and reading is expected to beat computing,
        ``kvtier.cache.promotion``), while a tier cannot tell yet, or while one of the hit keys is
        being loaded for another request (loading it twice would waste engine memory: ask again once
        that load finished and the engine's own prefix cache has it). ``owner`` (the request)
        keeps the blocks promoted for it pinned until its ``prepare_load`` or ``forget``, and
        stops its wait at a deadline; without one, promoted blocks are not held. ``held``: the
        first keys' loads are the caller's own (``lookup_and_pin``), not another request's.
        """
        counters, index, rules = self._counters, self._index, self._rules
        counters.lookups += 1
        if owner is not None and owner in rules.promises:
            self.step()  # collect what landed since the engine's last step
        hits, loading = promo.pool_hits(keys, index, self._loading, held)
        if loading:
            return self._pending(hits)
        waits = None if owner is None else rules.waits(owner, self._promoting, self._clock())
        if waits:
            return self._pending(hits)
        promote = waits is None and hits < len(keys) and self._secondary
        if promote and not self._promote(keys, hits, owner):
            return self._pending(hits)
        counters.lookup_blocks += len(keys)
        counters.hit_blocks += hits
        return LookupResult(hits, True)

    def _pending(self, hits: int) -> LookupResult:
        self._counters.pending_lookups += 1
        return LookupResult(hits, False)

    def lookup_and_pin(
        self, keys: Sequence[BlockKey], owner: promo.Owner, held: int = 0
    ) -> tuple[LookupResult, list[int]]:
        """``lookup``, then, if its answer is final, ``prepare_load`` of the hits (their slots;
        none otherwise), for a caller that holds the loads its previous call for ``owner`` pinned
        for the first ``held`` keys and gives them up now: the answer and pins of
        ``release_load(keys[:held])`` before both calls, keeping the pins both hold instead of
        dropping and taking them again (an engine asks every step for a request it has no room
        for yet, which may hit hundreds of blocks)."""
        result = self.lookup(keys, owner, held)
        if not result.final:
            self.release_load(keys[:held])
            return result, []
        if result.hits < held:
            # A held key is pinned, so visible, but a lock-free read of a shared index racing a
            # shift of its table may miss it (``table.remove_at``): the pins past the hits go.
            self.release_load(keys[result.hits : held])
            held = result.hits
        return result, self.prepare_load(keys[: result.hits], owner, held)

    def prepare_load(
        self, keys: Sequence[BlockKey], owner: promo.Owner | None = None, held: int = 0
    ) -> list[int]:
        """Pin the leading visible ``keys`` for reading and return their slots.

        Fewer slots than keys when a key is no longer visible. Every pinned key must later be
        passed to ``complete_load``. The blocks promoted for ``owner`` are released to these
        pins (its promotion ends). ``held``: the first keys are pinned for this load already
        (``lookup_and_pin``); they are touched like the others, not pinned twice.
        """
        index, pins, loading = self._index, self._pins, self._loading
        found = list(takewhile(index.__contains__, keys))
        if len(found) < held:
            self.release_load(keys[len(found) : held])
        for key in found[held:] if held else found:
            pins[key] = pins.get(key, 0) + 1
            loading[key] = loading.get(key, 0) + 1
        # The policy reads no pins: touched after pinning, deepest first (the eviction order
        # takes a prefix's tail before its head: a tail without its head is never hit).
        self._policy.access_many(found[::-1])
        if owner is not None:  # its promotion ends; its kept answers stay until ``forget``
            self._unpin_all(self._rules.end(owner))
        return list(map(index.__getitem__, found))

    def forget(self, owner: promo.Owner) -> None:
        """The request stopped waiting (it left, or loaded): unpin what was promoted for it."""
        self._unpin_all(self._rules.leave(owner))
        self._answers.forget(owner)

    def engine_step(self, tokens: int, requests: int = 1, running: int = 1) -> None:
        """The engine step that runs until the next call computes ``tokens`` for ``requests`` of
        its ``running`` requests (the rate decides whether reading a tier's blocks pays)."""
        self._rules.compute.step(tokens, self._clock(), requests, running)

    def complete_load(self, keys: Sequence[BlockKey], ok: bool = True) -> None:
        """Unpin keys returned by ``prepare_load`` after the copy; ``ok=False`` counts a failure."""
        self.release_load(keys)
        if ok:
            self._counters.loaded_blocks += len(keys)
        else:
            self._counters.load_failed += len(keys)

    def release_load(self, keys: Sequence[BlockKey]) -> None:
        """Unpin keys returned by ``prepare_load`` whose copy never started."""
        # _unpin inline: a waiting request's plan is released and made again every step.
        loading, pins = self._loading, self._pins
        for key in keys:
            count = loading.get(key, 0)
            if count <= 0:
                continue
            if count == 1:
                del loading[key]
            else:
                loading[key] = count - 1
            pinned = pins.get(key, 0)
            if pinned == 1:
                del pins[key]
            elif pinned > 1:
                pins[key] = pinned - 1

    def touch(self, keys: Sequence[BlockKey]) -> None:
        """Mark visible keys as recently used, deepest first (``prepare_load``)."""
        index = self._index
        self._policy.access_many([key for key in reversed(keys) if key in index])

    def hint_request(self, keys: Sequence[BlockKey], hint: RequestHint) -> None:
        """Tell the eviction policy about a served request: its blocks in order and what the
        engine knows of it (``RequestHint``). Optional; call it when the request finished, after
        its stores were published: blocks still in flight are not in the pool to be ranked."""
        self._policy.on_request(keys, hint)

    # -- stores ---------------------------------------------------------------------------------

    def prepare_store(self, keys: Sequence[BlockKey]) -> StoreReservation:
        """Reserve slots for the keys not yet present or in flight.

        Keys already visible are touched instead. With an admission filter, a key is reserved only
        on its ``min_seen``-th offer; without a tier below, keys beyond the free slots only as far
        as the policy's ``admit_store`` allows (``cache/admitting.py``). Where the pool cannot free
        enough unpinned slots the leading keys get the slots there are; each to ``complete_store``.
        """
        index, inflight = self._index, self._inflight
        # Touched deepest first, as ``prepare_load`` does; a leading run present found in C.
        lead = len(list(takewhile(index.__contains__, keys)))
        present = [key for key in reversed(keys[lead:]) if key in index]
        present.extend(reversed(keys[:lead]))
        self._policy.access_many(present)
        todo = [key for key in keys[lead:] if key not in index and key not in inflight]
        counters = self._counters
        counters.store_skipped_present += len(keys) - len(todo)
        if not todo:
            return StoreReservation([], [])
        if len(todo) > 1 and len(set(todo)) != len(todo):
            todo = list(dict.fromkeys(todo))
        # A tier takes what the pool evicts only while copies have room (``COPY_SHARE``):
        # beyond it the pool's own admission decides, as without a tier.
        free = self._pool.num_free
        tiered = bool(self._tiers) and self._copy_room.admits(len(todo))
        todo = admit_new(todo, self._admission, self._policy, free, counters, tiered)
        slots = self._reserve(len(todo))
        if len(slots) < len(todo):
            counters.store_skipped_full += len(todo) - len(slots)
            todo = todo[: len(slots)]
        inflight.update(zip(todo, slots, strict=True))
        return StoreReservation(todo, slots)

    def complete_store(self, keys: Sequence[BlockKey], ok: bool | Sequence[bool] = True) -> None:
        """Publish reserved keys whose bytes are written (``ok``) or release their slots."""
        oks = [ok] * len(keys) if isinstance(ok, bool) else list(ok)
        index, inflight, promoting = self._index, self._inflight, self._promoting
        stored: list[BlockKey] = []
        failed_slots: list[int] = []
        # Inserted deepest first, as loads touch (``prepare_load``); published in order.
        for key, good in zip(reversed(keys), reversed(oks), strict=True):
            if promoting and key in promoting:
                continue  # not the caller's reservation
            slot = inflight.pop(key, None)
            if slot is None:
                continue
            if good:
                index[key] = slot
                stored.append(key)
            else:
                failed_slots.append(slot)
        self._policy.insert_many(stored)
        stored.reverse()
        if failed_slots:
            self._pool.free(failed_slots)
            self._counters.store_failed += len(failed_slots)
        self._counters.stored_blocks += len(stored)
        if self._record and stored:
            self._events.add(EventKind.STORED, stored, POOL_TIER)
        if stored and self._through:
            for tier_index in self._through:
                self._submit_write(tier_index, stored)
        if stored:
            self._writeback.stored(stored)

    # -- engine-step housekeeping ---------------------------------------------------------------

    def step(self) -> int:
        """Collect finished tier jobs and tier evictions, time out stuck jobs; returns the number
        of jobs that ended."""
        ended = 0
        for tier_index, tier in enumerate(self._tiers):
            try:
                reports = contract.job_reports(tier.poll())
                evicted = contract.evicted_keys(tier.take_evicted())
            except Exception:
                log.exception("tier %s failed to report", tier.name)
                tier.counters.errors += 1
                continue
            if reports is None or evicted is None or reports[1]:
                tier.counters.errors += 1  # what is malformed is left out; its jobs time out
            for job_id, ok, busy_s in reports[0] if reports is not None else ():
                job = self._jobs.settle(tier_index, job_id)
                if job is not None:
                    self._finish_job(job, ok, busy_s)
                    ended += 1
            if evicted and self._record:
                self._events.add(EventKind.EVICTED, evicted, tier.name)
        if self._jobs:
            self._time_out_jobs()
        if self._rules.promises or self._rules.room_waits:
            for owner in self._rules.expired(self._clock()):
                self.forget(owner)
        for tier_index in self._copy_room.due(self._clock()):
            self._submit_write(tier_index, self._copy_room.take_waiting(tier_index))
        if self._writeback.due():
            candidates = self._writeback.take_coldest(self._policy.coldest)
            for tier_index in self._writeback.tiers if candidates else ():
                self._writeback.started(self._submit_write(tier_index, candidates))
        return ended

    def wait(self, timeout_s: float) -> bool:
        """Step until at least one tier job ended or ``timeout_s`` passed (for simulators and
        tests; an engine calls ``step()`` once per step instead). True if a job ended."""
        deadline = time.monotonic() + timeout_s
        delay = 0.0002
        while True:
            if self.step():
                return True
            if not self._jobs or time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def close(self) -> None:
        """Close the secondary tiers (they finish running jobs) and settle what they report.

        Returns within ``close_timeout_s`` (default ``job_timeout_s``) plus one ``step()``,
        whatever the tiers do: each tier is closed on a helper thread, all at once, and a tier
        whose ``close()`` has not returned by then is left to finish on its own (named in a
        warning). Its unreported jobs keep their slots and pins: its threads may still use them.

        The pool is closed by whoever created it.
        """
        if self._closed:
            return
        self._closed = True
        self._counters.cascade_skipped += self._copy_room.drop_waiting()  # no new jobs now
        close_tiers(self._tiers, self._close_timeout_s)
        self.step()

    # -- internals ------------------------------------------------------------------------------

    def _unpin_all(self, keys: Sequence[BlockKey]) -> None:
        unpin_all(self._pins, keys)

    def _release_held(self, slots: list[int]) -> None:
        self._pool.free(release_held(self._held, slots))

    def _reserve(self, n: int, protected: Sequence[BlockKey] = ()) -> list[int]:
        """Up to ``n`` free slots, evicting unpinned visible keys as needed (every pin is on a
        visible key: the policy is not made to scan a pool that tier writes pinned full), none
        of ``protected`` (pinned while victims are chosen, only when free slots fall short: they
        are a request's hits, hundreds of pins on a scheduler step's slowest path)."""
        slots = self._pool.alloc(n)
        if len(slots) == n:
            return slots
        pins = self._pins
        for key in protected:
            pins[key] = pins.get(key, 0) + 1
        try:
            short = min(n - len(slots), len(self._index) - len(pins))
            if short > 0:
                victims = self._policy.evict(short, pins)
                if victims:
                    self._evict(victims)
                    slots += self._pool.alloc(short)
            return slots
        finally:
            self._unpin_all(protected)

    def _evict(self, victims: list[BlockKey]) -> None:
        index = self._index
        slots = list(map(index.pop, victims))
        if self._origin:
            for key in victims:
                self._origin.pop(key, None)
        self._counters.pool_evictions += len(victims)
        self._counters.cascade_skipped += self._copy_room.evicted(victims)
        if self._record:
            self._events.add(EventKind.EVICTED, victims, POOL_TIER)
        dirty_keys, dirty_slots = self._writeback.take_evicted(victims, slots)
        for tier_index in self._writeback.tiers if dirty_keys else ():
            self._submit_write(tier_index, dirty_keys, dirty_slots)
        held = self._held
        self._pool.free([slot for slot in slots if slot not in held] if held else slots)

    def _submit_write(
        self, tier_index: int, keys: list[BlockKey], evicted_slots: list[int] | None = None
    ) -> int:
        """Copy keys' slots to a tier. Visible keys are pinned meanwhile; for evicted keys the job
        holds their slots instead. Returns how many keys the job copies."""
        if self._refused.paused(tier_index, self._clock()):
            self._counters.cascade_skipped += len(keys)
            return 0
        writing = self._writing[tier_index]
        if evicted_slots is None:  # every stored block, written through: one pass each
            job_keys = [k for k in keys if k not in writing] if writing else list(keys)
            index = self._index
            job_slots = [index[k] for k in job_keys]
        else:
            pairs = [(k, s) for k, s in zip(keys, evicted_slots, strict=True) if k not in writing]
            if pairs:
                known = ask_tier(self._tiers[tier_index], [k for k, _ in pairs])
                pairs = [p for p, present in zip(pairs, known, strict=True) if present is not True]
            job_keys, job_slots = [k for k, _ in pairs], [s for _, s in pairs]
        if self._copy_room.counts(tier_index, evicted_slots is not None):
            n, left_out = self._copy_room.take(tier_index, job_keys, evicted_slots is None)
            self._counters.cascade_skipped += left_out
            job_keys, job_slots = job_keys[:n], job_slots[:n]
        if not job_keys:
            return 0
        writing.update(job_keys)
        if evicted_slots is None:
            pins = self._pins
            for key in job_keys:
                pins[key] = pins.get(key, 0) + 1
        else:
            held = self._held
            for slot in job_slots:
                held[slot] = held.get(slot, 0) + 1
        self._submit(tier_index, TierJobKind.WRITE, job_keys, job_slots, evicted_slots is not None)
        return len(job_keys)

    def _promote(self, keys: Sequence[BlockKey], hits: int, owner: promo.Owner | None) -> bool:
        """Start promoting the secondary-tier run after the pool hits, as far as the budget and the
        costs allow (``PromotionRules.claim``); True if the answer is final (nothing to promote),
        False if a promotion is in flight or a tier cannot tell yet."""
        if keys[hits] in self._promoting:
            return False
        if self._answers.hold_nothing():  # each lookup's tier work was 6 us on a full disk
            return True
        rest, inflight, index = keys[hits:], self._inflight, self._index
        now, rules, failed = self._clock(), self._rules, self._failed_promotions
        if owner in rules.room_waits and self.pinned_full:  # no tier asked: the deadline decides
            return not (self._jobs.any_writes() and now < rules.room_waits[owner])
        answers = self._answers.answers(rest, owner)
        if answers is None:
            return True
        if failed:
            failed.expire(now)
        run, unknown = promo.tier_run(rest, answers, index, inflight, self._promoting, failed)
        wanted = [(key, t) for key, t in run if t >= 0]
        if not wanted:
            return not unknown
        claim = rules.claim([t for _, t in wanted], len(self._promoting), now)
        if claim.blocks < len(wanted):
            self._counters.promotions_declined += len(wanted) - claim.blocks
            wanted = wanted[: claim.blocks]
            if not wanted:
                return True
        # A promotion must not evict the very blocks the request is about to hit.
        slots = self._reserve(len(wanted), [*keys[:hits], *(k for k, t in run if t < 0)])
        if not slots:
            # The pool is full of pinned blocks. Tier writes in flight release theirs when they
            # end: wait for them until the claim's deadline; with none, go on without.
            writes = self._jobs.any_writes()
            return not (writes and rules.waits_for_room(owner, claim.deadline, now))
        wanted = wanted[: len(slots)]
        claimed = [key for key, _ in wanted]
        inflight.update(zip(claimed, slots, strict=True))
        self._promoting.update(claimed)
        by_tier: dict[int, tuple[list[BlockKey], list[int]]] = {}
        if len({t for _, t in wanted}) == 1:  # one tier's run, the common case: no step per key
            by_tier[wanted[0][1]] = (list(claimed), slots)
        else:
            for (key, tier_index), slot in zip(wanted, slots, strict=True):
                tier_keys, tier_slots = by_tier.setdefault(tier_index, ([], []))
                tier_keys.append(key)
                tier_slots.append(slot)
        for tier_index, (tier_keys, tier_slots) in by_tier.items():
            self._counters.promotions += len(tier_keys)
            rules.reads[tier_index].started(len(tier_keys))
            self._submit(tier_index, TierJobKind.READ, tier_keys, tier_slots, False)
        if owner is not None:
            rules.promise(owner, claimed, claim.deadline, now)
        return False

    def _submit(
        self, index: int, kind: TierJobKind, keys: list[BlockKey], slots: list[int], holds: bool
    ) -> None:
        refused = self._jobs.submit(index, kind, keys, slots, holds)
        if refused is not None:
            self._finish_job(refused, [False] * len(keys))

    def _finish_job(self, job: OpenTierJob, reported: object, busy_s: float | None = None) -> None:
        ok = contract.job_flags(reported, len(job.keys))
        if ok is None:  # a malformed report proves nothing: treat as failed
            self._tiers[job.tier_index].counters.errors += 1
            ok = [False] * len(job.keys)
        if job.kind is TierJobKind.READ:
            self._finish_promotion(job, ok, busy_s)
        else:
            self._finish_write(job, ok)

    def _finish_promotion(self, job: OpenTierJob, ok: list[bool], busy_s: float | None) -> None:
        if job.abandoned:
            self._release_held(job.slots)
            return
        inflight, index, origin, record = self._inflight, self._index, self._origin, self._record
        promoting, counters, rules, pins = self._promoting, self._counters, self._rules, self._pins
        free, landed = [], []
        now = self._clock()
        self._read_ended(job, now, busy_s)
        # Inserted deepest first, as loads touch (``prepare_load``).
        for key, slot, good in zip(
            reversed(job.keys), reversed(job.slots), reversed(ok), strict=True
        ):
            inflight.pop(key, None)
            promoting.discard(key)
            if good:
                index[key] = slot
                landed.append(key)
                origin[key] = job.tier_index
            else:
                free.append(slot)
                rules.dropped(key)
                self._failed_promotions.remember(job.tier_index, key, now)
        for key in rules.landed(landed):  # held for the requests that wait for them
            pins[key] = pins.get(key, 0) + 1
        if record and landed:
            self._events.add(EventKind.STORED, landed, POOL_TIER)
        self._policy.insert_many(landed)
        promoted = len(job.keys) - len(free)
        self._promoted[self._tiers[job.tier_index].name] += promoted
        counters.promoted_blocks += promoted
        if free:
            counters.promotion_failures += len(free)
            self._pool.free(free)

    def _read_ended(self, job: OpenTierJob, now: float, busy_s: float | None = None) -> None:
        submitted = job.deadline - self._jobs.timeout_s
        self._rules.reads[job.tier_index].ended(len(job.keys), submitted, now, busy_s)

    def _finish_write(self, job: OpenTierJob, ok: list[bool]) -> None:
        self._refused.ended(job.tier_index, ok, self._clock())
        self._writing[job.tier_index].difference_update(job.keys)
        if self._copy_room.counts(job.tier_index, job.holds_slots):
            self._copy_room.ended(len(job.keys))
        if job.holds_slots:
            self._release_held(job.slots)
        else:
            self._unpin_all(job.keys)
        if self._writeback.settles(job.tier_index, job.holds_slots):
            self._writeback.settle(self._tiers[job.tier_index].name, job.keys, ok, self._index)
        good = sum(ok)
        self._counters.cascade_writes += good
        self._counters.cascade_failures += len(ok) - good
        if self._record and good:
            name = self._tiers[job.tier_index].name
            self._events.add(
                EventKind.STORED, [k for k, k_ok in zip(job.keys, ok, strict=True) if k_ok], name
            )

    def _time_out_jobs(self) -> None:
        now = self._clock()
        for job in self._jobs.time_out(now):
            self._counters.job_timeouts += 1
            if job.kind is TierJobKind.READ:
                # The request stops waiting (the keys become misses), but the slots stay owned by
                # the job: its thread may still write into them.
                held = self._held
                self._read_ended(job, now)
                for key, slot in zip(job.keys, job.slots, strict=True):
                    self._rules.dropped(key)
                    self._inflight.pop(key, None)
                    self._promoting.discard(key)
                    self._failed_promotions.remember(job.tier_index, key, now)
                    held[slot] = held.get(slot, 0) + 1
                self._counters.promotion_failures += len(job.keys)
            # A stuck write keeps its pins: its thread may still be reading the slots, and a
            # reused slot would be copied torn (with a checksum that matches the torn bytes).
