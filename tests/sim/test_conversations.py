"""``kvtier simulate --concurrency``: the trace reordered for N conversations in flight."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.config import bundled_config_mapping, parse_config
from kvtier.sim import sweep as sweep_module
from kvtier.sim.conversations import conversations, in_flight, schedule, trace_requests
from kvtier.sim.optimal import optimal_hit_ratio
from kvtier.sim.simulate import simulate
from kvtier.sim.trace import TraceRequest, read_trace


def request(conversation: int, turn: int, blocks: int = 3) -> TraceRequest:
    """Turn ``turn`` of a conversation: its first block is the conversation's, the rest its own."""
    ids = (conversation, *(conversation * 1000 + turn * 10 + b for b in range(blocks - 1)))
    return TraceRequest(float(turn), blocks * 512, turn, ids)


def random_trace(seed: int, n: int = 300) -> list[TraceRequest]:
    rng = random.Random(seed)
    turns: dict[int, int] = {}
    out = []
    for _ in range(n):
        conv = rng.randrange(40)
        turns[conv] = turns.get(conv, 0) + 1
        out.append(request(conv, turns[conv], rng.randrange(1, 5)))
    out.insert(rng.randrange(n), TraceRequest(0.0, 0, 1, ()))  # no blocks: a conversation alone
    return out


@pytest.mark.parametrize("concurrency", [1, 2, 5, 16, 64])
@pytest.mark.parametrize("seed", range(4))
def test_turns_in_order_and_at_most_n_conversations_open(seed: int, concurrency: int) -> None:
    trace = random_trace(seed)
    order = schedule(trace, concurrency)
    assert sorted(order) == list(range(len(trace)))  # every request, once
    groups = conversations(trace)
    group_of = {i: g for g, members in enumerate(groups) for i in members}
    sent: dict[int, list[int]] = {}
    for index in order:
        sent.setdefault(group_of[index], []).append(index)
    # A conversation's turn k+1 never before its turn k.
    assert all(turns == groups[g] for g, turns in sent.items())
    # Open: between its first and its last turn sent: never more than N.
    first = {g: order.index(members[0]) for g, members in enumerate(groups)}
    last = {g: order.index(members[-1]) for g, members in enumerate(groups)}
    for position in range(len(order)):
        assert sum(1 for g in first if first[g] <= position <= last[g]) <= concurrency
    # Round robin: at most N-1 other requests between two turns of a conversation, and the
    # first N conversations start before any conversation's second turn.
    where = {index: position for position, index in enumerate(order)}
    for members in groups:
        assert all(where[b] - where[a] <= concurrency for a, b in itertools.pairwise(members))
    assert sorted(order[: min(concurrency, len(groups))]) == [m[0] for m in groups[:concurrency]]
    # Conversations start in the order of their first request.
    assert sorted(first, key=first.__getitem__) == list(range(len(groups)))


def test_round_robin_with_a_finished_conversations_place_going_to_the_next() -> None:
    trace = [request(1, 1), request(1, 2), request(2, 1), request(3, 1), request(3, 2)]
    trace += [request(2, 2), request(1, 3)]
    assert schedule(trace, 2) == [0, 2, 1, 5, 6, 3, 4]
    assert schedule(trace, 1) == [0, 1, 6, 2, 5, 3, 4]
    assert in_flight(trace, None) == trace
    with pytest.raises(ValueError, match="concurrency"):
        schedule(trace, 0)


def test_the_optimum_and_the_replay_see_the_reordered_trace(tmp_path: Path) -> None:
    """Three conversations of four turns, interleaved so that each returns after the other two:
    in trace order each conversation's turns come back to back."""
    trace = [request(c, t, 20) for c in range(3) for t in range(1, 5)]
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": r.timestamp,
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + "\n"
            for r in trace
        )
    )
    reordered = trace_requests(path, concurrency=3)
    assert [r.hash_ids[0] for r in reordered[:6]] == [0, 1, 2, 0, 1, 2]
    assert trace_requests(path) == read_trace(path)
    # A conversation's turns share their first block only. One block of cache: in trace order
    # the optimum serves every root of turns 2-4 (9 blocks); round robin over 3 conversations,
    # it holds one conversation's root (3 blocks).
    assert optimal_hit_ratio(read_trace(path), 1).hit_blocks == 9
    assert optimal_hit_ratio(reordered, 1).hit_blocks == 3
    config = parse_config(bundled_config_mapping())
    replay = simulate(config, path, pool_blocks=2, concurrency=3)
    assert replay.concurrency == 3 and replay.requests == 12
    # Pool of 2: LRU keeps the last two roots; round robin over 3 evicts each before its return.
    lru = simulate(
        parse_config({**bundled_config_mapping(), "eviction": "lru"}),
        path,
        pool_blocks=2,
        concurrency=3,
    )
    assert lru.hit_blocks == 0
    assert simulate(config, path, pool_blocks=2).hit_blocks > 0  # back to back: hits


def test_the_sweep_reports_the_optimum_of_the_reordered_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    trace = [request(c, t, 10) for c in range(4) for t in range(1, 4)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"hash_ids": list(r.hash_ids)}) + "\n" for r in trace))
    seen: list[list[tuple[int, ...]]] = []
    real = sweep_module.optimal_hit_ratio

    def spy(requests: list[TraceRequest], capacity: int) -> object:
        seen.append([r.hash_ids for r in requests])
        return real(requests, capacity)

    monkeypatch.setattr(sweep_module, "optimal_hit_ratio", spy)
    config = parse_config(bundled_config_mapping())
    result = sweep_module.sweep(config, path, [5, 20], concurrency=2)
    expected = [r.hash_ids for r in trace_requests(path, concurrency=2)]
    assert seen == [expected, expected] and expected != [r.hash_ids for r in trace]
    assert result.concurrency == 2
    assert "2 conversations in flight" in sweep_module.format_sweep(result)
    for point in result.points:
        assert (
            point.optimal_hit_ratio
            == real(trace_requests(path, concurrency=2), point.pool_blocks).hit_ratio
        )


def test_cli_concurrency_reorders_replay_and_optimum(tmp_path: Path) -> None:
    trace = [request(c, t, 20) for c in range(3) for t in range(1, 5)]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps({"hash_ids": list(r.hash_ids)}) + "\n" for r in trace))

    def run(*args: str) -> str:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvtier",
                "simulate",
                "--trace",
                str(path),
                "--no-progress",
                "--pool-blocks",
                "25",
                *args,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        return done.stdout

    assert "3 conversations in flight" in run("--concurrency", "3", "--policy", "optimal")
    data = json.loads(run("--concurrency", "3", "--policy", "lru", "--json"))
    assert data["concurrency"] == 3 and data["hit_blocks"] == 0
    assert json.loads(run("--policy", "lru", "--json"))["hit_blocks"] > 0
    bad = subprocess.run(
        [sys.executable, "-m", "kvtier", "simulate", "--concurrency", "0"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--concurrency" in bad.stderr
