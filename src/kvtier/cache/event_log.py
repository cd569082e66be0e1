"""A bounded log of cache events, for consumers that call ``take()`` now and then."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvtier.events import CacheEvent, EventKind
from kvtier.keys import BlockKey

MAX_EVENTS = 65_536
"""Events kept until taken; older ones are dropped so that nobody consuming them costs memory
without bound (about 210 bytes per event)."""


class EventLog:
    def __init__(self, max_events: int = MAX_EVENTS) -> None:
        self._events: deque[CacheEvent] = deque(maxlen=max_events)
        self._max = max_events
        self.dropped = 0
        """Events dropped, oldest first, because nobody took them in time."""

    def add(self, kind: EventKind, keys: Sequence[BlockKey], tier: str) -> None:
        overflow = len(self._events) + len(keys) - self._max
        if overflow > 0:
            self.dropped += overflow  # the deque drops the oldest
        self._events.extend(CacheEvent(kind, key, tier) for key in keys)

    def take(self) -> list[CacheEvent]:
        """Events since the last call, oldest first."""
        events = list(self._events)
        self._events.clear()
        return events
