"""Segmented LRU that sorts each request's new blocks by a reuse rate it learns online.

Without hints this is exactly ``segmented`` (probation, protected, a long ghost history). With
``on_request`` hints (an engine calls it when a request finished; ``kvtier simulate`` after each
request) the blocks the request computed itself, still in probation, are classified at once:

- the class of a block is (bucket of the request's output tokens, position from the end of the
  request: last / second to last / other, whether the request hit anything) -- each known to an
  engine when the request finished (``RequestHint``; an unknown output length is its own bucket);
- for a sample of the classified blocks (1 in ``SAMPLE``, by key) the class is remembered in a
  bounded FIFO map, the same length for every class, and a later request containing the key counts
  one reuse of that class; counts are halved every time the map has been filled again, so the
  rates follow a workload that changes;
- a class whose learned reuse rate is at least ``PROMOTE_RATIO`` times the mean rate of all new
  blocks goes to the protected segment now (it need not wait for a second use, which often comes
  after the probation segment has long forgotten it); one below ``DEMOTE_RATIO`` times the mean
  goes to a *dead* segment that is evicted before anything else; the rest stay in probation.

Nothing about a workload is fixed in advance: which output lengths, positions or hit states
predict reuse is learned from the traffic (on the bundled trace it learns that requests with short
outputs are re-sent and that a request's last block is not). The two ratios are relative to the
learned mean, not to any trace: between them a class is too close to the mean to act on.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Container, Sequence

from kvtier.keys import BlockKey
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.hints import RequestHint
from kvtier.policies.segmented import GHOST_FACTOR, PROBATION_FRACTION

PROMOTE_RATIO = 1.3
DEMOTE_RATIO = 0.7
SAMPLE = 4
"""One key in ``SAMPLE`` (by its last byte) is followed to learn the rates: the learning costs a
quarter of the memory and time, and keys are hashes, so the sample is unbiased."""
TRACK_FACTOR = 8.0
MIN_FOLLOWED = 65_536
"""The FIFO of followed keys holds ``max(MIN_FOLLOWED, TRACK_FACTOR * capacity / SAMPLE)`` keys
(about 7 MB at the minimum): a reuse is seen if it comes within that many sampled new blocks, for
every class alike. The floor matters for small pools: reuse distances do not shrink with the pool,
and a window of a few pool-fulls would see almost no reuse there."""
_OUTPUT_BUCKETS = 18
"""Output tokens by bit length (0, 1, 2-3, 4-7, ... 65,536 and more) plus one for unknown."""
_POSITIONS = 3
_CLASSES = _OUTPUT_BUCKETS * _POSITIONS * 2


class HintedPolicy(EvictionPolicy):
    def __init__(
        self,
        capacity: int,
        probation_fraction: float = PROBATION_FRACTION,
        ghost_factor: float = GHOST_FACTOR,
    ) -> None:
        if capacity <= 0:
            raise ValueError(f"hinted policy capacity must be positive, got {capacity}")
        if not 0.0 < probation_fraction < 1.0:
            raise ValueError(f"probation_fraction must be in (0, 1), got {probation_fraction}")
        if ghost_factor < 0.0:
            raise ValueError(f"ghost_factor must be >= 0, got {ghost_factor}")
        self.capacity = capacity
        self.probation_target = max(1, int(probation_fraction * capacity))
        self.ghost_capacity = int(ghost_factor * capacity)
        # Oldest first in each (OrderedDict: popping from the front of a dict leaves tombstones).
        self._dead: OrderedDict[BlockKey, None] = OrderedDict()
        self._probation: OrderedDict[BlockKey, None] = OrderedDict()
        self._protected: OrderedDict[BlockKey, None] = OrderedDict()
        self._ghost: OrderedDict[BlockKey, None] = OrderedDict()
        # Learning: followed key -> class; per class, new blocks followed and reuses seen.
        self._followed: OrderedDict[BlockKey, int] = OrderedDict()
        self._follow_limit = max(MIN_FOLLOWED, int(TRACK_FACTOR * capacity / SAMPLE))
        self._since_halving = 0
        self._inserted = [0.0] * _CLASSES
        self._reused = [0.0] * _CLASSES
        self._inserted_total = 0.0
        self._reused_total = 0.0

    # -- the policy interface -------------------------------------------------------------------

    def insert(self, key: BlockKey) -> None:
        ghost = self._ghost
        if key in ghost:
            # Stored again after an eviction: its second use, so it is protected.
            del ghost[key]
            self._protected[key] = None
        else:
            self._probation[key] = None

    def access(self, key: BlockKey) -> None:
        probation = self._probation
        if key in probation:
            del probation[key]
            self._protected[key] = None
        elif key in self._dead:
            del self._dead[key]
            self._protected[key] = None
        else:
            self._protected.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        if key in self._probation:
            del self._probation[key]
        elif key in self._dead:
            del self._dead[key]
        else:
            self._protected.pop(key, None)

    def evict(self, n: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        victims: list[BlockKey] = []
        if n <= 0:
            return victims
        probation, protected = self._probation, self._protected
        if self._dead:
            _take(self._dead, n, pinned, victims)
        surplus = max(0, len(probation) - self.probation_target)
        if surplus and len(victims) < n:
            _take(probation, min(n - len(victims), surplus), pinned, victims)
        if len(victims) < n:
            _take(protected, n - len(victims), pinned, victims)
        if len(victims) < n:
            _take(probation, n - len(victims), pinned, victims)
        ghost = self._ghost
        if self.ghost_capacity:
            for key in victims:
                ghost[key] = None
            for _ in range(max(0, len(ghost) - self.ghost_capacity)):
                ghost.popitem(last=False)
        return victims

    def coldest(self, n: int) -> list[BlockKey]:
        # evict's order when nothing is pinned: dead, the probation surplus, protected, the rest.
        surplus = max(0, len(self._probation) - self.probation_target)
        order = itertools.chain(
            self._dead,
            itertools.islice(self._probation, surplus),
            self._protected,
            itertools.islice(self._probation, surplus, None),
        )
        return list(itertools.islice(order, n))

    def __len__(self) -> int:
        return len(self._dead) + len(self._probation) + len(self._protected)

    # -- hints ----------------------------------------------------------------------------------

    def on_request(self, keys: Sequence[BlockKey], hint: RequestHint) -> None:
        followed = self._followed
        if followed:
            # A followed key showing up again is one reuse of the class it was stored under.
            reused = self._reused
            for key in keys:
                if key and key[-1] % SAMPLE == 0:
                    cls = followed.pop(key, None)
                    if cls is not None:
                        reused[cls] += 1.0
                        self._reused_total += 1.0
        n = len(keys)
        first = min(hint.hit_blocks, n)
        probation = self._probation
        if first >= n or probation.keys().isdisjoint(keys[first:]):
            return
        output = hint.output_tokens
        bucket = 0 if output is None else 1 + min(output.bit_length(), _OUTPUT_BUCKETS - 2)
        base = (bucket * _POSITIONS) * 2 + (1 if first else 0)
        # Before any reuse was seen there is nothing to tell classes apart by: only follow.
        mean = self._mean()
        inserted, reused = self._inserted, self._reused
        protected, dead = self._protected, self._dead
        for i in range(first, n):
            key = keys[i]
            if key not in probation:
                continue
            cls = base + 2 * min(n - 1 - i, _POSITIONS - 1)
            # Shrunk towards the mean by one block's weight: a class seen rarely stays near it.
            rate = (reused[cls] + mean) / (inserted[cls] + 1.0)
            if key and key[-1] % SAMPLE == 0:
                self._follow(key, cls)
            if mean <= 0.0:
                continue
            if rate > PROMOTE_RATIO * mean:
                del probation[key]
                protected[key] = None
            elif rate < DEMOTE_RATIO * mean:
                del probation[key]
                dead[key] = None

    def reuse_rate(self, hint: RequestHint, from_end: int) -> float:
        """The learned reuse rate of a new block ``from_end`` blocks before the end of a request
        like ``hint`` describes (for tests and reports)."""
        output = hint.output_tokens
        bucket = 0 if output is None else 1 + min(output.bit_length(), _OUTPUT_BUCKETS - 2)
        cls = (bucket * _POSITIONS + min(from_end, _POSITIONS - 1)) * 2 + (
            1 if hint.hit_blocks else 0
        )
        mean = self._mean()
        return (self._reused[cls] + mean) / (self._inserted[cls] + 1.0)

    def _mean(self) -> float:
        """The reuse rate of all followed new blocks (0 before any)."""
        total = self._inserted_total
        return self._reused_total / total if total > 0.0 else 0.0

    def _follow(self, key: BlockKey, cls: int) -> None:
        followed = self._followed
        followed[key] = cls
        self._inserted[cls] += 1.0
        self._inserted_total += 1.0
        if len(followed) > self._follow_limit:
            followed.popitem(last=False)
        self._since_halving += 1
        if self._since_halving >= self._follow_limit:
            # Old traffic counts half as much each time the map turned over: rates stay current.
            self._since_halving = 0
            inserted, reused = self._inserted, self._reused
            for i in range(_CLASSES):
                inserted[i] /= 2.0
                reused[i] /= 2.0
            self._inserted_total /= 2.0
            self._reused_total /= 2.0


def _take(
    order: OrderedDict[BlockKey, None],
    n: int,
    pinned: Container[BlockKey],
    victims: list[BlockKey],
) -> None:
    """Move up to ``n`` unpinned keys, oldest first, from ``order`` to ``victims``."""
    taken: list[BlockKey] = []
    for key in order:
        if key not in pinned:
            taken.append(key)
            if len(taken) == n:
                break
    for key in taken:
        del order[key]
    victims.extend(taken)
