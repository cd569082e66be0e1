"""When to try again after a tier failed: per (tier, key) for promotions, per cache for
write-back, per tier for writes a tier refuses."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from kvtier.keys import BlockKey
from kvtier.tiers.base import Tier

log = logging.getLogger(__name__)

PROMOTION_RETRY_S = 30.0
MAX_FAILED_PROMOTIONS = 100_000
REFUSED_WRITES_PAUSE_S = (0.5, 30.0)


class FailedPromotions:
    """(tier, key) pairs whose promotion failed, not retried from that tier for ``retry_s``: a tier
    that keeps claiming a block it cannot deliver must not defer a request forever. Other tiers
    holding the key are still tried (a flaky fast tier must not hide a good slow one). At most
    ``max_entries`` are remembered, oldest forgotten first."""

    def __init__(
        self, retry_s: float = PROMOTION_RETRY_S, max_entries: int = MAX_FAILED_PROMOTIONS
    ) -> None:
        self._until: OrderedDict[tuple[int, BlockKey], float] = OrderedDict()
        self._retry_s = retry_s
        self._max = max_entries

    def __bool__(self) -> bool:
        return bool(self._until)

    def __contains__(self, pair: tuple[int, BlockKey]) -> bool:
        return pair in self._until

    def remember(self, tier_index: int, key: BlockKey, now: float) -> None:
        until = self._until
        until[tier_index, key] = now + self._retry_s
        until.move_to_end((tier_index, key))
        if len(until) > self._max:
            until.popitem(last=False)

    def expire(self, now: float) -> None:
        until = self._until
        while until:
            pair, deadline = next(iter(until.items()))
            if deadline > now:
                break
            del until[pair]


class Backoff:
    """A pause that starts at ``first_s`` after a failure, doubles per further failure up to
    ``max_s``, and ends with the first success."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.delay = 0.0
        self._until = 0.0

    def ready(self, now: float) -> bool:
        return self.delay == 0.0 or now >= self._until

    def succeeded(self) -> None:
        self.delay = 0.0

    def failed(self, now: float) -> bool:
        """Pause longer; True on the first failure after a success (worth a warning)."""
        first = self.delay == 0.0
        self.delay = min(max(2 * self.delay, self.first_s), self.max_s)
        self._until = now + self.delay
        return first


class RefusedWrites:
    """Tiers that rejected every block of a write (no room: a full disk or server): writes to such
    a tier pause, from 0.5 s doubling to 30 s, until a write stores something again, so a tier
    without room costs no time per request (reads go on)."""

    def __init__(self, tiers: Sequence[Tier]) -> None:
        self._tiers = tiers
        first, most = REFUSED_WRITES_PAUSE_S
        self._pauses = [Backoff(first, most) for _ in tiers]
        self._rejected = [0] * len(tiers)

    def paused(self, tier_index: int, now: float) -> bool:
        return not self._pauses[tier_index].ready(now)

    def ended(self, tier_index: int, ok: Sequence[bool], now: float) -> None:
        """A write job of the tier ended (``ok`` per block)."""
        rejected = self._tiers[tier_index].counters.rejected
        grew = rejected > self._rejected[tier_index]
        self._rejected[tier_index] = rejected
        pause = self._pauses[tier_index]
        if any(ok):
            if pause.delay:
                log.warning("tier %s stores blocks again", self._tiers[tier_index].name)
            pause.succeeded()
        elif grew and pause.failed(now):
            log.warning("tier %s has no room: writes to it pause", self._tiers[tier_index].name)
