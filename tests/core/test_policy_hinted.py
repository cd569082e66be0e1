"""The hinted policy: segmented without hints, learned classification with them."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from kvtier.config import bundled_config_mapping, parse_config
from kvtier.manager import TieredCache
from kvtier.policies import HintedPolicy, RequestHint, SegmentedPolicy, make_policy
from kvtier.policies import hinted as hinted_module
from kvtier.pool import HostPool
from kvtier.sim.engine_timing import EngineTiming, engine_hit_ratio
from kvtier.sim.simulate import simulate
from kvtier.sim.trace import bundled_trace_path, read_trace


def key(i: int, sampled: bool = True) -> bytes:
    """A 16-byte key; ``sampled`` keys end in a multiple of SAMPLE (the policy follows those)."""
    last = 0 if sampled else 1
    return i.to_bytes(15, "little") + bytes([last])


def request(start: int, n: int) -> list[bytes]:
    return [key(start + i) for i in range(n)]


def test_without_hints_it_evicts_exactly_like_segmented() -> None:
    rng = random.Random(7)
    hinted, segmented = HintedPolicy(50), SegmentedPolicy(50)
    present: set[bytes] = set()
    for _ in range(5000):
        k = key(rng.randrange(200))
        if k in present:
            hinted.access(k)
            segmented.access(k)
        else:
            if len(present) == 50:
                pinned = set(rng.sample(sorted(present), 3))
                victims = hinted.evict(2, pinned)
                assert victims == segmented.evict(2, pinned)
                present.difference_update(victims)
            hinted.insert(k)
            segmented.insert(k)
            present.add(k)
        assert hinted.coldest(60) == segmented.coldest(60)


def learn(policy: HintedPolicy, rounds: int) -> int:
    """Requests of 4 blocks: short outputs (8 tokens) are sent twice, long ones (500) once.
    Returns the next free key number."""
    nxt = 0
    for _ in range(rounds):
        short, long_ = request(nxt, 4), request(nxt + 4, 4)
        nxt += 8
        for keys, output in ((short, 8), (long_, 500)):
            for k in keys:
                policy.insert(k)
            policy.on_request(keys, RequestHint(0, output))
        policy.on_request(short, RequestHint(4, 8))  # the short request comes back
        overflow = len(policy) - policy.capacity
        if overflow > 0:
            policy.evict(overflow, set())
    return nxt


def test_learns_which_outputs_are_reused_and_ranks_new_blocks_by_it() -> None:
    policy = HintedPolicy(1000)
    nxt = learn(policy, 40)
    short_rate = policy.reuse_rate(RequestHint(0, 8), from_end=2)
    long_rate = policy.reuse_rate(RequestHint(0, 500), from_end=2)
    assert short_rate > 0.9 and long_rate < 0.1
    short, long_ = request(nxt, 3), request(nxt + 3, 3)
    for k in [*long_, *short]:
        policy.insert(k)
    policy.on_request(long_, RequestHint(0, 500))
    policy.on_request(short, RequestHint(0, 8))
    # The long request's blocks are dead (out first, after older dead ones), the short one's
    # protected (out last: the older protected blocks are less recent).
    dead = len(policy._dead)
    order = policy.coldest(len(policy))
    assert order[dead - 3 : dead] == long_
    assert list(policy._protected)[-3:] == short
    assert policy.evict(dead, set())[-3:] == long_


def test_unknown_output_and_hit_blocks_are_their_own_classes() -> None:
    policy = HintedPolicy(1000)
    learn(policy, 40)
    # Never seen: the prior (the mean) for unknown outputs, so nothing moves.
    keys = request(10_000, 3)
    for k in keys:
        policy.insert(k)
    policy.on_request(keys, RequestHint(0, None))
    assert policy.coldest(3) != keys  # not demoted to dead
    assert all(k in policy._probation for k in keys)
    # Blocks before hit_blocks were not computed by the request: never classified.
    keys = request(20_000, 3)
    for k in keys:
        policy.insert(k)
    policy.on_request(keys, RequestHint(2, 500))
    assert keys[0] in policy._probation and keys[1] in policy._probation


def test_a_dead_block_used_again_is_protected() -> None:
    policy = HintedPolicy(1000)
    nxt = learn(policy, 40)
    keys = request(nxt, 3)
    for k in keys:
        policy.insert(k)
    policy.on_request(keys, RequestHint(0, 500))
    assert list(policy._dead)[-3:] == keys
    policy.access(keys[0])
    assert keys[0] not in policy._dead
    assert list(policy._protected)[-1] == keys[0]
    policy.remove(keys[1])
    assert len(policy) == policy.coldest(10_000).__len__()
    assert keys[1] not in policy.coldest(10_000)


def test_learning_memory_is_bounded_and_old_counts_fade(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hinted_module, "MIN_FOLLOWED", 64)
    policy = HintedPolicy(8)
    assert policy._follow_limit == 64
    for i in range(300):
        k = key(i)
        policy.insert(k)
        policy.on_request([k], RequestHint(0, 500))
        policy.evict(max(0, len(policy) - 8), set())
        assert len(policy._followed) <= 64
    # 300 followed blocks, halved at each 64: far fewer than 300 counted now.
    assert policy._inserted_total < 128
    assert len(policy._ghost) <= policy.ghost_capacity


def test_unsampled_keys_are_classified_but_not_followed() -> None:
    policy = HintedPolicy(100)
    k = key(1, sampled=False)
    policy.insert(k)
    policy.on_request([k, key(2)], RequestHint(0, 8))
    assert k not in policy._followed


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="capacity"):
        HintedPolicy(0)
    with pytest.raises(ValueError, match="probation_fraction"):
        HintedPolicy(4, probation_fraction=0.0)
    with pytest.raises(ValueError, match="ghost_factor"):
        HintedPolicy(4, ghost_factor=-1.0)
    with pytest.raises(ValueError, match="hit_blocks"):
        RequestHint(-1)
    with pytest.raises(ValueError, match="output_tokens"):
        RequestHint(0, -5)
    assert isinstance(make_policy("hinted", 4), HintedPolicy)


def test_the_manager_passes_hints_to_the_policy(tmp_path: Path) -> None:
    pool = HostPool.create(6, 64, shm_dir=str(tmp_path))
    try:
        policy = HintedPolicy(6)
        cache = TieredCache(pool, policy, record_events=False)
        nxt = learn(HintedPolicy(1000), 0)
        # Teach it through the manager: long-output requests are never sent again.
        for i in range(200):
            keys = request(nxt + 3 * i, 3)
            res = cache.prepare_store(keys)
            cache.complete_store(res.keys)
            cache.hint_request(keys, RequestHint(0, 500 if i % 2 else 8))
            if i % 2 == 0:
                cache.hint_request(keys, RequestHint(3, 8))
        assert policy.reuse_rate(RequestHint(0, 500), 2) < policy.reuse_rate(RequestHint(0, 8), 2)
        cache.check_invariants()
        cache.close()
    finally:
        pool.close()


def test_simulate_hints_the_policy_and_it_beats_segmented() -> None:
    """The replay passes each request's hit run and output length: without them ``hinted`` would
    equal ``segmented`` exactly."""
    base = parse_config(bundled_config_mapping())
    trace = bundled_trace_path()
    ratios = {
        name: simulate(dataclasses.replace(base, eviction=name), trace, pool_blocks=4000).hit_ratio
        for name in ("segmented", "hinted")
    }
    assert ratios["hinted"] > ratios["segmented"] + 0.004


# -- an engine's timing ---------------------------------------------------------------------------


def test_blocks_hinted_before_their_store_are_ranked_when_stored() -> None:
    """vLLM finishes a request (the hint) before it collects the step's finished stores: the
    ranking must wait for the blocks instead of being lost."""
    policy = HintedPolicy(1000)
    nxt = learn(policy, 40)
    short, long_ = request(nxt, 3), request(nxt + 3, 3)
    policy.on_request(long_, RequestHint(0, 500))
    policy.on_request(short, RequestHint(0, 8))
    for k in [*long_, *short]:
        policy.insert(k)
    assert list(policy._dead)[-3:] == long_
    assert list(policy._protected)[-3:] == short
    assert not policy._pending and not policy._early


def test_a_hint_some_requests_after_the_store_still_finds_the_blocks() -> None:
    """Requests in flight: a request's blocks are stored, then three more requests' blocks, then
    its hint. Probation holds 3 blocks here, in flight are 16: the policy learns the lag and
    keeps the request's blocks until its hint ranks them."""
    policy = HintedPolicy(60)
    nxt = learn(policy, 40)
    lag, found = 3, []
    queue: list[tuple[list[bytes], int]] = []
    for i in range(60):
        keys, output = request(nxt, 4), (8 if i % 2 else 500)
        nxt += 4
        policy.evict(max(0, len(policy) + 4 - policy.capacity), set())
        for k in keys:
            policy.insert(k)
        queue.append((keys, output))
        if len(queue) > lag:
            hinted, out = queue.pop(0)
            policy.on_request(hinted, RequestHint(0, out))
            if i >= 20 and out == 8:
                found.append(all(k in policy._protected for k in hinted))
    assert 3 * 4 <= policy.pending_reserve <= policy.capacity // 2
    assert found and all(found)
    assert len(policy) == len(policy.coldest(1000)) <= policy.capacity


