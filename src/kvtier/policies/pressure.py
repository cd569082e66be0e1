"""When a pool is under pressure: the traffic's conversations return after more blocks than the
pool holds, so LRU evicts each of them before its next turn and caches nothing (for ``hinted``).

A *conversation* is the requests that start with the same block (their root; Mooncake traces and
``kvtier.demo`` group requests the same way). ``PressureGauge`` watches the requests that
``on_request`` hints name, at the level of conversations, not blocks (a few dict operations per
request):

* the gap between two requests of a conversation, in requests, learned as a mean (plain over
  the first ``GAP_WARMUP`` gaps, then moving); a
  conversation not seen for ``EXPIRY_GAPS`` times that gap is presumed finished;
* two shadow caches of the pool's capacity that hold whole conversations (their last request's
  blocks): one LRU, one *stable* (it keeps the conversations it holds until they expire, grows
  one only into free room, and admits a conversation only into free room). Each counts the blocks
  it would have served (the shorter of the request and what it holds), with a decay of
  ``GATE_DECAY`` per request.

Pressure turns on when the stable shadow serves more than ``GATE_MARGIN`` times both what the LRU
shadow serves and what the pool itself found while the stable mode was off (the hints' hit runs,
with the same decay; frozen while the mode is on, so that its own hits do not turn it off), and
off when the stable shadow is no longer ``GATE_HOLD`` times ahead. The shadows are coarse (whole
conversations, a request taken as its previous request's blocks plus new ones), so the stable
mode is taken only where it is far ahead, as where LRU finds nothing; the pool's own figure
keeps it off where ``hinted`` already does much better than LRU (the bundled trace with 128
conversations in flight and 4,000 blocks: 0.62 against LRU's 0.43). Both shadows see the same
traffic whatever the pool does.

The mode *pays* (``pays``) while the pool finds several times what it found before it and the
stable shadow serves several times what the LRU shadow does: the regime where LRU finds next to
nothing, where ``hinted`` then holds its subset without exceptions. ``turns`` learns how many
requests conversations send (``turns.py``).
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.keys import BlockKey
from kvtier.policies.turns import END_GAPS, ConversationTurns

EXPIRY_GAPS = 1.0
"""A conversation not seen for this many mean gaps is presumed finished. One gap: a conversation
in flight returns within its gap (an engine touches its blocks at the next turn's lookup, before
that turn's hint), and a finished one stops holding the pool one gap after its last turn."""
GATE_MARGIN = 2.0
"""At 2.0 the bundled trace's replay is at or above ``hinted`` without the stable mode at every
pool size; 1.25-1.5 lost a little at 2,000 / 300 blocks, 3.0 at 2,000 (docs/policies.md)."""
GATE_HOLD = 1.5
"""Once on, the mode stays on while the stable shadow is this far ahead: on the bundled trace,
where it is near the margin for a few hundred requests, the mode otherwise flapped every few
requests (2,000 blocks: 0.1597 against 0.1606)."""
GATE_DECAY = 0.99
"""Per request: the gauge follows about the last hundred requests."""
GAP_WEIGHT = 0.05
"""Weight of each new gap in the moving mean."""
GAP_WARMUP = 15
"""The first gaps are averaged plainly (each weighs 1 / its count), the rest by ``GAP_WEIGHT``.
15 rather than 1 / ``GAP_WEIGHT``: the bundled trace's replay at 1,000 blocks kept 0.0906 (0.0948;
20 gave 0.0901), and the engine's recorded calls at 16 in flight were served alike (848 blocks)."""
MIN_ROOTS = 4096
"""Conversations remembered for their gap at least (else the pool's capacity in blocks)."""
PAYS_OVER_LRU = 10.0
"""The stable mode *pays* where the stable shadow serves more than this many times what the LRU
shadow serves: LRU would find next to nothing (issue 24's regime). It also required the pool to
find 3x what it found before the mode, which held only while ``hinted``'s learning demoted the
blocks of classes it had not seen reused yet (``reuse_rates.py``): with that fixed, the pool
served more before the mode, and at 32 in flight and 4 GiB (the scheduler replay with the
benchmark's warm-up) the gate opened in 53 of 249 admissions under pressure and the pool cached
145,424 tokens; without the condition 178,048 (158,944 before the learning's fix). While it pays,
``hinted`` refuses every store that needs room held for conversations, not only while the pool
serves less than the stable shadow / ``GATE_HOLD``: in vLLM the stores of the requests in
flight, about as many blocks as the pool holds, were admitted whenever the pool did well and
evicted the conversations held (16 in flight, 2 GiB: the pool then served 0.35 of the offline
optimum of the engine's calls, now 0.59). On the bundled trace in trace order the mode is on for
a few hundred requests and changes little (the pool found 0.7-1.6 times its baseline there, the
stable shadow 2-8 times the LRU shadow): it does not pay there, and the bound stays
(docs/policies.md)."""


class ShadowLRU:
    """Whole conversations in LRU order, at most ``capacity`` blocks."""

    __slots__ = ("_held", "_total", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: OrderedDict[BlockKey, int] = OrderedDict()
        self._total = 0

    def request(self, root: BlockKey, blocks: int) -> int:
        """A request of ``blocks`` blocks of conversation ``root``; returns the blocks served."""
        held = self._held
        old = held.pop(root, 0)
        self._total -= old
        size = min(blocks, self.capacity)
        held[root] = size
        self._total += size
        while self._total > self.capacity:
            _, evicted = held.popitem(last=False)
            self._total -= evicted
        return min(old, blocks)


class ShadowStable:
    """Whole conversations kept until they expire; newcomers and growth only into free room."""

    __slots__ = ("_held", "_total", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: OrderedDict[BlockKey, tuple[int, int]] = OrderedDict()
        """Conversation -> (blocks held, request of its last use), oldest use first."""
        self._total = 0

    def request(self, root: BlockKey, blocks: int, now: int, expiry: float) -> int:
        """A request of conversation ``root`` at request ``now``; conversations last used at or
        before ``expiry`` are dropped first. Returns the blocks served."""
        held = self._held
        size, _ = held.pop(root, (0, 0))
        served = min(size, blocks)
        while held:
            oldest, (old_size, used) = next(iter(held.items()))
            if used > expiry:
                break
            del held[oldest]
            self._total -= old_size
        grow = min(blocks - size, self.capacity - self._total)
        if grow > 0:
            size += grow
            self._total += grow
        if size:
            held[root] = (size, now)
        return served


class PressureGauge:
    """Conversation gaps and the two shadows; see the module docstring."""

    def __init__(self, capacity: int) -> None:
        self.requests = 0
        """Requests seen (the clock of ``expiry``)."""
        self.mean_gap = 0.0
        """Requests between two requests of a conversation (0 before any returned)."""
        self._gaps = 0
        self._last: OrderedDict[BlockKey, int] = OrderedDict()
        self._max_roots = max(MIN_ROOTS, capacity)
        self._lru = ShadowLRU(capacity)
        self._stable = ShadowStable(capacity)
        self.lru_served = 0.0
        self.stable_served = 0.0
        self.served = 0.0
        """Blocks the pool's requests really found (their hints' hit runs)."""
        self.baseline = 0.0
        """``served`` while the stable mode is off: what the policy gets without it (frozen
        while it is on)."""
        self.on = False
        self.turns = ConversationTurns(self._max_roots)
        """How many requests conversations send (``turns.py``)."""

    def pays(self) -> bool:
        """Whether the stable mode pays (``PAYS_OVER_LRU``)."""
        return self.stable_served > PAYS_OVER_LRU * self.lru_served

    def expiry(self) -> float:
        """Blocks last used at or before this request are presumed finished (-inf: none is
        yet): ``EXPIRY_GAPS`` mean gaps ago. With N conversations in flight round robin the gap
        is N, and a conversation in flight is used again N-1 requests after its last use."""
        if not self.mean_gap:
            return float("-inf")
        return self.requests - EXPIRY_GAPS * self.mean_gap

    def request(self, root: BlockKey, blocks: int, found: int = 0) -> None:
        """A request of ``blocks`` blocks whose first block is ``root``, ``found`` of them hits.
        Pressure is on while the stable shadow serves ``GATE_MARGIN`` times what the LRU shadow
        serves and what the policy itself served without the stable mode."""
        self.requests += 1
        now = self.requests
        last = self._last
        previous = last.pop(root, None)
        if previous is not None:
            # A plain mean of the first GAP_WARMUP gaps, then a moving one: a moving mean
            # from the first gap took 60 requests to forget an engine's warm-up requests (a gap
            # of 3 where conversations came back after 16), with the stable mode off meanwhile.
            self._gaps += 1
            weight = 1.0 / self._gaps if self._gaps <= GAP_WARMUP else GAP_WEIGHT
            self.mean_gap += weight * (now - previous - self.mean_gap)
        last[root] = now
        if len(last) > self._max_roots:
            last.popitem(last=False)
        ended = now - END_GAPS * self.mean_gap if self.mean_gap else float("-inf")
        self.turns.request(root, now, ended)
        lru = self._lru.request(root, blocks)
        stable = self._stable.request(root, blocks, now, self.expiry())
        self.lru_served = self.lru_served * GATE_DECAY + lru
        self.stable_served = self.stable_served * GATE_DECAY + stable
        self.served = self.served * GATE_DECAY + found
        if not self.on:
            self.baseline = self.served
        margin = GATE_HOLD if self.on else GATE_MARGIN
        self.on = self.stable_served > margin * max(self.lru_served, self.baseline)
