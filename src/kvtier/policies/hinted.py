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

An engine's timing is not the replay's: vLLM stores a request's blocks during its prefill, and
tells the policy about the request only when it finished, which may be many stored blocks later
(other requests in flight) or before the last stores completed (the hint comes in the same engine
step as the store's completion, and first). Both orders are handled, without a fixed guess:

- a block stored after the first hint was seen waits in a *pending* segment until a hint covers
  it. The policy measures, at each hint, how many blocks were stored since the request's oldest
  pending block (the hint's lag), and keeps up to the largest lag of the last ``LAG_WINDOW`` hints
  (at most half the pool) of pending blocks ahead of everything else: so a request's blocks are
  still there when its hint comes. Pending blocks beyond that (a hint that never came) are evicted
  right after the dead segment, as ``segmented`` would evict them from its probation surplus;
- a hint for blocks not in the pool yet (their store still in flight) is remembered (a FIFO of at
  most ``capacity`` keys) and applied when the block is stored.

Nothing about a workload is fixed in advance: which output lengths, positions or hit states
predict reuse is learned from the traffic (on the bundled trace it learns that requests with short
outputs are re-sent and that a request's last block is not). The two ratios are relative to the
learned mean, not to any trace: between them a class is too close to the mean to act on.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Container, Sequence

from kvtier.keys import BlockKey
from kvtier.policies.hints import RequestHint
from kvtier.policies.segments import SegmentedBase, oldest_unpinned, remember_evicted
from kvtier.policies.segments import take as _take

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
RESERVE_FRACTION = 0.5
LAG_WINDOW = 64
"""The pending reserve is the largest hint lag of the last ``LAG_WINDOW`` hints that covered
pending blocks: it follows a change of concurrency within that many requests."""
_OUTPUT_BUCKETS = 18
"""Output tokens by bit length (0, 1, 2-3, 4-7, ... 65,536 and more) plus one for unknown."""
_POSITIONS = 3
_CLASSES = _OUTPUT_BUCKETS * _POSITIONS * 2


class HintedPolicy(SegmentedBase):
    """Options, probation, protected and the ghost history: ``SegmentedBase``."""

    kind = "hinted"

    def _setup(self) -> None:
        self._dead: OrderedDict[BlockKey, None] = OrderedDict()
        """Evicted before anything else (oldest first, like every segment)."""
        # Engine timing. Until the first hint, new blocks go to probation (exactly segmented);
        # from then on they wait in pending (key -> insert number) until a hint covers them.
        self._hints_seen = False
        self._pending: OrderedDict[BlockKey, int] = OrderedDict()
        self._inserts = 0
        self._lags: deque[int] = deque(maxlen=LAG_WINDOW)
        self.pending_reserve = 0
        """Pending blocks kept ahead of every other segment (the learned hint lag)."""
        self._early: OrderedDict[BlockKey, int] = OrderedDict()
        """Keys hinted before they were stored -> their class, applied by ``insert``."""
        self._missed: OrderedDict[BlockKey, int] = OrderedDict()
        """Pending keys evicted before a hint covered them -> insert number: when their hint
        comes, its lag is still measured, so a reserve that was too small grows."""
        # Learning: followed key -> class; per class, new blocks followed and reuses seen.
        self._followed: OrderedDict[BlockKey, int] = OrderedDict()
        self._follow_limit = max(MIN_FOLLOWED, int(TRACK_FACTOR * self.capacity / SAMPLE))
        self._since_halving = 0
        self._inserted = [0.0] * _CLASSES
        self._reused = [0.0] * _CLASSES
        self._inserted_total = 0.0
        self._reused_total = 0.0

    # -- the policy interface -------------------------------------------------------------------

    def insert(self, key: BlockKey) -> None:
        self._inserts += 1
        early = self._early
        cls = early.pop(key, None) if early else None
        ghost = self._ghost
        if key in ghost:
            # Stored again after an eviction: its second use, so it is protected.
            del ghost[key]
            self._protected[key] = None
            if cls is not None and key[-1] % SAMPLE == 0:
                self._follow(key, cls)
        elif cls is not None:
            # Its request's hint came first (the store completed after the request finished).
            self._probation[key] = None
            self._classify(key, cls, self._mean())
        elif self._hints_seen:
            self._pending[key] = self._inserts
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
        elif key in self._pending:
            del self._pending[key]
            self._protected[key] = None
        else:
            self._protected.move_to_end(key)

    def remove(self, key: BlockKey) -> None:
        if key in self._probation:
            del self._probation[key]
        elif key in self._dead:
            del self._dead[key]
        elif key in self._pending:
            del self._pending[key]
        else:
            self._protected.pop(key, None)

    def evict(self, n: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        victims: list[BlockKey] = []
        if n <= 0:
            return victims
        probation, protected, pending = self._probation, self._protected, self._pending
        if self._dead:
            _take(self._dead, n, pinned, victims)
        stale = len(pending) - self.pending_reserve
        if stale > 0 and len(victims) < n:
            self._take_pending(min(n - len(victims), stale), pinned, victims)
        # The kept pending blocks count against probation's target: together they are the new
        # blocks, and a larger probation lets one-off blocks displace returning ones.
        kept = min(len(pending), self.pending_reserve)
        surplus = max(0, len(probation) + kept - self.probation_target)
        if surplus and len(victims) < n:
            _take(probation, min(n - len(victims), surplus), pinned, victims)
        if len(victims) < n:
            _take(protected, n - len(victims), pinned, victims)
        if len(victims) < n:
            _take(probation, n - len(victims), pinned, victims)
        if pending and len(victims) < n:
            self._take_pending(n - len(victims), pinned, victims)
        remember_evicted(self._ghost, victims, self.ghost_capacity)
        return victims

    def _take_pending(self, n: int, pinned: Container[BlockKey], victims: list[BlockKey]) -> None:
        """``take`` for the pending segment, remembering the victims' insert numbers."""
        pending, missed = self._pending, self._missed
        taken = oldest_unpinned(pending, n, pinned)
        for key in taken:
            missed[key] = pending.pop(key)
        for _ in range(len(missed) - self.capacity):
            missed.popitem(last=False)
        victims.extend(taken)

    def coldest(self, n: int) -> list[BlockKey]:
        # evict's order when nothing is pinned: dead, the pending blocks beyond the reserve, the
        # probation surplus, protected, the rest of probation, the pending reserve.
        kept = min(len(self._pending), self.pending_reserve)
        surplus = max(0, len(self._probation) + kept - self.probation_target)
        stale = max(0, len(self._pending) - self.pending_reserve)
        order = itertools.chain(
            self._dead,
            itertools.islice(self._pending, stale),
            itertools.islice(self._probation, surplus),
            self._protected,
            itertools.islice(self._probation, surplus, None),
            itertools.islice(self._pending, stale, None),
        )
        return list(itertools.islice(order, n))

    def __len__(self) -> int:
        return len(self._dead) + len(self._probation) + len(self._protected) + len(self._pending)

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
        self._hints_seen = True
        n = len(keys)
        first = min(hint.hit_blocks, n)
        pending, probation, missed = self._pending, self._probation, self._missed
        oldest = self._inserts + 1
        gone: set[BlockKey] = set()
        if missed:
            for key in keys:
                number = missed.pop(key, None)
                if number is not None:
                    oldest = min(oldest, number)
                    gone.add(key)
        if pending:
            # Blocks the request found (hits, promotions) were not computed by it: not ranked.
            for key in keys[:first]:
                number = pending.pop(key, None)
                if number is not None:
                    oldest = min(oldest, number)
                    probation[key] = None
        if first >= n:
            self._learn_lag(oldest)
            return
        output = hint.output_tokens
        bucket = 0 if output is None else 1 + min(output.bit_length(), _OUTPUT_BUCKETS - 2)
        base = (bucket * _POSITIONS) * 2 + (1 if first else 0)
        # Before any reuse was seen there is nothing to tell classes apart by: only follow.
        mean = self._mean()
        protected, dead, early = self._protected, self._dead, self._early
        for i in range(first, n):
            key = keys[i]
            cls = base + 2 * min(n - 1 - i, _POSITIONS - 1)
            if key in pending:
                oldest = min(oldest, pending.pop(key))
                probation[key] = None
            if key in probation:
                self._classify(key, cls, mean)
            elif not (key in protected or key in dead or key in gone or key in self._ghost):
                # Not stored yet (in flight): ranked when it is stored. Not for a key evicted
                # before (the ghost protects it when it is stored again).
                early[key] = cls
                if len(early) > self.capacity:
                    early.popitem(last=False)
        self._learn_lag(oldest)

    def _classify(self, key: BlockKey, cls: int, mean: float) -> None:
        """Rank a new block of class ``cls`` that is in probation: protect, demote or leave it."""
        # Shrunk towards the mean by one block's weight: a class seen rarely stays near it.
        rate = (self._reused[cls] + mean) / (self._inserted[cls] + 1.0)
        if key and key[-1] % SAMPLE == 0:
            self._follow(key, cls)
        if mean <= 0.0:
            return
        if rate > PROMOTE_RATIO * mean:
            del self._probation[key]
            self._protected[key] = None
        elif rate < DEMOTE_RATIO * mean:
            del self._probation[key]
            self._dead[key] = None

    def _learn_lag(self, oldest: int) -> None:
        """``oldest``: the insert number of the hinted request's oldest pending block (past the
        last insert when none was pending). The blocks stored since then had to be kept for the
        hint to find it: the reserve is the largest such count of recent hints."""
        if oldest > self._inserts:
            return
        lags = self._lags
        lags.append(self._inserts - oldest + 1)
        self.pending_reserve = min(int(self.capacity * RESERVE_FRACTION), max(lags))

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
