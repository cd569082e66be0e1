"""Admission: store a block only once it was offered ``min_seen`` times.

One-off prefixes then never displace blocks that are reused. Counts live in a bounded LRU map so a
stream of unique keys cannot grow memory without limit.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.keys import BlockKey


class AdmissionFilter:
    def __init__(self, min_seen: int, max_tracked: int = 1_000_000) -> None:
        if min_seen < 1 or max_tracked < 1:
            raise ValueError("min_seen and max_tracked must be >= 1")
        self.min_seen = min_seen
        self.max_tracked = max_tracked
        self._seen: OrderedDict[BlockKey, int] = OrderedDict()

    def admit(self, key: BlockKey) -> bool:
        """Count one offer of ``key``; True when this offer reaches ``min_seen``."""
        seen = self._seen
        count = seen.pop(key, 0) + 1
        if count >= self.min_seen:
            return True
        seen[key] = count
        if len(seen) > self.max_tracked:
            seen.popitem(last=False)
        return False
