"""The hinted policy: LRU without hints; with them, blocks of classes learned dead go first."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from kvtier.cache.manager import TieredCache
from kvtier.config import bundled_config_mapping, parse_config
from kvtier.policies import DEFAULT_EVICTION, HintedPolicy, LRUPolicy, RequestHint, make_policy
from kvtier.policies import reuse_rates as reuse_rates_module
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


def store(policy: HintedPolicy, keys: list[bytes]) -> None:
    """Store a request's blocks as ``TieredCache.complete_store`` does: deepest first."""
    policy.evict(max(0, len(policy) + len(keys) - policy.capacity), set())
    for k in reversed(keys):
        policy.insert(k)


def learn(policy: HintedPolicy, rounds: int) -> int:
    """Requests of 4 blocks: short outputs (8 tokens) are sent twice, long ones (500) once.
    Returns the next free key number. A block's outcome counts once a pool's worth of new
    blocks came after it: ``rounds`` times 8 blocks must exceed the capacity's quarter."""
    nxt = 0
    for _ in range(rounds):
        short, long_ = request(nxt, 4), request(nxt + 4, 4)
        nxt += 8
        for keys, output in ((short, 8), (long_, 500)):
            store(policy, keys)
            policy.on_request(keys, RequestHint(0, output))
        policy.access(short[0])
        policy.on_request(short, RequestHint(4, 8))  # the short request comes back
    return nxt


def test_without_hints_it_evicts_exactly_like_lru() -> None:
    rng = random.Random(7)
    hinted, lru = HintedPolicy(50), LRUPolicy()
    present: set[bytes] = set()
    for _ in range(5000):
        k = key(rng.randrange(200))
        if k in present:
            if rng.random() < 0.1:
                hinted.remove(k)
                lru.remove(k)
                present.discard(k)
            else:
                hinted.access(k)
                lru.access(k)
        else:
            if len(present) == 50:
                pinned = set(rng.sample(sorted(present), 3))
                victims = hinted.evict(2, pinned)
                assert victims == lru.evict(2, pinned)
                present.difference_update(victims)
            hinted.insert(k)
            lru.insert(k)
            present.add(k)
        assert hinted.coldest(60) == lru.coldest(60)
        assert len(hinted) == len(lru)


def test_learns_which_outputs_are_reused_and_evicts_the_dead_first() -> None:
    policy = HintedPolicy(400)
    nxt = learn(policy, 40)
    short_rate = policy.reuse_rate(RequestHint(0, 8), from_end=2)
    long_rate = policy.reuse_rate(RequestHint(0, 500), from_end=2)
    assert short_rate > 0.8 and long_rate < 0.2
    long_, short = request(nxt, 3), request(nxt + 3, 3)
    store(policy, long_)
    store(policy, short)
    policy.on_request(long_, RequestHint(0, 500))
    policy.on_request(short, RequestHint(0, 8))
    # The long request's blocks are dead (out first, after older dead ones); the short one's stay
    # where LRU has them: the most recent, touched again deepest first (its prefix goes last).
    dead = len(policy._dead)
    order = policy.coldest(len(policy))
    assert order[dead - 3 : dead] == long_
    assert order[-3:] == short[::-1]
    assert policy.evict(dead, set())[-3:] == long_


def test_a_new_class_is_not_judged_before_its_blocks_could_be_reused() -> None:
    """The GPU benchmark's start: a warm-up (4-token outputs, one prompt sent again) and then
    the first turns (64 tokens). Counted as they were followed, a first turn's own blocks made
    its class look dead while it was being ranked: two of four first turns went to the dead
    segment and were evicted before the warm-up's blocks."""
    policy = HintedPolicy(800)  # every test key is followed: 200 of them before one matures
    policy.on_request([], RequestHint(0, 4))  # hints are on: new blocks wait for theirs
    warm, again = request(0, 40), request(0, 41)
    store(policy, warm)
    policy.on_request(warm, RequestHint(0, 4))
    store(policy, again[40:])
    policy.on_request(again, RequestHint(40, 4))
    assert policy.rates.mean() > 0.0  # the warm-up's reuse
    first_turns = [request(100 * (i + 1), 30) for i in range(4)]
    for turn in first_turns:
        store(policy, turn)
        policy.on_request(turn, RequestHint(0, 64))
    assert not policy._dead
    # The warm-up's blocks are the oldest: LRU evicts them first.
    assert set(policy.evict(41, set())) == set(again)


