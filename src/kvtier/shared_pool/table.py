"""The shared key -> slot table: open addressing with linear probing, deletion by backward shift.

Changed only under the index lock; read without it (``find_many``). A reader racing a change may
miss a key or see an entry whose slot was reused since: every answer is checked against the slot's
own state and key, and a pin re-checks under the lock, so a race costs a miss, never a wrong block.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtier.keys import BlockKey
from kvtier.shared_pool.layout import (
    EMPTY,
    FREE,
    H_LIVE,
    H_TOMBS,
    TOMB,
    VISIBLE,
    WRITING,
    IndexArrays,
)


def keys_array(keys: Sequence[BlockKey]) -> np.ndarray:
    """``(n, 2)`` uint64 words of 16-byte keys."""
    return np.frombuffer(b"".join(keys), dtype=np.uint64).reshape(len(keys), 2)


def key_words(key: BlockKey) -> tuple[int, int]:
    return int.from_bytes(key[:8], "little"), int.from_bytes(key[8:16], "little")


def find_many(a: IndexArrays, k: np.ndarray) -> np.ndarray:
    """Per key of ``k`` (``keys_array``): the slot whose key and state (written or being written)
    match, else -1. Lock-free; one vectorised probe round per step of the longest chain. The
    probe compares the keys' first words only; the slot's own key, compared whole at the end,
    decides."""
    n = len(k)
    out = np.full(n, -1, dtype=np.int64)
    if n == 0:
        return out
    k0 = k[:, 0]
    at = (k0 & np.uint64(a.mask)).astype(np.int64)
    active = np.arange(n)
    tk0, ts = a.table_keys[:, 0], a.table_slots
    for _ in range(a.layout.capacity):
        s = ts[at]
        hit = (tk0[at] == k0) & (s >= 0)
        out[active[hit]] = s[hit]
        more = ~hit & (s != EMPTY)
        if not more.any():
            break
        active, k0, at = active[more], k0[more], (at[more] + 1) & a.mask
    found = np.flatnonzero(out >= 0)
    slots = out[found]
    ok = (a.state[slots] != FREE) & (a.slot_keys[slots] == k[found]).all(axis=1)
    out[found[~ok]] = -1
    return out


def visible(a: IndexArrays, k: np.ndarray) -> np.ndarray:
    """Per key: its slot when its block is visible, else -1 (lock-free)."""
    slots = find_many(a, k)
    found = slots >= 0
    slots[np.flatnonzero(found)[a.state[slots[found]] != VISIBLE]] = -1
    return slots


def leading(found: np.ndarray) -> int:
    """How many leading entries of ``found`` (slots, -1 for none) are found."""
    misses = np.flatnonzero(found < 0)
    return int(misses[0]) if misses.size else len(found)


def find_one(a: IndexArrays, k0: int, k1: int) -> tuple[int, int]:
    """(table position, slot) of a key, or (-1, -1). Under the lock."""
    ts, tk, mask = a.table_slots, a.table_keys, a.mask
    pos = k0 & mask
    for _ in range(a.layout.capacity):
        s = int(ts[pos])
        if s == EMPTY:
            return -1, -1
        if s >= 0 and int(tk[pos, 0]) == k0 and int(tk[pos, 1]) == k1:
            return pos, s
        pos = (pos + 1) & mask
    return -1, -1


def insert(a: IndexArrays, k0: int, k1: int, slot: int) -> None:
    """Add a key known to be absent. Under the lock; the key words go first, the slot last."""
    ts, tk, mask, h = a.table_slots, a.table_keys, a.mask, a.header
    pos = k0 & mask
    while True:
        s = int(ts[pos])
        if s < 0:
            tk[pos, 0], tk[pos, 1] = k0, k1
            ts[pos] = slot
            if s == TOMB:
                h[H_TOMBS] -= 1
            h[H_LIVE] += 1
            return
        pos = (pos + 1) & mask


def remove_at(a: IndexArrays, pos: int) -> None:
    """Delete the entry at ``pos`` by shifting later entries of its probe run back into the hole
    (no tombstones: the table never fills with them, and never needs rebuilding under the lock).
    A lock-free reader racing a shift may miss the entry moved: a miss, never a wrong slot."""
    ts, tk, mask = a.table_slots, a.table_keys, a.mask
    hole = pos
    j = pos
    while True:
        j = (j + 1) & mask
        s = int(ts[j])
        if s == EMPTY:
            break
        home = int(tk[j, 0]) & mask
        # The entry at j may fill the hole unless its home lies cyclically in (hole, j].
        if (hole < j and hole < home <= j) or (j < hole and (home > hole or home <= j)):
            continue
        tk[hole, 0], tk[hole, 1] = tk[j, 0], tk[j, 1]
        ts[hole] = s
        hole = j
    ts[hole] = EMPTY
    a.header[H_LIVE] -= 1


def remove_slot_key(a: IndexArrays, slot: int) -> None:
    """Drop the table entry of ``slot``'s key, if it points at that slot."""
    k0, k1 = int(a.slot_keys[slot, 0]), int(a.slot_keys[slot, 1])
    pos, found = find_one(a, k0, k1)
    if pos >= 0 and found == slot:
        remove_at(a, pos)


def rebuild(a: IndexArrays, live: Sequence[int] = (VISIBLE, WRITING)) -> None:
    """Refill the table from the keys of the slots in a ``live`` state (their state is the
    truth): after a holder died inside the lock. A key held by two slots keeps the first; the
    other slot is freed unless it is pinned (then it stays out of the table until unpinned)."""
    a.table_slots[:] = EMPTY
    a.header[H_LIVE] = 0
    a.header[H_TOMBS] = 0
    for slot in np.flatnonzero(np.isin(a.state, live)).tolist():
        k0, k1 = int(a.slot_keys[slot, 0]), int(a.slot_keys[slot, 1])
        if find_one(a, k0, k1)[0] >= 0:
            if int(a.pins[slot]) == 0:
                a.state[slot] = FREE
            continue
        insert(a, k0, k1, slot)
