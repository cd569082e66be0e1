"""``HintedPolicy.access_many`` and ``insert_many``: one call touching or inserting a run of keys
decides exactly as ``access`` or ``insert`` of each key in turn, in every state (dead, unranked,
pending and ghost keys, under pressure or not), and the manager's touches and inserts go through
them."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from kvtier.cache.manager import TieredCache
from kvtier.policies import HintedPolicy, RequestHint
from kvtier.pool import HostPool


def key(i: int) -> bytes:
    return i.to_bytes(15, "little") + b"\0"  # sampled: the policy follows it


def state(policy: HintedPolicy) -> tuple[Any, ...]:
    p: Any = policy
    return (
        list(p._lru.items()),
        list(p._dead),
        list(p._ghost),
        list(p._unranked),
        list(p._early.items()),
        list(p._pending),
        list(p._kept.items()),
        list(p._new.items()),
        p.pressure,
    )


@pytest.mark.parametrize("again", [False, True])
def test_access_many_decides_as_access_per_key(again: bool) -> None:
    # ``again``: a run is often touched twice with nothing in between (vLLM asks for a waiting
    # request every step; a first store touches the hits its lookup touched): the second touch
    # changes nothing, found without a touch per key (``_newest``), unranked keys aside.
    for seed in range(40):
        rng = random.Random(seed)
        capacity = rng.choice([8, 24, 64])
        batch, each = HintedPolicy(capacity), HintedPolicy(capacity)
        held: list[bytes] = []
        gone: list[bytes] = []  # evicted: stored again, they leave the ghost history
        nxt = 0
        for _ in range(300):
            op = rng.random()
            if op < 0.3 or not held:  # a request's blocks stored, deepest first
                if gone and rng.random() < 0.3:
                    run = gone[-rng.randint(1, capacity // 2) :]
                    del gone[-len(run) :]
                else:
                    run = [key(nxt + i) for i in range(rng.randint(1, capacity // 2))]
                    nxt += len(run)
                victims = [
                    p.evict(max(0, len(p) + len(run) - capacity), set()) for p in (batch, each)
                ]
                assert victims[0] == victims[1], seed
                gone += [k for k in victims[0] if k not in run]
                batch.insert_many(run[::-1])
                for k in reversed(run):
                    each.insert(k)
                held += run
            elif op < 0.6:  # a run touched, as a load or a store touches it
                start = rng.randrange(len(held))
                run = held[start : start + rng.randint(0, 12)][::-1]  # none: a lookup's miss
                for _ in range(2 if again and rng.random() < 0.7 else 1):
                    batch.access_many(run)
                    for k in run:
                        each.access(k)
                    if again and rng.random() < 0.3:  # stored since: unranked, the newest
                        fresh = [key(nxt)]
                        nxt += 1
                        batch.insert_many(fresh)
                        each.insert(fresh[0])
                        held += fresh
            elif op < 0.85:  # a hint, possibly for keys not stored yet
                start = rng.randrange(len(held))
                keys = held[start : start + rng.randint(1, 12)]
                if rng.random() < 0.3:
                    keys = keys + [key(nxt + i) for i in range(3)]  # hinted before their store
                hint = RequestHint(rng.randint(0, len(keys)), rng.choice([8, 64, 500, None]))
                batch.on_request(keys, hint)
                each.on_request(keys, hint)
            else:  # the stable mode on or off: a request's blocks filed (kept: the hits, new:
                # the rest) and a predicted last request's blocks dead
                on = rng.random() < 0.6
                found, finished = rng.randint(0, 6), rng.randint(0, 2)
                for p in (batch, each):
                    p._switch(on)  # type: ignore[attr-defined]
                    if on:
                        p._file(held[:6], found)  # type: ignore[attr-defined]
                        p._finish(held[:finished])  # type: ignore[attr-defined]
            held = [k for k in held if k in each._lru or k in each._dead or k in each._kept
                    or k in each._new]  # fmt: skip
            assert state(batch) == state(each), seed


def test_a_subclass_that_overrides_access_is_called_per_key() -> None:
    calls: list[bytes] = []

    class Counting(HintedPolicy):
        def access(self, key: bytes) -> None:
            calls.append(key)
            super().access(key)

    policy = Counting(8)
    for i in range(4):
        policy.insert(key(i))
    policy.access_many([key(3), key(1)])
    assert calls == [key(3), key(1)]
    assert list(policy._lru)[-2:] == [key(3), key(1)]  # type: ignore[attr-defined]


def test_the_manager_touches_runs_through_access_many(tmp_path: Path) -> None:
    pool = HostPool.create(16, 64, shm_dir=str(tmp_path))
    runs: list[list[bytes]] = []

    inserted: list[list[bytes]] = []

    class Recording(HintedPolicy):
        def access_many(self, keys: Any) -> None:
            if keys:
                runs.append(list(keys))
            super().access_many(keys)

        def insert_many(self, keys: Any) -> None:
            inserted.append(list(keys))
            super().insert_many(keys)

    cache = TieredCache(pool, Recording(16), record_events=False)
    try:
        keys = [key(i) for i in range(4)]
        reservation = cache.prepare_store(keys)
        cache.complete_store(reservation.keys)
        assert inserted == [keys[::-1]]  # deepest first
        assert cache.prepare_load(keys, "r") and runs == [keys[::-1]]
        cache.prepare_store([*keys[:2], key(9)])
        cache.touch(keys[1:3])
        assert runs[1:] == [keys[1::-1], keys[2:0:-1]]
    finally:
        cache.close()
        pool.close()