def test_unknown_output_and_hit_blocks_are_not_demoted() -> None:
    policy = HintedPolicy(400)
    nxt = learn(policy, 40)
    # Never seen: the prior (the mean) for unknown outputs, so nothing moves.
    keys = request(nxt, 3)
    store(policy, keys)
    policy.on_request(keys, RequestHint(0, None))
    assert policy.coldest(len(policy))[-3:] == keys[::-1] and not set(keys) & set(policy._dead)
    # Blocks before hit_blocks were not computed by the request: never ranked.
    keys = request(nxt + 3, 3)
    store(policy, keys)
    policy.on_request(keys, RequestHint(2, 500))
    assert not set(keys[:2]) & (set(policy._dead) | set(policy._unranked))


def test_a_dead_block_used_again_goes_back_to_lru() -> None:
    policy = HintedPolicy(400)
    nxt = learn(policy, 40)
    keys = request(nxt, 3)
    store(policy, keys)
    policy.on_request(keys, RequestHint(0, 500))
    assert list(policy._dead)[-3:] == keys
    policy.access(keys[0])
    assert keys[0] not in policy._dead and policy.coldest(len(policy))[-1] == keys[0]
    policy.remove(keys[1])
    policy.remove(keys[0])
    assert len(policy) == len(policy.coldest(10_000))
    assert not {keys[0], keys[1]} & set(policy.coldest(10_000))


def test_a_block_stored_again_after_its_eviction_or_hit_is_not_ranked() -> None:
    policy = HintedPolicy(400)
    nxt = learn(policy, 40)
    keys = request(nxt, 2)
    store(policy, keys)
    assert policy.evict(len(policy), set())[-2:] == keys[::-1]  # into the ghost history
    store(policy, keys)
    policy.on_request(keys, RequestHint(0, 500))
    assert not policy._dead  # a second use: its reuse is known
    hit = request(nxt + 2, 1)
    store(policy, hit)
    policy.access(hit[0])
    policy.on_request(hit, RequestHint(0, 500))
    assert not policy._dead


def test_learning_memory_is_bounded_and_old_counts_fade(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(reuse_rates_module, "MIN_FOLLOWED", 64)
    policy = HintedPolicy(8)
    for i in range(300):
        k = key(i)
        store(policy, [k])
        policy.on_request([k], RequestHint(0, 500))
        assert len(policy.rates) <= 64
    # 300 followed blocks, halved at each 64: far fewer than 300 counted now.
    assert policy.rates._inserted_total < 128
    assert len(policy._ghost) <= policy.ghost_capacity
    assert len(policy._early) == 0 and len(policy._unranked) <= policy.capacity


def test_hints_for_blocks_never_stored_are_bounded() -> None:
    policy = HintedPolicy(10)
    for i in range(50):
        policy.on_request(request(100 * i, 4), RequestHint(0, 8))
    assert len(policy._early) == policy.capacity


def test_unsampled_keys_are_ranked_but_not_followed() -> None:
    policy = HintedPolicy(100)
    k = key(1, sampled=False)
    policy.insert(k)
    policy.on_request([k, key(2)], RequestHint(0, 8))
    assert len(policy.rates) == 0 and k not in policy._unranked


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="capacity"):
        HintedPolicy(0)
    with pytest.raises(ValueError, match="ghost_factor"):
        HintedPolicy(4, ghost_factor=-1.0)
    assert RequestHint(-1) == RequestHint(0)  # no count: nothing known to be cached
    assert RequestHint(0, -5).output_tokens is None  # tests/policies/test_hint_values.py
    assert isinstance(make_policy("hinted", 4), HintedPolicy)
    assert DEFAULT_EVICTION == "hinted"


def test_the_manager_passes_hints_to_the_policy(tmp_path: Path) -> None:
    pool = HostPool.create(6, 64, shm_dir=str(tmp_path))
    try:
        policy = HintedPolicy(6)
        cache = TieredCache(pool, policy, record_events=False)
        # Teach it through the manager: long-output requests are never sent again.
        for i in range(200):
            keys = request(3 * i, 3)
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


