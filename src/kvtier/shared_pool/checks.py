"""Invariants of a shared index, checked by tests and the chaos run (under the index lock, from
``SharedIndex.check_invariants``). Walks every slot and table entry: not for the hot path."""

from __future__ import annotations

import numpy as np

from kvtier.shared_pool import layout as lay
from kvtier.shared_pool.layout import IndexArrays


def check(
    a: IndexArrays,
    alive: list[int],
    settled: bool,
    live: tuple[int, ...] = (lay.WRITING, lay.VISIBLE),
    owned: tuple[int, ...] = (lay.WRITING,),
) -> None:
    """Raise ``AssertionError`` naming the first broken invariant.

    Every slot is free (on the free stack exactly once) or indexed (one table entry whose key is
    the slot's); pins are on visible slots only and only of live engines; a slot being written
    belongs to a live engine; no registered engine is dead (``alive``: the live registered ones).
    ``settled``: no engine loads or stores any more, so no pin and no reservation is left.
    ``live``: the states that hold a key; ``owned``: those that belong to one engine (``writer``).
    """
    n = a.layout.num_slots
    state = a.state
    known = np.isin(state, (lay.FREE, *live))
    _require(bool(known.all()), "a slot in no known state")
    top = int(a.header[lay.H_FREE_TOP])
    _require(0 <= top <= n, f"free stack height {top} of {n}")
    stack = a.free[:top]
    _require(len(np.unique(stack)) == top, "a slot is on the free stack twice")
    free = set(np.flatnonzero(state == lay.FREE).tolist())
    _require(set(stack.tolist()) == free, "the free stack is not the set of free slots (leak)")
    ts = a.table_slots
    entries = np.flatnonzero(ts >= 0)
    _require(len(entries) == int(a.header[lay.H_LIVE]), "live entry count is off")
    tombs = int(np.count_nonzero(ts == lay.TOMB))
    _require(tombs == int(a.header[lay.H_TOMBS]), "tombstones are off")
    indexed = ts[entries]
    _require(len(np.unique(indexed)) == len(indexed), "two table entries point at one slot")
    used = np.flatnonzero(state != lay.FREE)
    _require(set(indexed.tolist()) == set(used.tolist()), "an entry points at a free slot or a "
             "used slot has no entry")  # fmt: skip
    _require(bool((a.table_keys[entries] == a.slot_keys[indexed]).all()), "an entry's key differs")
    pinned = np.flatnonzero(a.pins)
    _require(bool((state[pinned] == lay.VISIBLE).all()), "a pin on a slot that is not visible")
    live_mask = 0
    for e in alive:
        live_mask |= 1 << e
    stray = np.bitwise_or.reduce(a.pins) if len(a.pins) else np.uint64(0)
    _require(int(stray) & ~live_mask == 0, "a pin held by an engine that is gone")
    writing = np.flatnonzero(np.isin(state, owned))
    _require(bool(np.isin(a.writer[writing], alive).all()), "a slot held by a dead engine")
    registered = set(np.flatnonzero(a.engines[:, lay.E_REGISTERED]).tolist())
    _require(registered == set(alive), "a dead engine is still registered")
    if settled:
        _require(not pinned.size, f"{pinned.size} slots still pinned")
        _require(not writing.size, f"{writing.size} slots still being written")


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"shared index invariant broken: {what}")
