"""How many requests a conversation sends, learned online from the hints (for ``hinted`` under
pressure: a conversation predicted to have sent its last request stops holding the pool).

A conversation is the requests that start with the same block (``pressure.py``). For each count
k (its k-th request), ``ConversationTurns`` counts the conversations seen to send a (k+1)-th
request and those seen to end after their k-th: not seen again for ``END_GAPS`` mean gaps
between two requests of a conversation. The chance that a conversation goes on after its k-th
request is then (continued + ``PRIOR``) / (continued + ended + ``PRIOR``): it goes on until the
traffic shows otherwise, and a count seen end a few times only is not believed to end.

Where conversations have a fixed length (the engine benchmark's, 5 turns) the last turn is
learned within a few conversations; where the length is spread out (a Mooncake trace) no count
falls that low and nothing changes. A conversation's first request is not judged: its blocks are
unproven anyway (``hinted``'s *new* blocks), and on the bundled trace most conversations are one
request (0.19 go on), so judging first requests dropped the ones that came back.
"""

from __future__ import annotations

from collections import OrderedDict

from kvtier.keys import BlockKey

END_GAPS = 2.0
"""A conversation not seen for this many mean gaps has ended (one gap is when a conversation in
flight is due; two leave room for one that came late)."""
PRIOR = 2.0
"""Weight of "it goes on" in the chance: 2 conversations' worth, so a count is believed to be a
last request once about 7 conversations ended there and none went on."""
FINISH_BELOW = 0.25
"""A request is its conversation's last when the chance it goes on is below this."""
MIN_COUNT = 2
"""First requests are never judged (see the module docstring)."""
MAX_COUNT = 32
"""Counts above this share one statistic."""
HALVE_AT = 4096
"""Conversations counted (continued + ended) before every count is halved: the statistic
follows the traffic."""


class ConversationTurns:
    """Open conversations (their last request and count) and the per-count statistic."""

    __slots__ = ("_continued", "_counted", "_ended", "_max_open", "_open", "count")

    def __init__(self, max_open: int) -> None:
        self._open: OrderedDict[BlockKey, tuple[int, int]] = OrderedDict()
        """Conversation -> (request of its last use, its count), least recently used first."""
        self._max_open = max_open
        self._continued = [0.0] * (MAX_COUNT + 1)
        self._ended = [0.0] * (MAX_COUNT + 1)
        self._counted = 0
        self.count = 0
        """The count of the last request seen (1: its conversation's first)."""

    def request(self, root: BlockKey, now: int, ended_before: float) -> int:
        """A request of conversation ``root`` at request ``now``; conversations last seen at or
        before ``ended_before`` have ended. Returns the request's count."""
        open_ = self._open
        previous = open_.pop(root, None)
        count = 1
        if previous is not None:
            self._continued[previous[1]] += 1.0
            self._counted += 1
            count = min(previous[1] + 1, MAX_COUNT)
        open_[root] = (now, count)
        while open_:
            oldest, (last, k) = next(iter(open_.items()))
            if last > ended_before:
                break
            del open_[oldest]
            self._ended[k] += 1.0
            self._counted += 1
        if len(open_) > self._max_open:
            open_.popitem(last=False)  # forgotten, not counted: it may still go on
        if self._counted >= HALVE_AT:
            self._halve()
        self.count = count
        return count

    def goes_on(self, count: int) -> float:
        """The learned chance that a conversation sends another request after its
        ``count``-th."""
        k = min(max(count, 1), MAX_COUNT)
        continued, ended = self._continued[k], self._ended[k]
        return (continued + PRIOR) / (continued + ended + PRIOR)

    def finishing(self) -> bool:
        """Whether the last request seen is predicted to be its conversation's last."""
        return self.count >= MIN_COUNT and self.goes_on(self.count) < FINISH_BELOW

    def _halve(self) -> None:
        for counts in (self._continued, self._ended):
            for k, value in enumerate(counts):
                counts[k] = value / 2
        self._counted //= 2
