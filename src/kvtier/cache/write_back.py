"""Write-on-evict bookkeeping for ``TieredCache``: which visible blocks the write-on-evict tiers do
not have yet (dirty), which of them to copy ahead of their eviction, and the pause after failed
copies. The cache submits the copies; this module only decides which keys and when."""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Sequence

from kvtier.cache.retry import Backoff
from kvtier.keys import BlockKey

log = logging.getLogger(__name__)

WRITEBACK_RETRY_MIN_S = 0.05
"""First pause of write-back after a failed copy to a write-on-evict tier; it doubles per failure
up to ``job_timeout_s`` (a tier that rejects every copy at once must not be retried every step)."""


class WriteBack:
    """Dirty keys and the write-back window of the write-on-evict tiers ``tiers`` (tier indices).
    Without such tiers nothing is ever dirty and every method is a no-op."""

    __slots__ = ("_clock", "_dirty", "_pause", "copying", "tiers", "window")

    def __init__(
        self, tiers: list[int], window: int, max_pause_s: float, clock: Callable[[], float]
    ) -> None:
        self.tiers = tiers
        self.window = window if tiers else 0
        """How many of the coldest blocks ``take_coldest`` looks at (0: no early copies), and
        how many early copies may be in flight at once."""
        self.copying = 0
        """Pins of early copies in flight (a key copied to two tiers counts twice)."""
        self._dirty: set[BlockKey] = set()
        """Visible keys not yet copied to the write-on-evict tiers."""
        self._pause = Backoff(WRITEBACK_RETRY_MIN_S, max_pause_s)
        self._clock = clock

    def stored(self, keys: list[BlockKey]) -> None:
        """Keys became visible in the pool: the write-on-evict tiers do not have them yet."""
        if self.tiers:
            self._dirty.update(keys)

    def take_evicted(
        self, keys: list[BlockKey], slots: list[int]
    ) -> tuple[list[BlockKey], list[int]]:
        """The dirty ones among evicted ``keys`` and their slots, no longer dirty: the caller
        copies them now, holding their slots until the copies ended."""
        dirty = self._dirty
        if not dirty:
            return [], []
        pairs = [(k, s) for k, s in zip(keys, slots, strict=True) if k in dirty]
        dirty.difference_update(k for k, _ in pairs)
        return [k for k, _ in pairs], [s for _, s in pairs]

    def due(self) -> bool:
        """Whether ``take_coldest`` is worth calling this step (not paused after failures, room
        for more early copies)."""
        return bool(self._dirty) and self.copying < self.window and self._pause.ready(self._clock())

    def take_coldest(self, coldest: Callable[[int], Sequence[BlockKey]]) -> list[BlockKey]:
        """The dirty ones among the ``window`` coldest keys (``coldest(window)``, the policy's),
        no longer dirty: the caller copies them ahead of their eviction.

        Blocks never change once stored, so an early copy is never stale; it lets the eviction
        of a clean block free its slot at once instead of holding it until a copy finished.

        At most as many as the window has room for besides the copies in flight: a policy's
        coldest blocks can change every step (``hinted`` under pressure evicts the newest
        unproven blocks first), and with a tier slower than the stores, copies of each step's
        coldest blocks would pile up as pins the pool cannot evict.
        """
        room = self.window - self.copying
        if room <= 0:
            return []
        dirty = self._dirty
        candidates = [k for k in coldest(self.window) if k in dirty][:room]
        dirty.difference_update(candidates)
        return candidates

    def started(self, pins: int) -> None:
        """An early copy pinned ``pins`` keys (``settle`` gives them back)."""
        self.copying += pins

    def settles(self, tier_index: int, holds_slots: bool) -> bool:
        """Whether a finished write job of ``tier_index`` was a write-back copy (of visible keys:
        copies of evicted keys hold their slots)."""
        return not holds_slots and self.window > 0 and tier_index in self.tiers

    def settle(
        self,
        tier_name: str,
        keys: list[BlockKey],
        ok: list[bool],
        visible: Container[BlockKey],
    ) -> None:
        """A write-back copy ended: failed keys still ``visible`` are dirty again, and write-back
        pauses (doubling per failure, up to ``job_timeout_s``) so that a tier failing every copy
        at once is not retried every step (a busy loop for whoever steps until jobs end)."""
        self.copying -= len(keys)
        if all(ok):
            self._pause.succeeded()
            return
        self._dirty.update(k for k, k_ok in zip(keys, ok, strict=True) if not k_ok and k in visible)
        if self._pause.failed(self._clock()):
            log.warning(
                "tier %s: %d of %d block copies failed; write-back paused (retried after %g s, "
                "then less often while copies fail)",
                tier_name,
                len(ok) - sum(ok),
                len(ok),
                self._pause.delay,
            )
