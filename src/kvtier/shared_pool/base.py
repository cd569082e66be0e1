"""What every index that several engines share in one file has: the index lock and its repair,
the engines' table (registration, liveness, reaping the dead), lock-free lookups and the free stack.

Two indexes are built on it: the shared pool's block index (``index.SharedIndex``: slots of host
memory) and the fs tier's shared accounting (``kvtier.tiers.fs.share_index``: one entry per block
file). Each says what a dead engine leaves and how to release it (``_reclaim``) and which slot
states are in the table (``LIVE_STATES``).

Everything that changes the index holds the index lock (``locks.Mutex``, never longer than
``lock_timeout_s`` to get: the caller treats a timeout as a miss or tries later) and does no I/O
under it. The holder marks the index dirty while it changes it; a holder killed inside leaves the
mark, and the next holder rebuilds the table and the free stack from the slots' own states before
doing anything else. An engine is alive while it holds its engine lock (``locks``): the kernel
drops it when the process dies, and any engine that finds a registered engine without its lock
releases what that engine held (``reap_dead``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np

from kvtier.errors import PoolError
from kvtier.keys import BlockKey
from kvtier.shared_pool import locks, table
from kvtier.shared_pool.layout import (
    E_PID,
    E_QUOTA,
    E_REGISTERED,
    FREE,
    H_DIRTY,
    H_FREE_TOP,
    H_REPAIRS,
    MAX_ENGINES,
    VISIBLE,
    WRITING,
    IndexArrays,
)

REAP_INTERVAL_S = 0.25
REGISTER_TIMEOUT_S = 5.0


class LockedIndex(ABC):
    """One engine's handle on an index in a shared file (registered as engine ``me``)."""

    LIVE_STATES: tuple[int, ...] = (WRITING, VISIBLE)
    """Slot states that hold a key (in the table); any other state but ``FREE`` is repaired to
    ``FREE``."""

    def __init__(
        self,
        fd: int,
        mapping: mmap.mmap,
        arrays: IndexArrays,
        lock_timeout_s: float,
        quota_slots: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fd = fd
        self._mapping = mapping
        self.a = arrays
        self.num_slots = arrays.layout.num_slots
        self.lock_timeout_s = lock_timeout_s
        self._mutex = locks.Mutex(fd)
        self._clock = clock
        self._last_reap = 0.0
        self.lock_timeouts = 0
        """Index operations given up because another engine held the lock too long."""
        self.me = -1
        self._setup()
        self._register(quota_slots)

    @abstractmethod
    def _setup(self) -> None:
        """This engine's own state that a subclass needs before it registers."""

    # -- lock ------------------------------------------------------------------------------------

    def _enter(self, timeout_s: float | None = None) -> bool:
        if not self._mutex.acquire(self.lock_timeout_s if timeout_s is None else timeout_s):
            self.lock_timeouts += 1
            return False
        h = self.a.header
        if h[H_DIRTY]:
            self._repair()
        h[H_DIRTY] = 1
        return True

    def _leave(self) -> None:
        self.a.header[H_DIRTY] = 0
        self._mutex.release()

    def _repair(self) -> None:
        """Rebuild what a holder killed inside the lock may have left half changed."""
        a = self.a
        a.header[H_REPAIRS] += 1
        a.state[~np.isin(a.state, (FREE, *self.LIVE_STATES))] = FREE
        table.rebuild(a, self.LIVE_STATES)
        free = np.flatnonzero(a.state == FREE)[::-1].astype(np.int32)
        a.free[: len(free)] = free
        a.header[H_FREE_TOP] = len(free)

    # -- engines ---------------------------------------------------------------------------------

    def _register(self, quota_slots: int) -> None:
        if not self._enter(REGISTER_TIMEOUT_S):
            raise PoolError("a shared index stayed locked by another engine for 5 s")
        try:
            for e in range(MAX_ENGINES):
                if locks.try_lock(self._fd, locks.ENGINE_LOCK_BASE + e):
                    self.me = e
                    self._reclaim(e)  # what a dead engine with this number left
                    row = self.a.engines[e]
                    row[:] = 0
                    row[E_REGISTERED], row[E_PID], row[E_QUOTA] = 1, os.getpid(), quota_slots
                    return
        finally:
            self._leave()
        raise PoolError(f"a shared index serves at most {MAX_ENGINES} engines")

    def _alive(self, e: int) -> bool:
        return e == self.me or locks.held_by_another(self._fd, locks.ENGINE_LOCK_BASE + e)

    def alive_engines(self) -> list[int]:
        return [int(e) for e in np.flatnonzero(self.a.engines[:, E_REGISTERED]) if self._alive(e)]

    def reap_dead(self) -> int:
        """Release what engines that died left; returns how many."""
        self._last_reap = self._clock()
        registered = np.flatnonzero(self.a.engines[:, E_REGISTERED]).tolist()
        dead = [e for e in registered if not self._alive(e)]
        if not dead or not self._enter():
            return 0
        try:
            gone = [e for e in dead if self.a.engines[e, E_REGISTERED] and not self._alive(e)]
            for e in gone:
                self._reclaim(e)
                self.a.engines[e, E_REGISTERED] = 0
            return len(gone)
        finally:
            self._leave()

    @abstractmethod
    def _reclaim(self, e: int) -> None:
        """Under the lock: release what engine ``e`` (dead, or this one leaving) holds."""

    def maintain(self) -> None:
        """Once per engine step: reap dead engines now and then."""
        if self._clock() - self._last_reap >= REAP_INTERVAL_S:
            self.reap_dead()

    # -- lock-free reads -------------------------------------------------------------------------

    def leading_hits(self, keys: Sequence[BlockKey]) -> int:
        """How many leading ``keys`` are visible now (no lock; a pin or a read confirms)."""
        if not keys:
            return 0
        return table.leading(table.visible(self.a, table.keys_array(keys)))

    def count_visible(self, k: np.ndarray) -> int:
        """How many keys of ``k`` (``table.keys_array``) are visible: the batch lookup."""
        return int(np.count_nonzero(table.visible(self.a, k) >= 0))

    def touch(self, keys: Sequence[BlockKey]) -> None:
        if keys:
            slots = table.visible(self.a, table.keys_array(keys))
            self.a.last_use[slots[slots >= 0]] = self._clock()

    def used_slots(self) -> int:
        return self.num_slots - int(self.a.header[H_FREE_TOP])

    # -- under the lock --------------------------------------------------------------------------

    def _free_slot(self, slot: int) -> None:
        """Unindex a slot and put it on the free stack (under the lock)."""
        a = self.a
        table.remove_slot_key(a, slot)
        a.state[slot] = FREE
        a.writer[slot] = -1
        top = int(a.header[H_FREE_TOP])
        a.free[top] = slot
        a.header[H_FREE_TOP] = top + 1

    # -- lifetime --------------------------------------------------------------------------------

    def close(self, release: bool = True) -> None:
        """Leave the index. ``release``: what this engine holds is released now (else the others
        reap it once this engine's lock is gone, as a dead engine's)."""
        if self.me < 0:
            return
        if release and self._enter(REGISTER_TIMEOUT_S):
            try:
                self._reclaim(self.me)
                self.a.engines[self.me, E_REGISTERED] = 0
            finally:
                self._leave()
        # Without the lock the others reap it once its engine lock is gone, just below.
        locks.unlock(self._fd, locks.ENGINE_LOCK_BASE + self.me)
        self.me = -1
        del self.a
        with contextlib.suppress(BufferError):
            self._mapping.close()  # a view still alive keeps the mapping until collected
        os.close(self._fd)
