"""The ``redis`` tier's presence cache: what this process believes the server holds, so that
``lookup`` answers without waiting on the network.

Keys it does not know are answered ``None`` and checked with a pipelined ``EXISTS`` batch off the
manager's thread; each answer is served at least once. Absent keys are remembered for
``negative_cache_s``; present keys until a read finds them gone (or, with a TTL, for
``POSITIVE_TTL_MARGIN`` of it after the last write or read).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

from kvtier.keys import BlockKey

POSITIVE_TTL_MARGIN = 0.9
"""With a TTL, a key written (or read) is believed present for this fraction of the TTL."""


def clock() -> float:
    """Now, on the clock of presence entries."""
    # Offset so that a present entry's expiry is always > 0 (the sign carries presence).
    return time.monotonic() + 1.0


def present_until(ttl_s: float | None, now: float | None = None) -> float:
    """Until when a key just written or read is believed present."""
    if ttl_s is None:
        return math.inf
    return (now if now is not None else clock()) + ttl_s * POSITIVE_TTL_MARGIN


class Presence:
    """What this process believes the server holds: a bounded, thread-safe map.

    An entry is a signed expiry time: ``+t`` present until ``t``, ``-t`` absent until ``t``. Keys
    being checked are ``pending``; answers not yet served by ``answer`` are ``unserved`` and are
    served once even if expired, so a short negative cache can never starve a lookup.
    """

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._entries: dict[BlockKey, float] = {}
        self._pending: set[BlockKey] = set()
        self._unserved: set[BlockKey] = set()

    def answer(
        self, keys: Sequence[BlockKey], now: float
    ) -> tuple[list[bool | None], list[BlockKey]]:
        """Answers for ``keys`` and the unknown keys to check (now marked pending)."""
        out: list[bool | None] = []
        ask: list[BlockKey] = []
        with self._lock:
            entries, pending, unserved = self._entries, self._pending, self._unserved
            for key in keys:
                value = entries.get(key)
                if value is not None:
                    if key in unserved:
                        unserved.discard(key)
                        out.append(value > 0)
                        continue
                    if abs(value) > now:
                        out.append(value > 0)
                        continue
                    del entries[key]
                out.append(None)
                if key not in pending:
                    pending.add(key)
                    ask.append(key)
        return out, ask

    def set(self, key: BlockKey, present: bool, until: float) -> None:
        """A fact learned from our own read, write or delete (wins over pending checks)."""
        with self._lock:
            self._pending.discard(key)
            self._put(key, until if present else -until)

    def resolve(
        self, keys: Sequence[BlockKey], present: Sequence[bool], pos: float, neg: float
    ) -> None:
        """EXISTS answers; keys no longer pending were settled by a read or write meanwhile."""
        with self._lock:
            pending = self._pending
            for key, here in zip(keys, present, strict=True):
                if key in pending:
                    pending.discard(key)
                    self._put(key, pos if here else -neg)
                    self._unserved.add(key)

    def forget(self, keys: Sequence[BlockKey]) -> None:
        """Unknown again (a failed check or write): the next lookup asks the server."""
        with self._lock:
            for key in keys:
                self._pending.discard(key)
                self._entries.pop(key, None)
                self._unserved.discard(key)

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._pending.clear()
            self._unserved.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def _put(self, key: BlockKey, value: float) -> None:
        entries = self._entries
        entries.pop(key, None)  # re-insert at the end: oldest entries are dropped first
        entries[key] = value
        if len(entries) > self._capacity:
            oldest = next(iter(entries))
            del entries[oldest]
            self._unserved.discard(oldest)
