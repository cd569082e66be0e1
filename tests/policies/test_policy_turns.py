"""How many requests conversations send, learned from the hints (``policies/turns.py``), and what
``hinted`` does with it under pressure."""

from __future__ import annotations

import pytest

from kvtier.policies import HintedPolicy, RequestHint
from kvtier.policies import turns as turns_module
from kvtier.policies.turns import FINISH_BELOW, ConversationTurns
from policies.test_policy_pressure import key, replay, round_robin


def feed(turns: ConversationTurns, requests: list[list[bytes]], gap: float) -> list[int]:
    """Each request's count, with conversations ended after ``END_GAPS`` gaps of ``gap``."""
    counts = []
    for now, keys in enumerate(requests, start=1):
        counts.append(turns.request(keys[0], now, now - turns_module.END_GAPS * gap))
    return counts


def test_learns_that_conversations_end_after_their_fifth_request() -> None:
    turns = ConversationTurns(100)
    counts = feed(turns, round_robin(8, 5, 30, 2), 8)
    assert counts[:8] == [1] * 8 and counts[32:40] == [5] * 8
    # The first wave ended after its 5th request and the second went on after each of its
    # first 4; the third wave's 5th requests are known to be their last.
    assert turns.goes_on(5) < FINISH_BELOW
    assert all(turns.goes_on(k) > 0.8 for k in range(1, 5))
    assert turns.count == 5 and turns.finishing()


def test_a_count_seen_end_a_few_times_is_not_believed() -> None:
    turns = ConversationTurns(100)
    assert turns.goes_on(3) == 1.0  # nothing seen: it goes on
    feed(turns, round_robin(8, 5, 30, 2)[:64], 8)  # one wave ended, 8 conversations
    assert turns.goes_on(5) < FINISH_BELOW
    few = ConversationTurns(100)
    feed(few, round_robin(2, 5, 30, 2), 2)  # 2 conversations ended per wave, 4 seen so far
    assert few.goes_on(5) >= FINISH_BELOW


def test_first_requests_are_never_judged() -> None:
    """Most of the bundled trace's conversations are one request (0.19 go on): judged, their
    blocks were dropped where a fifth of them came back."""
    turns = ConversationTurns(1000)
    feed(turns, [[key(c, 0)] for c in range(200)], 8)
    assert turns.goes_on(1) < FINISH_BELOW
    assert turns.count == 1 and not turns.finishing()


def test_forgotten_conversations_are_not_counted_as_ended() -> None:
    turns = ConversationTurns(4)
    feed(turns, [[key(c, 0)] for c in range(50)], 1e9)  # never old enough to end
    assert turns.goes_on(1) == 1.0


def test_counts_are_halved_so_the_statistic_follows_the_traffic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(turns_module, "HALVE_AT", 100)
    turns = ConversationTurns(100)
    feed(turns, round_robin(8, 5, 30, 2), 8)  # 24 conversations, 4 requests followed by one
    assert turns._counted < 100 and sum(turns._continued) < 4 * 24
    assert turns.goes_on(5) < FINISH_BELOW  # the ratios stay


def test_under_pressure_a_conversations_last_request_stops_holding_the_pool() -> None:
    """The engine benchmark's conversations end after 5 turns: a finished conversation held its
    room for a mean gap before it expired, a fifth of its time in the pool."""
    policy = HintedPolicy(80)
    held: set[bytes] = set()
    requests = round_robin(8, 5, 30, 2)
    replay(policy, requests[:-1], 80, admit=True, held=held)
    last = requests[-1]
    assert policy.pressure and policy.gauge.turns.goes_on(5) < FINISH_BELOW
    replay(policy, [last], 80, admit=True, held=held)
    assert policy.gauge.turns.finishing()
    stored = [k for k in last if k in held]
    assert stored and all(k in policy._dead for k in stored)
    assert policy.admit_store(len(stored), 0) >= len(stored)  # its room is free for newcomers


def test_without_pressure_a_last_request_is_left_to_lru() -> None:
    policy = HintedPolicy(10_000)
    for keys in round_robin(8, 5, 30, 2):
        for k in keys:
            if k not in policy._lru:
                policy.insert(k)
        policy.on_request(keys, RequestHint(len(keys) - 2, 64))
    assert not policy.pressure and policy.gauge.turns.finishing()
    assert not policy._dead
