"""The block index several engines share: lookups, pins, reservations, publication, eviction.

The per-slot state in shared memory is the truth (``layout``): ``FREE`` -> ``WRITING`` (reserved
by one engine, its bytes being written, never a hit) -> ``VISIBLE`` (published after the engine's
copy finished) -> ``FREE`` (evicted by whichever engine needed room). A slot's pins are one bit per
engine; the engine keeps its own count per slot and sets or clears its bit at the first pin and
the last unpin. Eviction takes the least recently used visible slots with no pin bit, of a random
sample.

The lock, the engines' table and the lock-free lookups are ``base.LockedIndex``'s. Lookups and
touches read without any lock. Everything that changes the index holds the index lock
(``locks.Mutex``, never longer than ``lock_timeout_s`` to get: a miss otherwise), runs in tens of
microseconds per block and never does I/O or a copy under it. The lock holder marks the index
dirty while it changes it; a holder killed inside leaves the mark, and the next holder rebuilds
the table and the free stack from the slots' states before doing anything else.

An engine is alive while it holds its engine lock (``locks``): the kernel drops it when the
process dies. Any engine finding a registered engine without its lock (``reap_dead``, run at
least every ``REAP_INTERVAL_S`` from ``step``) clears its pin bits and frees the slots it was
writing: a killed engine's pins last until the next engine looks, its half-written blocks were
never visible, and no table entry points at a slot that is handed out again. A stopped engine
(SIGSTOP) keeps its pins and reservations (it may still copy), which costs the others a few slots,
never a wait.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvtier.keys import BlockKey
from kvtier.shared_pool import checks, table
from kvtier.shared_pool.base import REAP_INTERVAL_S, REGISTER_TIMEOUT_S, LockedIndex
from kvtier.shared_pool.layout import (
    E_EVICTIONS,
    E_HITS_OTHERS,
    E_HITS_OWN,
    E_PID,
    E_QUOTA,
    E_REGISTERED,
    E_STORED,
    FREE,
    H_FREE_TOP,
    VISIBLE,
    WRITING,
)

__all__ = ["REAP_INTERVAL_S", "EngineShare", "SharedIndex"]

EVICT_SAMPLE = 16
"""Slots sampled per block to evict (approximate LRU, as in Redis)."""


@dataclass(frozen=True, slots=True)
class EngineShare:
    """One engine's line in a shared pool's table (``SharedIndex.engine_shares``)."""

    engine: int
    pid: int
    alive: bool
    hits_own: int
    """Blocks this engine pinned for a load that it had stored itself."""
    hits_others: int
    """Blocks this engine pinned for a load that another engine had stored."""
    evictions: int
    """Blocks this engine evicted to make room for its stores."""
    stored: int
    held: int
    """Slots holding blocks this engine stored (or is writing) now."""


class SharedIndex(LockedIndex):
    """One engine's handle on a shared index (``segment.open_shared`` builds it)."""

    def _setup(self) -> None:
        self._pin_counts: dict[int, int] = {}
        self._rng = np.random.default_rng()

    def _reclaim(self, e: int) -> None:
        a = self.a
        a.pins &= np.uint64(~(1 << e) & 0xFFFF_FFFF_FFFF_FFFF)
        mine = a.writer == e
        for slot in np.flatnonzero(mine & (a.state == WRITING)).tolist():
            self._free_slot(slot)
        a.writer[mine] = -1
        a.engines[e, E_REGISTERED] = 0

    # -- pins ------------------------------------------------------------------------------------

    def pin(self, keys: Sequence[BlockKey]) -> list[int]:
        """Pin the leading visible ``keys`` for a load; their slots (fewer when one is gone, none
        when the lock could not be had in time)."""
        if not keys or not self._enter():
            return []
        a, counts, me = self.a, self._pin_counts, self.me
        slots: list[int] = []
        try:
            for key in keys:
                slot = table.find_one(a, *table.key_words(key))[1]
                if slot < 0 or a.state[slot] != VISIBLE:
                    break
                slots.append(slot)
                if counts.get(slot, 0) == 0:
                    a.pins[slot] |= np.uint64(1 << me)
                counts[slot] = counts.get(slot, 0) + 1
            if slots:
                a.last_use[slots] = self._clock()
                own = int(np.count_nonzero(a.writer[slots] == me))
                a.engines[me, E_HITS_OWN] += own
                a.engines[me, E_HITS_OTHERS] += len(slots) - own
        finally:
            self._leave()
        return slots

    def unpin(self, slots: Sequence[int]) -> bool:
        """Drop one pin of each slot; False (nothing done) when the lock could not be had: the
        caller tries again later, the pins meanwhile only keep those blocks from eviction."""
        if not slots:
            return True
        if not self._enter():
            return False
        a, counts = self.a, self._pin_counts
        keep = np.uint64(~(1 << self.me) & 0xFFFF_FFFF_FFFF_FFFF)
        try:
            for slot in slots:
                count = counts.get(slot, 0)
                if count <= 1:
                    counts.pop(slot, None)
                    a.pins[slot] &= keep
                else:
                    counts[slot] = count - 1
        finally:
            self._leave()
        return True

    # -- stores ----------------------------------------------------------------------------------

    def reserve(self, keys: Sequence[BlockKey]) -> tuple[list[BlockKey], list[int]]:
        """Slots for the keys no engine holds or writes yet, in order, evicting the least recently
        used unpinned blocks as needed; the leading ones get the slots there are. Each reserved
        slot must be passed to ``publish``."""
        if not keys or not self._enter():
            return [], []
        a, me = self.a, self.me
        todo: list[tuple[BlockKey, int, int]] = []
        try:
            for key in keys:
                k0, k1 = table.key_words(key)
                if table.find_one(a, k0, k1)[1] < 0:
                    todo.append((key, k0, k1))
            slots = self._take_slots(len(todo))
            now = self._clock()
            for (_key, k0, k1), slot in zip(todo, slots, strict=False):
                a.slot_keys[slot, 0], a.slot_keys[slot, 1] = k0, k1
                a.writer[slot] = me
                a.last_use[slot] = now
                a.state[slot] = WRITING
                table.insert(a, k0, k1, slot)
        finally:
            self._leave()
        return [key for key, _, _ in todo[: len(slots)]], slots

    def _take_slots(self, n: int) -> list[int]:
        a = self.a
        top = int(a.header[H_FREE_TOP])
        short = n - top
        if short > 0:
            self._evict(short)
            top = int(a.header[H_FREE_TOP])
        take = min(n, top)
        slots = a.free[top - take : top][::-1].tolist()
        a.header[H_FREE_TOP] = top - take
        return [int(s) for s in slots]

    def _evict(self, n: int) -> None:
        """Free ``n`` visible unpinned slots, the least recently used of a random sample of
        ``EVICT_SAMPLE`` per block (a scan of the whole pool under the lock cost 5 ms at 65,536
        slots; the sample keeps it proportional to ``n``), all of them when the sample has too
        few or would be as large as the pool."""
        a = self.a
        draws = EVICT_SAMPLE * n
        candidates = np.empty(0, dtype=np.int64)
        if draws < self.num_slots:  # else scanned whole: a sample may miss the oldest block
            candidates = self._evictable(np.unique(self._rng.integers(0, self.num_slots, draws)))
        if candidates.size < n:
            candidates = self._evictable(np.arange(self.num_slots))
        if candidates.size > n:
            order = np.argpartition(a.last_use[candidates], n - 1)[:n]
            candidates = candidates[order]
        for slot in candidates.tolist():
            self._free_slot(slot)
        a.engines[self.me, E_EVICTIONS] += len(candidates)

    def _evictable(self, slots: np.ndarray) -> np.ndarray:
        a = self.a
        candidates: np.ndarray = slots[(a.state[slots] == VISIBLE) & (a.pins[slots] == 0)]
        quota = int(a.engines[self.me, E_QUOTA])
        if quota and int(np.count_nonzero(a.writer == self.me)) >= quota:
            own = candidates[a.writer[candidates] == self.me]
            if own.size:  # over its share: its own blocks first
                return np.asarray(own)
        return candidates

    def publish(
        self, slots: Sequence[int], oks: Sequence[bool], pins: Sequence[bool] | None = None
    ) -> bool:
        """Make the reserved slots whose bytes are written visible to every engine, free the
        others; False (nothing done) when the lock could not be had: try again later. ``pins``:
        pin those of the published slots at once (a copy to a tier reads them next)."""
        if not slots:
            return True
        if not self._enter():
            return False
        a, me, counts = self.a, self.me, self._pin_counts
        stored = 0
        try:
            now = self._clock()
            for i, (slot, ok) in enumerate(zip(slots, oks, strict=True)):
                if a.state[slot] != WRITING or a.writer[slot] != me:
                    continue
                if ok:
                    a.last_use[slot] = now
                    a.state[slot] = VISIBLE
                    stored += 1
                    if pins is not None and pins[i]:
                        if counts.get(slot, 0) == 0:
                            a.pins[slot] |= np.uint64(1 << me)
                        counts[slot] = counts.get(slot, 0) + 1
                else:
                    self._free_slot(slot)
            a.engines[me, E_STORED] += stored
        finally:
            self._leave()
        return True

    # -- reports ---------------------------------------------------------------------------------

    def engine_shares(self) -> list[EngineShare]:
        a = self.a
        out: list[EngineShare] = []
        for e in np.flatnonzero(a.engines[:, E_REGISTERED]).tolist():
            row = a.engines[e]
            held = int(np.count_nonzero((a.writer == e) & (a.state != FREE)))
            out.append(
                EngineShare(
                    e,
                    int(row[E_PID]),
                    self._alive(e),
                    int(row[E_HITS_OWN]),
                    int(row[E_HITS_OTHERS]),
                    int(row[E_EVICTIONS]),
                    int(row[E_STORED]),
                    held,
                )
            )
        return out

    def check_invariants(self, settled: bool = False) -> None:
        """Reap dead engines, then raise ``AssertionError`` naming the first broken invariant of
        the shared index (``checks.check``)."""
        self.reap_dead()
        if not self._enter(REGISTER_TIMEOUT_S):
            raise AssertionError("shared index: its lock stayed held for 5 s")
        try:
            checks.check(self.a, self.alive_engines(), settled)
        finally:
            self._leave()

    # -- lifetime --------------------------------------------------------------------------------

    def close(self, release: bool = True) -> None:
        """Leave the pool: this engine's pins and unfinished reservations are released."""
        super().close(release)
        self._pin_counts.clear()