def test_simulate_hints_the_policy_and_it_beats_lru() -> None:
    """The replay passes each request's hit run and output length: without them ``hinted``
    would equal ``lru`` exactly."""
    base = parse_config(bundled_config_mapping())
    trace = bundled_trace_path()
    ratios = {
        name: simulate(dataclasses.replace(base, eviction=name), trace, pool_blocks=4000).hit_ratio
        for name in ("lru", "hinted")
    }
    assert ratios["hinted"] > ratios["lru"] + 0.03


# -- an engine's timing ---------------------------------------------------------------------------


def test_blocks_hinted_before_their_store_are_ranked_when_stored() -> None:
    """vLLM finishes a request (the hint) before it collects the step's finished stores: the
    ranking must wait for the blocks instead of being lost."""
    policy = HintedPolicy(400)
    nxt = learn(policy, 40)
    long_, short = request(nxt, 3), request(nxt + 3, 3)
    policy.on_request(long_, RequestHint(0, 500))
    policy.on_request(short, RequestHint(0, 8))
    store(policy, long_)
    store(policy, short)
    assert policy.coldest(len(policy))[-3:] == short[::-1]  # stored deepest first
    assert list(policy._dead)[-3:] == long_  # ranked in the request's order
    assert not policy._unranked and not policy._early


def test_a_late_hint_finds_its_blocks_where_lru_kept_them() -> None:
    """Requests in flight: a request's blocks are stored, then three more requests' blocks, then
    its hint. Until the hint, the blocks are where LRU has them; a hint that never comes leaves
    them there."""
    policy = HintedPolicy(60)
    nxt = learn(policy, 40)
    queue: list[tuple[list[bytes], int]] = []
    for i in range(60):
        keys, output = request(nxt, 4), (8 if i % 2 else 500)
        nxt += 4
        store(policy, keys)
        assert all(k in policy._unranked for k in keys)
        queue.append((keys, output))
        if len(queue) > 3:
            hinted, out = queue.pop(0)
            policy.on_request(hinted, RequestHint(0, out))
            assert all((k in policy._dead) == (out == 500) for k in hinted)
    orphans = [k for keys, _ in queue for k in reversed(keys)]
    assert policy.coldest(len(policy))[-len(orphans) :] == orphans
    assert len(policy) == len(policy.coldest(1000)) <= policy.capacity


def test_every_class_reused_alike_evicts_as_lru() -> None:
    """The vLLM demo's workload: every request is re-sent a few requests later, so no class is
    below the mean and nothing is demoted (a policy with a probation segment evicted the
    re-sent blocks and loaded 25% fewer prompt tokens than LRU there)."""
    hinted, lru = HintedPolicy(40), LRUPolicy()
    for i in range(300):
        new = request(10 * i, 4)
        resent = request(10 * (i - 2), 4) if i >= 2 else []
        victims = []
        for policy in (hinted, lru):
            held = set(policy.coldest(10_000))
            for k in resent:
                if k in held:
                    policy.access(k)
            victims.append(policy.evict(len(policy) + len(new) - 40, set()))
            for k in new:
                policy.insert(k)
        # The same blocks (a request's own blocks go deepest first under hinted).
        assert sorted(victims[0]) == sorted(victims[1])
        hinted.on_request(new, RequestHint(0, 1))
        if resent:
            hinted.on_request(resent, RequestHint(4, 1))
        assert not hinted._dead and not hinted.pressure
        assert set(hinted.coldest(40)) == set(lru.coldest(40))


def test_engine_timing_on_the_bundled_trace_stays_above_lru() -> None:
    """The bundled trace with an engine's timing: stores of 16 blocks, hints 4 requests late, or
    before the last store completed. The version that kept blocks waiting for hints in a reserve
    ahead of everything fell below LRU at 300 blocks with late hints (0.0210 < 0.0255)."""
    requests = read_trace(bundled_trace_path())
    late = EngineTiming(hint_lag=4, store_chunk=16)
    first = EngineTiming(store_chunk=16, hint_first=True)
    for blocks, timing in ((300, late), (1000, late), (300, first)):
        assert engine_hit_ratio(requests, "hinted", blocks, timing) > engine_hit_ratio(
            requests, "lru", blocks, timing
        )
    # Without lag the engine replay is the simulate replay.
    assert engine_hit_ratio(requests, "hinted", 1000, EngineTiming()) == pytest.approx(
        0.0946, abs=5e-5
    )


