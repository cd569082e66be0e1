"""Reuse rates of new blocks by class, learned online from the traffic (for ``hinted``).

A new block's class is what an engine knows when the request that computed it finished
(``RequestHint``): a bucket of the request's output tokens (by bit length; unknown is its own
bucket), the block's place from the end of the request (last, second to last, other) and whether
the request hit anything. One key in ``SAMPLE`` (by its last byte: keys are hashes, so the sample
is unbiased) is followed in a bounded FIFO map; a later request that contains it counts one reuse
of its class. Counts are halved each time the map has been filled again, so the rates follow a
workload that changes. Nothing about a workload is fixed in advance.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvtier.keys import BlockKey
from kvtier.policies.hints import RequestHint

SAMPLE = 4
"""One key in ``SAMPLE`` is followed: the learning costs a quarter of the memory and time."""
TRACK_FACTOR = 8.0
MIN_FOLLOWED = 65_536
"""The FIFO of followed keys holds ``max(MIN_FOLLOWED, TRACK_FACTOR * capacity / SAMPLE)`` keys
(about 7 MB at the minimum): a reuse is seen if it comes within that many sampled new blocks, for
every class alike. The floor matters for small pools: reuse distances do not shrink with the
pool."""
PRIOR_BLOCKS = 16.0
"""A class's rate is shrunk towards the mean rate by this many blocks' weight: a class seen a few
times stays near the mean instead of swinging with its first outcomes."""
OUTPUT_BUCKETS = 18
"""Output tokens by bit length (0, 1, 2-3, 4-7, ... 65,536 and more) plus one for unknown."""
POSITIONS = 3
CLASSES = OUTPUT_BUCKETS * POSITIONS * 2


def first_class(hint: RequestHint) -> int:
    """The class of a request's last block; the block ``k`` places before it is this plus
    ``2 * min(k, POSITIONS - 1)`` (``block_class``)."""
    output = hint.output_tokens
    bucket = 0 if output is None else 1 + min(output.bit_length(), OUTPUT_BUCKETS - 2)
    return bucket * POSITIONS * 2 + (1 if hint.hit_blocks else 0)


def block_class(first: int, from_end: int) -> int:
    return first + 2 * min(from_end, POSITIONS - 1)


class ReuseRates:
    """Per class: new blocks followed and reuses seen; see the module docstring."""

    def __init__(self, capacity: int) -> None:
        self._followed: OrderedDict[BlockKey, int] = OrderedDict()
        self._limit = max(MIN_FOLLOWED, int(TRACK_FACTOR * capacity / SAMPLE))
        self._since_halving = 0
        self._inserted = [0.0] * CLASSES
        self._reused = [0.0] * CLASSES
        self._inserted_total = 0.0
        self._reused_total = 0.0

    def seen(self, keys: Sequence[BlockKey]) -> None:
        """A request contains ``keys``: a followed one among them is a reuse of its class."""
        followed = self._followed
        if not followed:
            return
        reused = self._reused
        for key in keys:
            if key and key[-1] % SAMPLE == 0:
                cls = followed.pop(key, None)
                if cls is not None:
                    reused[cls] += 1.0
                    self._reused_total += 1.0

    def follow(self, key: BlockKey, cls: int) -> bool:
        """A new block of class ``cls`` (followed only when sampled); True when it was, and so
        changed the rates (``rate``) of its class or, halving them, of every class."""
        if not key or key[-1] % SAMPLE:
            return False
        followed = self._followed
        followed[key] = cls
        self._inserted[cls] += 1.0
        self._inserted_total += 1.0
        if len(followed) > self._limit:
            followed.popitem(last=False)
        self._since_halving += 1
        if self._since_halving >= self._limit:
            # Old traffic counts half as much each time the map turned over: rates stay current.
            self._since_halving = 0
            inserted, reused = self._inserted, self._reused
            for i in range(CLASSES):
                inserted[i] /= 2.0
                reused[i] /= 2.0
            self._inserted_total /= 2.0
            self._reused_total /= 2.0
        return True

    def mean(self) -> float:
        """The reuse rate of all followed new blocks (0 before any)."""
        total = self._inserted_total
        return self._reused_total / total if total > 0.0 else 0.0

    def rate(self, cls: int, mean: float) -> float:
        """The learned reuse rate of class ``cls`` (``mean``: ``self.mean()``, passed in so that
        a caller ranking many blocks computes it once)."""
        return (self._reused[cls] + PRIOR_BLOCKS * mean) / (self._inserted[cls] + PRIOR_BLOCKS)

    def __len__(self) -> int:
        """Keys followed now."""
        return len(self._followed)