def test_pending_blocks_whose_hint_never_comes_are_evicted_first() -> None:
    policy = HintedPolicy(40)
    learn(policy, 10)
    orphans = request(5000, 6)
    for k in orphans:
        policy.insert(k)
    assert all(k in policy._pending for k in orphans)
    # The reserve (the lag learned from hints right after their stores) is 4 blocks here.
    assert policy.pending_reserve == 4
    assert policy.coldest(2) == orphans[:2]
    assert policy.evict(2, set()) == orphans[:2]
    # A hint that comes for an evicted pending block still counts its lag: the reserve grows.
    later = request(6000, 4)
    for k in later:
        policy.insert(k)
    policy.on_request([*orphans, *later], RequestHint(0, 8))
    assert policy.pending_reserve == 10
    assert not policy._pending


def test_engine_timing_on_the_bundled_trace_stays_above_lru() -> None:
    """The bundled trace with an engine's timing: stores of 16 blocks, hints 4 requests late
    (1,000 blocks) or before the last store completed (300 blocks). Ranking blocks only when
    they are still in probation at the hint fell below LRU at 1,000 blocks (0.0782 < 0.0825)
    and below segmented at 300 (0.0194 < 0.0296)."""
    requests = read_trace(bundled_trace_path())
    late = EngineTiming(hint_lag=4, store_chunk=16)
    first = EngineTiming(store_chunk=16, hint_first=True)
    assert engine_hit_ratio(requests, "hinted", 1000, late) > engine_hit_ratio(
        requests, "lru", 1000, late
    )
    assert engine_hit_ratio(requests, "hinted", 300, first) > engine_hit_ratio(
        requests, "segmented", 300, first
    )
    # Without lag the engine replay is the simulate replay.
    assert engine_hit_ratio(requests, "hinted", 1000, EngineTiming()) == pytest.approx(
        0.0883, abs=5e-5
    )


def test_engine_timing_arguments() -> None:
    with pytest.raises(ValueError, match="hint_lag"):
        EngineTiming(hint_lag=-1)