def test_engine_timing_arguments() -> None:
    with pytest.raises(ValueError, match="hint_lag"):
        EngineTiming(hint_lag=-1)


class PerBlockRanking(HintedPolicy):
    """The ranking as first written: ``_rank`` (follow, then the class's rate) for each block."""

    def _rank_request(self, keys, hint):  # type: ignore[no-untyped-def]
        rates = self.rates
        rates.seen(keys)
        self._hints_seen = True
        n, first = len(keys), min(hint.hit_blocks, len(keys))
        for k in keys[:first]:
            self._unranked.pop(k, None)
        start, mean = reuse_rates_module.first_class(hint), rates.mean()
        for i in range(first, n):
            k, cls = keys[i], reuse_rates_module.block_class(start, n - 1 - i)
            if k in self._unranked:
                del self._unranked[k]
                self._rank(k, cls, mean)
            elif not (k in self._lru or k in self._dead or k in self._ghost):
                self._early[k] = cls
                if len(self._early) > self.capacity:
                    self._early.popitem(last=False)


def test_ranking_a_request_decides_as_ranking_each_block(monkeypatch: pytest.MonkeyPatch) -> None:
    # A class's decision is kept while no followed block changes the rates: a followed block (its
    # class) and a halving (every class, here every 64 followed blocks) must recompute it.
    monkeypatch.setattr(reuse_rates_module, "MIN_FOLLOWED", 64)
    rng = random.Random(5)
    fast, slow = HintedPolicy(300), PerBlockRanking(300)
    nxt = 0
    for r in range(600):  # short outputs are sent again, long ones not: long ones die
        n, drop, output = rng.randrange(1, 40), rng.randrange(8), rng.choice([None, 8, 300])
        keys = [key(nxt + i, sampled=i % 3 > 0) for i in range(n)]
        nxt, hits = nxt + n, rng.randrange(2) * n // 2
        for policy in (fast, slow):
            store(policy, keys)
            policy.on_request(keys, RequestHint(hits, output))
            if output == 8:
                policy.on_request(keys, RequestHint(n, output))
            policy.evict(drop, set())
        assert fast.coldest(400) == slow.coldest(400), r
    assert len(fast._dead) > 0  # some blocks were demoted


class RankedWhenStored(HintedPolicy):
    """A block hinted before its store ranked as it is stored (as first written)."""

    def insert(self, key: bytes) -> None:
        super().insert(key)
        if self._pending:
            self._rank_pending()


def test_blocks_hinted_before_their_store_are_ranked_in_their_request_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The manager stores a run deepest first. Blocks hinted before their store are ranked in
    their request's order all the same (as when each was ranked as it was stored, first to
    last): each followed block lowers its class's rate, and ranked as they come, a class that
    fell below the mark halfway through a run had its leading blocks demoted, which left the
    deeper ones useless (evicted later, never hit without them)."""
    monkeypatch.setattr(reuse_rates_module, "MIN_FOLLOWED", 64)
    rng = random.Random(3)
    in_order, deepest_first = RankedWhenStored(300), HintedPolicy(300)
    nxt, demoted = 0, 0
    for r in range(600):
        n, drop, output = rng.randrange(1, 40), rng.randrange(8), rng.choice([None, 8, 300])
        keys = [key(nxt + i, sampled=i % 3 > 0) for i in range(n)]
        nxt += n
        for policy, order in ((in_order, keys), (deepest_first, keys[::-1])):
            policy.on_request(keys, RequestHint(0, output))  # the hint comes first
            policy.evict(max(0, len(policy) + n - policy.capacity), set())
            for k in order:
                policy.insert(k)
            if output == 8:
                policy.on_request(keys, RequestHint(n, output))
            policy.evict(drop, set())
        assert set(in_order._dead) == set(deepest_first._dead), r
        demoted = max(demoted, len(in_order._dead))
    assert demoted > 0
