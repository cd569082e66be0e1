"""LRU that evicts the blocks it predicts dead first, from what the engine says of each request.

Without hints this is exactly LRU. With ``on_request`` hints (an engine calls it when a request
finished; ``kvtier simulate`` after each request) the blocks the request computed itself are
ranked by the reuse rate of their class (``reuse_rates.py``: the request's output length, the
block's place from its end, whether the request hit anything), learned online: a block of a class
below ``DEMOTE_RATIO`` times the mean rate of new blocks goes to a *dead* segment that is evicted
before anything else (oldest first); every other block stays where LRU has it. On the bundled
trace the policy learns that requests with short outputs are re-sent and that a request's last
block is not; on a workload where every class is reused alike (the vLLM demo's), nothing is
demoted and it evicts as LRU does.

An engine's timing is not a replay's: vLLM stores a request's blocks during its prefill and tells
the policy about the request only when it finished, which may be many stored blocks later (other
requests in flight) or before the request's last stores completed (the hint comes first in the
same engine step). A block waits for its hint where LRU puts it (an *unranked* block: stored since
the first hint, not covered by one yet), so a late hint costs nothing and a hint that never comes
leaves plain LRU; a hint for a block not in the pool yet is remembered (a FIFO of at most
``capacity`` keys) and applied when the block is stored (at the policy's next call, in the
request's order: the manager inserts a run deepest first). A block stored again after an eviction
(its key still in the ghost history, ``GHOST_FACTOR`` times the capacity) or hit is not ranked:
its reuse is known.

At each hint the request's blocks that are in the LRU order are touched again deepest first, so
that LRU evicts a request's last blocks before its first ones: a prefix hit needs the leading
blocks, and a tail without them is useless.

**Under pressure** (``pressure.py``: conversations return after more blocks than the pool holds,
where LRU thrashes and caches nothing) the policy keeps a stable subset of the conversations
instead. At its hint, a request's leading hit run goes to a *kept* segment and the blocks it
computed to a *new* segment; victims are, in order: dead blocks, expired blocks (kept and new
not used for ``EXPIRY_GAPS`` mean conversation gaps: finished conversations; blocks in the LRU
order not stored or used for ``LRU_EXPIRY_GAPS``: left there by requests no hint filed), new
blocks newest first (so the conversations already held stay and the last one stored goes
again), then the LRU order and kept blocks, oldest first. ``admit_store`` lets a pool refuse a
store outright when nothing it holds has expired (a newcomer would only displace a conversation
that comes back): always where the mode pays (``PressureGauge.pays``: LRU would find next to
nothing), elsewhere only while the pool serves less than the stable shadow. A request predicted
to be its conversation's last (``turns.py``) puts its blocks in the dead segment. When the gauge
says the pressure is over, both segments go back into the LRU order.

What lost to this on the bundled trace and in the demo (a probation segment, promoting classes
above the mean, a reserve for blocks waiting for hints): docs/policies.md.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Container, Sequence
from itertools import filterfalse, islice, repeat, takewhile
from operator import itemgetter

from kvtier.keys import BlockKey
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.hints import RequestHint
from kvtier.policies.pressure import GATE_HOLD, PressureGauge
from kvtier.policies.reuse_rates import (
    POSITIONS,
    SAMPLE,
    ReuseRates,
    block_class,
    first_class,
)
from kvtier.policies.segments import (
    GHOST_FACTOR,
    drain,
    oldest_unpinned,
    remember_evicted,
    take_keys,
)
from kvtier.policies.segments import take as _take

DEMOTE_RATIO = 0.7
"""A class below this fraction of the mean reuse rate of new blocks is predicted dead: relative
to the learned mean, not to any trace; a class near the mean is left to LRU."""
LRU_EXPIRY_GAPS = 2.0
"""Under pressure, a block in the LRU order not stored or used for this many mean gaps has
expired. vLLM hints a request when it finished, after its stores; blocks a hint never files
stayed there for good, while every store was refused: a conversation that ended just before
the mode turned on held a third of the pool to the end of a run (16 in flight, 2 GiB), and in
the demo the warm-up's blocks held all of it (0 tokens loaded). Two gaps, not one: in flight, a
block waits there for its request's hint (engine replays, docs/policies.md: 1 gap 0.59 of the
offline optimum on average, 0.54 at 16 in flight and 2 GiB; 2 gaps 0.60 and 0.60; 3 gaps 0.58
and 0.55; the demo's calls: 875 / 834 / 633 pool hits, LRU 597)."""


