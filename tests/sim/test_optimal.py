"""The offline optimum against exhaustive search on small traces, and its speed on a large one."""

from __future__ import annotations

import itertools
import random
import time
from functools import cache

import pytest

from kvtier.sim.optimal import infinite_hit_ratio, optimal_hit_ratio
from kvtier.sim.trace import TraceRequest, bundled_trace_path, read_trace


def leading_run(cached: frozenset[int], ids: tuple[int, ...]) -> int:
    run = 0
    for b in ids:
        if b not in cached:
            break
        run += 1
    return run


def brute_force(requests: list[tuple[int, ...]], capacity: int) -> int:
    """Most prefix hits over every schedule: after each request the cache becomes any subset of
    (cache + the request's blocks) of at most ``capacity`` blocks."""

    @cache
    def best(t: int, cached: frozenset[int]) -> int:
        if t == len(requests):
            return 0
        ids = requests[t]
        hits = leading_run(cached, ids)
        pool = sorted(cached | set(ids))
        top = 0
        for size in range(min(capacity, len(pool)) + 1):
            for keep in itertools.combinations(pool, size):
                top = max(top, best(t + 1, frozenset(keep)))
        return hits + top

    return best(0, frozenset())


def random_prefix_trace(rng: random.Random, n_requests: int, max_len: int) -> list[tuple[int, ...]]:
    """Requests that walk a small prefix tree: ids are prefix-aware, as in Mooncake traces."""
    child: dict[tuple[int, int], int] = {}
    out = []
    for _ in range(n_requests):
        ids, node = [], -1
        for _ in range(rng.randint(1, max_len)):
            branch = rng.randint(0, 1)
            node = child.setdefault((node, branch), len(child))
            ids.append(node)
        out.append(tuple(ids))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_optimum_equals_exhaustive_search(seed: int) -> None:
    rng = random.Random(seed)
    trace = random_prefix_trace(rng, rng.randint(3, 6), 3)
    if len({b for r in trace for b in r}) > 8:
        trace = trace[:4]
    for capacity in range(0, 4):
        result = optimal_hit_ratio(trace, capacity)
        assert result.prefix_consistent
        assert result.hit_blocks == brute_force(trace, capacity), (trace, capacity)


def test_deeper_block_is_evicted_on_ties() -> None:
    # Blocks 0 and 1 (a chain) and 2 are all next used by request 3. Without the depth
    # tie-break the parent 0 could be evicted while its child 1 stays: 0 hits instead of 1.
    trace = [(0, 1), (2,), (0, 1), (2,)]
    assert optimal_hit_ratio(trace, 2).hit_blocks == brute_force(trace, 2)


def test_farthest_block_is_bypassed_and_unused_blocks_are_not_stored() -> None:
    # Capacity 1: block 0 is reused soon, block 5 later: storing 5 would cost the hit on 0.
    trace = [(0,), (5,), (0,), (5,), (7,)]
    result = optimal_hit_ratio(trace, 1)
    assert result.hit_blocks == 1 == brute_force(trace, 1)
    assert result.stored_blocks == 1  # block 0 only: 5 is bypassed, 7 never used again


def test_inconsistent_ids_are_reported() -> None:
    assert not optimal_hit_ratio([(1, 2), (3, 2)], 4).prefix_consistent
    assert optimal_hit_ratio([(1, 2), (1, 2, 3)], 4).prefix_consistent


def test_bounds_on_the_bundled_trace() -> None:
    requests = read_trace(bundled_trace_path())
    ratios = [optimal_hit_ratio(requests, c).hit_ratio for c in (1000, 4000, 16000)]
    infinite = infinite_hit_ratio(requests)
    assert ratios == sorted(ratios)
    assert ratios[-1] <= infinite
    # With room for every block ever used, the optimum is the infinite cache.
    distinct = len({b for r in requests for b in r.hash_ids})
    assert optimal_hit_ratio(requests, distinct).hit_ratio == pytest.approx(infinite)


def test_negative_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity_blocks"):
        optimal_hit_ratio([(1,)], -1)


def test_fast_on_a_100k_request_trace() -> None:
    rng = random.Random(7)
    requests = []
    next_id = 0
    convs: list[list[int]] = []
    for i in range(100_000):
        if convs and rng.random() < 0.6:
            ids = rng.choice(convs)
            ids.extend(range(next_id, next_id + 2))
            next_id += 2
            if len(ids) > 60:
                convs.remove(ids)
        else:
            ids = list(range(next_id, next_id + rng.randint(1, 30)))
            next_id += len(ids)
            convs.append(ids)
            if len(convs) > 500:
                convs.pop(0)
        requests.append(TraceRequest(float(i), 0, 0, tuple(ids)))
    start = time.perf_counter()
    result = optimal_hit_ratio(requests, 20_000)
    elapsed = time.perf_counter() - start
    assert result.requests == 100_000
    assert elapsed < 60, f"{elapsed:.1f} s for {result.blocks} blocks"


def test_simulate_policy_optimal_prints_the_labelled_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvtier.cli import main

    assert main(["simulate", "--policy", "optimal", "--pool-blocks", "4000"]) == 0
    out = capsys.readouterr().out
    expected = optimal_hit_ratio(read_trace(bundled_trace_path()), 4000)
    assert "OFFLINE BOUND" in out and "exact for the prefix hit model" in out
    assert f"hit ratio   {expected.hit_ratio:.4f} ({expected.hit_blocks} of" in out


def test_simulate_policy_choices_follow_the_policies() -> None:
    from kvtier.cli import build_parser
    from kvtier.registry import POLICIES

    parser = build_parser()
    for kind in POLICIES:
        assert parser.parse_args(["simulate", "--policy", kind]).policy == kind
    with pytest.raises(SystemExit):
        parser.parse_args(["simulate", "--policy", "mru"])
