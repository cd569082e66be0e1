"""A trace replayed with N conversations in flight (``kvtier simulate --concurrency N``).

An engine benchmark keeps N conversations open and sends a conversation's next turn only when its
previous one finished; a finished conversation's place goes to the next one. Replayed in trace
order instead, a conversation's turns may come back to back, and the pool never sees what it
sees in an engine with many conversations in flight: each conversation returns after the
others' turns, more blocks than a small pool holds.

Mooncake traces carry no conversation ids. A conversation here is the requests that start with the
same block (the same first ``hash_ids`` entry: a shared document or history, the rest of the
prompt the new turn), its turns in trace order; conversations start in the order of their first
request. This is the grouping ``kvtier.demo`` builds its conversations from (``trace_groups``),
but every request is kept (a request alone is a conversation of one turn, and a conversation has
as many turns as the trace gives it), so the replay has exactly the trace's requests, reordered. A
request without blocks is a conversation of its own.

The schedule is round robin over the open conversations: each sends its next turn in turn, and
a conversation that sent its last turn is replaced by the next one to start. Towards the end of
the trace, when no conversation is left to start, fewer than N are open.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from pathlib import Path

from kvtier.sim.trace import TraceRequest, read_trace


def conversations(requests: Sequence[TraceRequest]) -> list[list[int]]:
    """The indices of ``requests`` grouped by their first block, each group in trace order,
    groups in the order of their first request."""
    groups: dict[int, list[int]] = {}
    order: list[list[int]] = []
    for index, request in enumerate(requests):
        if not request.hash_ids:
            order.append([index])
            continue
        group = groups.get(request.hash_ids[0])
        if group is None:
            group = groups[request.hash_ids[0]] = []
            order.append(group)
        group.append(index)
    return order


def schedule(requests: Sequence[TraceRequest], concurrency: int) -> list[int]:
    """The order (indices into ``requests``) in which ``concurrency`` conversations in flight
    send them (see the module docstring)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    waiting = deque(conversations(requests))
    open_: deque[deque[int]] = deque()
    while waiting and len(open_) < concurrency:
        open_.append(deque(waiting.popleft()))
    out: list[int] = []
    while open_:
        turns = open_.popleft()
        out.append(turns.popleft())
        if turns:
            open_.append(turns)
        elif waiting:
            open_.append(deque(waiting.popleft()))
    return out


def in_flight(requests: Sequence[TraceRequest], concurrency: int | None) -> list[TraceRequest]:
    """``requests`` in the order ``concurrency`` conversations in flight send them (unchanged
    when ``concurrency`` is None)."""
    if concurrency is None:
        return list(requests)
    return [requests[i] for i in schedule(requests, concurrency)]


def trace_requests(
    path: str | Path, limit: int | None = None, concurrency: int | None = None
) -> list[TraceRequest]:
    """The first ``limit`` requests of the trace, in the order a replay sends them: trace order,
    or with ``concurrency`` conversations in flight. The replay, the offline optimum and
    ``--sweep`` all read the trace through this, so they see the same sequence."""
    return in_flight(read_trace(path, limit), concurrency)