class HintedPolicy(EvictionPolicy):
    kind = "hinted"

    @classmethod
    def create(cls, capacity_blocks: int) -> HintedPolicy:
        return cls(capacity_blocks)

    def __init__(self, capacity: int, ghost_factor: float = GHOST_FACTOR) -> None:
        if capacity <= 0:
            raise ValueError(f"hinted policy capacity must be positive, got {capacity}")
        if ghost_factor < 0.0:
            raise ValueError(f"ghost_factor must be >= 0, got {ghost_factor}")
        self.capacity = capacity
        self.ghost_capacity = int(ghost_factor * capacity)
        # Oldest first in each (OrderedDict: popping from the front of a dict leaves tombstones).
        self._lru: OrderedDict[BlockKey, int] = OrderedDict()
        """The LRU order -> the request (gauge clock) of each block's last store or use."""
        self._dead: OrderedDict[BlockKey, None] = OrderedDict()
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()
        self._unranked: dict[BlockKey, None] = {}
        """Keys in ``_lru`` stored since the first hint and not covered by a hint yet."""
        self._early: OrderedDict[BlockKey, int] = OrderedDict()
        """Keys hinted before they were stored -> their class, applied by ``insert``."""
        self._pending: list[tuple[BlockKey, int]] = []
        """Keys hinted before they were stored and stored since this policy's last call other
        than ``insert``, with their class: ranked at that call, in the order of their requests
        (the last stored first, ``_rank_pending``)."""
        self._hints_seen = False
        self.rates = ReuseRates(capacity)
        self.gauge = PressureGauge(capacity)
        self.pressure = False
        """Whether the stable mode is on (``kept`` and ``new`` in use)."""
        self._kept: OrderedDict[BlockKey, int] = OrderedDict()
        """Under pressure: blocks a request found, -> the request (gauge clock) of their use."""
        self._new: OrderedDict[BlockKey, int] = OrderedDict()
        """Under pressure: blocks a request computed, -> its request; evicted newest first."""

    # -- the policy interface -------------------------------------------------------------------

    def insert(self, key: BlockKey) -> None:
        self._lru[key] = self.gauge.requests
        early = self._early
        cls = early.pop(key, None) if early else None
        ghost = self._ghost
        if key in ghost:
            del ghost[key]  # stored again after an eviction: used before, not ranked
        elif cls is not None:
            self._pending.append((key, cls))
        elif self._hints_seen:
            self._unranked[key] = None

    def insert_many(self, keys: Sequence[BlockKey]) -> None:
        """``insert`` of each key in turn, in one call (a store or a promotion lands a run of
        blocks); nothing the loop reads changes inside it but what ``insert`` changes."""
        if type(self).insert is not HintedPolicy.insert:
            for key in keys:
                self.insert(key)
            return
        lru, early, ghost, now = self._lru, self._early, self._ghost, self.gauge.requests
        pending, unranked, hints_seen = self._pending, self._unranked, self._hints_seen
        for key in keys:
            lru[key] = now
            cls = early.pop(key, None) if early else None
            if key in ghost:
                del ghost[key]
            elif cls is not None:
                pending.append((key, cls))
            elif hints_seen:
                unranked[key] = None

    def access(self, key: BlockKey) -> None:
        if self._pending:
            self._rank_pending()
        dead, lru = self._dead, self._lru
        if key in dead:
            del dead[key]
            lru[key] = self.gauge.requests
        elif self.pressure and (key in self._kept or key in self._new):
            # In use again: in the LRU order until the request's hint files it.
            if self._kept.pop(key, None) is None:
                del self._new[key]
            lru[key] = self.gauge.requests
        else:
            lru.move_to_end(key)
            lru[key] = self.gauge.requests
            self._unranked.pop(key, None)

    def access_many(self, keys: Sequence[BlockKey]) -> None:
        """``access`` of each key in turn, in one call: the manager touches a request's whole
        run at each lookup and store, hundreds of blocks, and a call per block was a fifth of
        the scheduler's slowest steps (vLLM 0.25.1 replay, 8 in flight, 2-core VM). Nothing the
        loop reads changes inside it but what ``access`` itself changes. No key, no call: the
        pending keys are ranked at the next call as they would have been."""
        if not keys:
            return
        if self._pending:
            self._rank_pending()
        if type(self).access is not HintedPolicy.access:
            for key in keys:
                self.access(key)
            return
        if self._newest(keys):
            return  # touching them would change nothing
        lru, dead, unranked, now = self._lru, self._dead, self._unranked, self.gauge.requests
        kept, new, move = self._kept, self._new, lru.move_to_end  # both empty without pressure
        if not dead and not unranked and not kept and not new:
            for key in keys:
                move(key)
                lru[key] = now
            return
        for key in keys:
            if key in dead:
                del dead[key]
            elif key in kept:
                del kept[key]
            elif key in new:
                del new[key]
            else:
                move(key)
                unranked.pop(key, None)
            lru[key] = now

    def _newest(self, keys: Sequence[BlockKey]) -> bool:
        """Whether ``keys`` are the newest blocks of the LRU order already, in this order, used at
        this request, none unranked: what ``access`` of each would leave. Checked in C: vLLM asks
        for a waiting request every step and a new request's first store touches its hits again,
        with nothing touched in between (9 in 10 keys touched in the 8x4 vLLM 0.25.1 replay)."""
        lru, n = self._lru, len(keys)
        if n > len(lru) or next(reversed(lru)) != keys[-1]:
            return False
        tail = list(itertools.islice(reversed(lru), n))
        tail.reverse()
        if tail != list(keys):
            return False
        used = list(itertools.islice(reversed(lru.values()), n))
        if used.count(self.gauge.requests) != n:
            return False
        return not self._unranked or self._unranked.keys().isdisjoint(keys)

    def remove(self, key: BlockKey) -> None:
        if self._pending:
            self._rank_pending()
        self._unranked.pop(key, None)
        for segment in (self._dead, self._lru, self._kept, self._new):
            if key in segment:
                del segment[key]
                return

    def evict(self, n: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        if self._pending:
            self._rank_pending()
        victims: list[BlockKey] = []
        if n <= 0:
            return victims
        if self._dead:
            _take(self._dead, n, pinned, victims)
        if self._kept or self._new:
            self._take_pressured(n, pinned, victims)
        if len(victims) < n:
            _take(self._lru, n - len(victims), pinned, victims)
        if len(victims) < n and self._kept:
            _take(self._kept, n - len(victims), pinned, victims)
        unranked = self._unranked
        if unranked:
            drain(map(unranked.pop, victims, repeat(None)))
        remember_evicted(self._ghost, victims, self.ghost_capacity)
        return victims

    def coldest(self, n: int) -> list[BlockKey]:
        if self._pending:
            self._rank_pending()
        order = itertools.chain(self._dead, reversed(self._new), self._lru, self._kept)
        return list(itertools.islice(order, n))

    def __len__(self) -> int:
        return len(self._dead) + len(self._lru) + len(self._kept) + len(self._new)

    def admit_store(self, n: int, free: int) -> int:
        """How many of ``n`` new blocks to store when the pool has ``free`` free slots: all of
        them, except under pressure, where only as many as fit in the free slots, the dead
        blocks and the expired ones (the rest would displace conversations that come back).
        Where the stable mode pays (``PressureGauge.pays``: LRU would find next to nothing),
        always; elsewhere only while the pool serves less than the stable shadow predicts (by
        ``GATE_HOLD``): on the bundled trace with hints 4 requests late at 300 blocks, refusing
        when the pool already served as much fell below LRU (0.02548 against 0.02554; with the
        bound 0.02571). In vLLM the bound let the stores of the requests in flight, about as
        many blocks as the pool holds, evict the conversations held whenever the pool did well.
        """
        if self._pending:
            self._rank_pending()
        if not self.pressure or n <= free + len(self._dead):
            return n
        gauge = self.gauge
        if not gauge.pays() and gauge.served * GATE_HOLD >= gauge.stable_served:
            return n
        room = free + len(self._dead)
        for segment, expiry in self._expiring():
            for used in segment.values():
                if used > expiry or room >= n:
                    break
                room += 1
        return min(n, room)

    # -- hints ----------------------------------------------------------------------------------

    def on_request(self, keys: Sequence[BlockKey], hint: RequestHint) -> None:
        if self._pending:
            self._rank_pending()
        self._rank_request(keys, hint)
        if not keys:
            return
        gauge = self.gauge
        # What the pool found, not the engine's own cache in front of it (vLLM's GPU prefix
        # cache): counted in, its hits held the stable mode off in the engine for most of a
        # run that the stable mode would have served (docs/policies.md).
        gauge.request(keys[0], len(keys), min(hint.served_blocks, len(keys)))
        if gauge.on != self.pressure:
            self._switch(gauge.on)
        if self.pressure:
            self._file(keys, min(hint.hit_blocks, len(keys)))
            if gauge.turns.finishing():
                self._finish(keys)
        else:
            self._prefix_last(keys)

    def _prefix_last(self, keys: Sequence[BlockKey]) -> None:
        """Touch the request's blocks again deepest first, so that LRU evicts its tail before its
        prefix; only while they are the most recent blocks (no other request's block stored
        since): a late hint must not make old blocks recent (at 300 blocks with hints 4
        requests late that cost 0.003 of hit ratio, below LRU)."""
        lru = self._lru
        if not lru or next(reversed(lru)) not in keys:
            return
        move = lru.move_to_end
        for key in reversed(keys):
            if key in lru:
                move(key)

    def _rank_request(self, keys: Sequence[BlockKey], hint: RequestHint) -> None:
        """Rank the blocks the request computed by their class (the dead segment)."""
        rates = self.rates
        rates.seen(keys)
        self._hints_seen = True
        n = len(keys)
        first = min(hint.hit_blocks, n)
        unranked = self._unranked
        if unranked:
            # Blocks the request found (hits, promotions) were not computed by it: not ranked
            # (in C: a request's hits are hundreds).
            drain(map(unranked.pop, keys[:first], repeat(None)))
        if first >= n:
            return
        start = first_class(hint)
        mean = rates.mean()
        lru, dead, early, ghost = self._lru, self._dead, self._early, self._ghost
        # What ``_rank`` decides, per class, until a followed block changes the rates: a call and
        # a rate per block were most of a finished request's time on the scheduler thread.
        deep, tail = block_class(start, POSITIONS - 1), n - POSITIONS + 1
        demoted: dict[int, bool] = {}
        for i in range(first, n):
            key = keys[i]
            cls = deep if i < tail else block_class(start, n - 1 - i)
            if key in unranked:
                del unranked[key]
                # ``follow`` skips an unsampled key (3 in 4): not called for one.
                if key and not key[-1] % SAMPLE and rates.follow(key, cls):
                    demoted.clear()
                verdict = demoted.get(cls)
                if verdict is None:
                    verdict = mean > 0.0 and rates.rate(cls, mean) < DEMOTE_RATIO * mean
                    demoted[cls] = verdict
                if verdict:
                    del lru[key]
                    dead[key] = None
            elif not (key in lru or key in dead or key in ghost):
                # Not stored yet (in flight): ranked when it is stored. Not a key evicted before
                # (its reuse would be its second use).
                early[key] = cls
                if len(early) > self.capacity:
                    early.popitem(last=False)

    # -- under pressure -------------------------------------------------------------------------

    def _file(self, keys: Sequence[BlockKey], found: int) -> None:
        """The request's blocks in the LRU order (or kept) to kept (its hit run, deepest first:
        oldest) and new (the rest, in order: the deepest goes first)."""
        lru, kept, new, now = self._lru, self._kept, self._new, self.gauge.requests
        unranked = self._unranked
        for key in reversed(keys[:found]):
            if key in lru:
                del lru[key]
                unranked.pop(key, None)
            elif key in kept:
                del kept[key]
            else:
                continue
            kept[key] = now
        for key in keys[found:]:
            if key in lru:
                del lru[key]
                unranked.pop(key, None)
                new[key] = now

    def _expiring(self) -> list[tuple[OrderedDict[BlockKey, int], float]]:
        """Under pressure, the segments whose oldest blocks expire, each with its expiry (blocks
        last stored or used at or before it have expired): kept and new after ``EXPIRY_GAPS``
        mean gaps, the LRU order after ``LRU_EXPIRY_GAPS``."""
        gauge = self.gauge
        out = [(self._kept, gauge.expiry()), (self._new, gauge.expiry())]
        if gauge.mean_gap:
            out.append((self._lru, gauge.requests - LRU_EXPIRY_GAPS * gauge.mean_gap))
        return out

    def _finish(self, keys: Sequence[BlockKey]) -> None:
        """The request is predicted to be its conversation's last (``turns.py``): its blocks
        stop holding the pool (to the dead segment) instead of waiting a mean gap to expire."""
        kept, new, dead = self._kept, self._new, self._dead
        for key in reversed(keys):  # deepest first, evicted first
            if key in kept:
                del kept[key]
            elif key in new:
                del new[key]
            else:
                continue
            dead[key] = None

    def _take_pressured(self, n: int, pinned: Container[BlockKey], victims: list[BlockKey]) -> None:
        """Expired blocks (kept, new, the LRU order), oldest first, then new blocks, newest
        first."""
        # In C, not a loop per key: the newest blocks are those an fs tier's write-through still
        # pins, and a Python loop stepping over them took 6.6 ms per eviction of the scheduler's
        # step, 0.4 ms in C (scheduler_step_bench.py --fs, 6,000 slots of 256 KiB).
        for segment, expiry in self._expiring():
            need = n - len(victims)
            if need <= 0:
                return
            # Each segment is in order of last use: its expired blocks are a prefix of it.
            ages = takewhile(float(expiry).__ge__, segment.values())
            expired = map(itemgetter(0), zip(segment, ages, strict=False))  # ends with ages
            unpinned = list(islice(filterfalse(pinned.__contains__, expired), need))
            take_keys(segment, unpinned, victims)
        need = n - len(victims)
        if need > 0 and self._new:
            take_keys(self._new, oldest_unpinned(reversed(self._new), need, pinned), victims)

    def _switch(self, on: bool) -> None:
        self.pressure = on
        if not on and (self._kept or self._new):
            # Back to one LRU order: blocks filed under pressure are older than those in it. New
            # blocks by request, oldest first, each request's deepest first (they were filed
            # first to last: evicted newest first, as the LRU order does deepest first).
            new = sorted(reversed(self._new.items()), key=itemgetter(1))
            parts = (new, self._kept.items(), self._lru.items())
            self._lru = OrderedDict(itertools.chain.from_iterable(parts))
            self._kept.clear()
            self._new.clear()

    def _rank_pending(self) -> None:
        """Rank the keys hinted before their store and stored since the last call
        (``_pending``) in their requests' order. The manager stores a run deepest first, and
        ranked as they came, a class whose rate fell below the mark halfway through a run (each
        followed block lowers it) had the run's leading blocks demoted, which left its deeper
        blocks useless (``pressure_bench``, 8 in flight at 2 GiB: 0.306 of hit ratio, 0.321
        ranked in order)."""
        lru, rates = self._lru, self.rates
        for key, cls in reversed(self._pending):
            if key in lru:
                self._rank(key, cls, rates.mean())
        self._pending.clear()

    def _rank(self, key: BlockKey, cls: int, mean: float) -> None:
        """A new block of class ``cls``, in ``_lru``: to the dead segment if its class is."""
        rates = self.rates
        rates.follow(key, cls)
        if mean > 0.0 and rates.rate(cls, mean) < DEMOTE_RATIO * mean:
            del self._lru[key]
            self._dead[key] = None

    def reuse_rate(self, hint: RequestHint, from_end: int) -> float:
        """The learned reuse rate of a new block ``from_end`` blocks before the end of a request
        like ``hint`` describes (for tests and reports)."""
        if self._pending:
            self._rank_pending()
        return self.rates.rate(block_class(first_class(hint), from_end), self.rates.mean())
