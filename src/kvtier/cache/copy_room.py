"""How much of the pool copies to secondary tiers may hold at once, and the blocks to write
through that wait for room. ``TieredCache`` submits the copies and counts what is left out; this
module only decides how many and which."""

from __future__ import annotations

from itertools import islice

from kvtier.keys import BlockKey

COPY_SHARE = 0.5
"""Fraction of the pool that copies to secondary tiers may hold at once: blocks written through
stay pinned, evicted blocks keep their slots, until their copy ended (a block copied to two
tiers counts twice; the early copies of ``pool.writeback_window`` have their own bound). With a
tier slower than the stores (a disk another engine saturates) copies piled up until the
engine's stores found no room: the pool, not only the tier, stopped serving. Beyond it a block
to write through waits, unpinned, in the order stored, for a later step's room, and is not
copied if the pool evicts it first; an evicted block is not copied."""


LAG_S = 3.0
"""Keys waiting for room this long (the tier lags the stores): the limit halves, down to an
eighth of ``COPY_SHARE``'s; without a wait it grows back by an eighth a second."""


class CopyRoom:
    """The copies in flight under ``limit`` and, per tier, the keys waiting to be written
    through (always visible in the pool: ``evicted`` drops them)."""

    __slots__ = (
        "_calm_since",
        "_ceiling",
        "_through",
        "_waiting",
        "_waiting_since",
        "held",
        "limit",
    )

    def __init__(self, limit: int, through: list[int]) -> None:
        self.limit = limit
        self._ceiling = limit
        """``limit`` while the tier keeps up (``adapt``)."""
        self._waiting_since: float | None = None
        self._calm_since: float | None = None
        self.held = 0
        """Blocks held by copies in flight."""
        self._through = through
        """The write-through tiers (the only ones whose keys wait)."""
        self._waiting: dict[int, dict[BlockKey, None]] = {i: {} for i in through}

    def counts(self, tier_index: int, holds_slots: bool) -> bool:
        """Whether a copy to ``tier_index`` counts here: all but the early write-back copies
        (visible blocks copied to a write-on-evict tier, bounded by their window)."""
        return holds_slots or tier_index in self._through

    def admits(self, n: int) -> bool:
        """Whether copies of ``n`` more blocks would start at once."""
        return self.held + n <= self.limit

    def take(self, tier_index: int, keys: list[BlockKey], through: bool) -> tuple[int, int]:
        """How many of the leading ``keys`` a copy to ``tier_index`` starts with now (held until
        ``ended``), and how many it leaves out: beyond the room, keys to write through
        (``through``) wait instead, evicted ones are left out."""
        n = min(max(0, self.limit - self.held), len(keys))
        left_out = 0
        if n < len(keys):
            if through:
                self._waiting[tier_index].update(dict.fromkeys(keys[n:]))
            else:
                left_out = len(keys) - n
        self.held += n
        return n, left_out

    def started(self, n: int) -> None:
        """A copy of ``n`` blocks started outside ``take`` (unbounded: the shared pool's)."""
        self.held += n

    def ended(self, n: int) -> None:
        """A copy that held ``n`` blocks ended."""
        self.held -= n

    def adapt(self, now: float) -> None:
        """Follow the tier: halve the limit while keys wait ``LAG_S`` and more (copies in flight
        pin the pool for nothing while the tier lags: its threads write a few blocks at a
        time), grow it back while none wait."""
        if any(self._waiting.values()):
            self._calm_since = None
            if self._waiting_since is None:
                self._waiting_since = now
            elif now - self._waiting_since >= LAG_S:
                self.limit = max(self._ceiling // 8, self.limit // 2, 1)
                self._waiting_since = now
            return
        self._waiting_since = None
        if self.limit >= self._ceiling:
            return
        if self._calm_since is None:
            self._calm_since = now
            return
        grow = int(self._ceiling * (now - self._calm_since) / 8)
        if grow:
            self.limit = min(self._ceiling, self.limit + grow)
            self._calm_since = now

    def due(self, now: float) -> list[int]:
        """The tiers with keys waiting, while there is room for some (the limit ``adapt``-ed
        to ``now`` first)."""
        self.adapt(now)
        if self.held >= self.limit:
            return []
        return [i for i, waiting in self._waiting.items() if waiting]

    def take_waiting(self, tier_index: int) -> list[BlockKey]:
        """The keys that waited longest for ``tier_index``, as many as there is room for, no
        longer waiting (the caller copies them)."""
        waiting = self._waiting[tier_index]
        keys = list(islice(waiting, max(0, self.limit - self.held)))
        for key in keys:
            del waiting[key]
        return keys

    def evicted(self, keys: list[BlockKey]) -> int:
        """Keys left the pool: those waiting are dropped uncopied (returned: how many)."""
        dropped = 0
        for waiting in self._waiting.values():
            for key in keys if waiting else ():
                if key in waiting:
                    del waiting[key]
                    dropped += 1
        return dropped

    def drop_waiting(self) -> int:
        """Forget every waiting key (the tiers close); returns how many there were."""
        dropped = sum(map(len, self._waiting.values()))
        for waiting in self._waiting.values():
            waiting.clear()
        return dropped
