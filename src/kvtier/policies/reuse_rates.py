"""Reuse rates of new blocks by class, learned online from the traffic (for ``hinted``).

A new block's class is what an engine knows when the request that computed it finished
(``RequestHint``): a bucket of the request's output tokens (by bit length; unknown is its own
bucket), the block's place from the end of the request (last, second to last, other) and whether
the request hit anything. One key in ``SAMPLE`` (by its last byte: keys are hashes, so the sample
is unbiased) is followed in a bounded FIFO map; a later request that contains it counts one reuse
of its class. A followed block counts as inserted in its class only once its outcome is known: when
it is reused, or when a pool's worth of new blocks came after it without a reuse (at most
``MATURITY_FOLLOWED`` followed ones). Counted at once, a class's first request ranked its own
blocks against reuses that had had no time to happen: after the GPU benchmark's warm-up (vLLM
0.25.1, 4 conversations in flight, a 4 GiB pool) the first turns' blocks went dead as they were
hinted and were evicted before the warm-up's, and two of the four second turns found nothing.
Counts are halved each time the map has been filled again, so the rates follow a workload that
changes. Nothing about a workload is fixed in advance.
"""

from __future__ import annotations

from collections import OrderedDict, deque
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
MATURITY_FOLLOWED = 512
"""A followed block's outcome is known once this many followed blocks (2,048 new blocks), or a
pool's worth if the pool is smaller, came after it without its reuse. A pool's worth: a reuse
later than that finds the block evicted under LRU. At most 2,048 blocks: on the bundled trace
larger pools learned too slowly with a pool's worth (8,000 blocks: 0.4138 hit ratio, 0.4238 with
this bound, 0.4267 counting blocks at once)."""
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
        """Followed keys -> their class, or ``~class`` once counted as inserted (matured)."""
        self._limit = max(MIN_FOLLOWED, int(TRACK_FACTOR * capacity / SAMPLE))
        self._maturing: deque[BlockKey] = deque()
        """The last ``_horizon`` followed keys: their outcome is not known yet."""
        self._horizon = max(1, min(capacity // SAMPLE, MATURITY_FOLLOWED))
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
        reused, inserted = self._reused, self._inserted
        for key in keys:
            if key and key[-1] % SAMPLE == 0:
                cls = followed.pop(key, None)
                if cls is None:
                    continue
                if cls >= 0:  # reused before it matured: counted now (its deque entry is stale)
                    inserted[cls] += 1.0
                    self._inserted_total += 1.0
                else:
                    cls = ~cls
                reused[cls] += 1.0
                self._reused_total += 1.0

    def follow(self, key: BlockKey, cls: int) -> bool:
        """A new block of class ``cls`` (followed only when sampled); True when it was, and so
        may have changed the rates (``rate``): of the class of the block it matured or, halving
        them, of every class."""
        if not key or key[-1] % SAMPLE:
            return False
        followed, maturing = self._followed, self._maturing
        followed[key] = cls
        maturing.append(key)
        if len(maturing) > self._horizon:
            old = maturing.popleft()
            old_cls = followed.get(old)  # None: reused (counted then) or forgotten
            if old_cls is not None and old_cls >= 0:  # not reused within a pool's worth
                followed[old] = ~old_cls
                self._inserted[old_cls] += 1.0
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
