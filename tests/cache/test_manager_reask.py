"""A request asked again before the engine allocated it (``TieredCache.lookup_and_pin``): the
pins it holds are kept instead of released and taken again, with the same answers, pins, loads,
promotions and eviction order as releasing them first; a load of another request still defers
it."""

from __future__ import annotations

import random

from support.blocks import keys_for
from support.scripted_tier import ScriptedTier

from kvtier.cache.manager import TierBinding, TieredCache
from kvtier.keys import BlockKey, Namespace
from kvtier.policies import LRUPolicy
from kvtier.pool import HostPool


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class World:
    """A cache over a small pool and a scripted tier; ``plans``: each request's pinned keys."""

    def __init__(self, ns: Namespace, pool: HostPool, tier_keys: list[BlockKey]) -> None:
        self.pool = pool
        self.tier = ScriptedTier("fs", ns, pool)
        self.tier.stored = {k: bytes(pool.slot_bytes) for k in tier_keys}
        self.clock = Clock()
        self.policy = LRUPolicy()
        self.cache = TieredCache(pool, self.policy, [TierBinding(self.tier)], clock=self.clock)
        self.plans: dict[str, list[BlockKey]] = {}

    def store(self, keys: list[BlockKey]) -> None:
        reservation = self.cache.prepare_store(keys)
        self.cache.complete_store(reservation.keys)

    def settle(self) -> None:
        while self.tier.pending:
            self.tier.release()
            self.cache.step()
        self.cache.check_invariants(settled=True)

    def state(self) -> object:
        cache = self.cache
        return (
            dict(cache._pins),
            dict(cache._loading),
            dict(cache._index),
            list(self.policy._order),
            cache.stats().cache,
            [(job.kind, job.keys, job.slots) for job in self.tier.submitted],
        )


def ask_releasing_first(world: World, req: str, keys: list[BlockKey]) -> object:
    """What the planner did before: release the request's pins, look up, pin the hits."""
    cache = world.cache
    cache.release_load(world.plans.pop(req, []))
    result = cache.lookup(keys, req)
    if not result.final:
        return result, []
    slots = cache.prepare_load(keys[: result.hits], req)
    world.plans[req] = keys[: len(slots)]
    return result, slots


def ask_keeping_pins(world: World, req: str, keys: list[BlockKey]) -> object:
    plan = world.plans.pop(req, [])
    result, slots = world.cache.lookup_and_pin(keys, req, len(plan))
    if result.final:
        world.plans[req] = keys[: len(slots)]
    return result, slots


def test_asking_again_keeps_pins_and_decides_as_releasing_them_first(ns, make_pool):
    """Random stores, re-asks, loads of other requests, promotions landing or failing and
    evictions: after every operation both ways have the same answers and the same pins, loads,
    index, eviction order, counters and tier jobs."""
    for seed in range(40):
        rng = random.Random(seed)
        prompts = {
            f"r{i}": keys_for(ns, rng.randrange(3, 14), seed=rng.randrange(4)) for i in range(6)
        }
        every = sorted({k for keys in prompts.values() for k in keys})
        on_tier = [k for k in every if rng.random() < 0.5]
        old, new = (World(ns, make_pool(20), on_tier) for _ in range(2))
        for op in range(120):
            what = rng.random()
            req = rng.choice(sorted(prompts))
            keys = prompts[req]
            if what < 0.4:
                assert ask_releasing_first(old, req, keys) == ask_keeping_pins(new, req, keys)
            elif what < 0.55:
                cut = rng.randrange(1, len(keys) + 1)
                for world in (old, new):
                    world.store(keys[:cut])
            elif what < 0.7:  # the engine allocated it: its load runs and ends
                for world in (old, new):
                    plan = world.plans.pop(req, [])
                    world.cache.complete_load(plan)
                    world.cache.forget(req)
            elif what < 0.8:  # another request loads some of these blocks meanwhile
                cut = rng.randrange(1, len(keys) + 1)
                for world in (old, new):
                    hits = world.cache.lookup(keys[:cut]).hits
                    world.plans[f"other{op}"] = keys[: len(world.cache.prepare_load(keys[:hits]))]
            elif what < 0.9:
                fail, later = set(rng.sample(every, 3)), rng.choice([0.001, 0.5, 40.0])
                for world in (old, new):
                    world.tier.fail_keys = fail
                    world.tier.release()
                    world.clock.now += later
                    world.cache.step()
            else:
                for world in (old, new):
                    for other in [r for r in world.plans if r.startswith("other")]:
                        world.cache.complete_load(world.plans.pop(other))
            assert old.state() == new.state(), (seed, op)
        for world in (old, new):
            for plan in world.plans.values():
                world.cache.release_load(plan)
            for req in prompts:
                world.cache.forget(req)
            world.settle()
        assert old.state() == new.state()


def test_a_load_of_another_request_still_defers_the_request_asked_again(ns, make_pool):
    world = World(ns, make_pool(16), [])
    keys = keys_for(ns, 4)
    world.store(keys)
    result, slots = world.cache.lookup_and_pin(keys, "A")
    assert (result.hits, result.final, len(slots)) == (4, True, 4)
    assert world.cache.lookup_and_pin(keys, "A", held=4)[0].final  # its own pins: final
    other = world.cache.prepare_load(keys[2:])  # B loads the last two blocks
    result, slots = world.cache.lookup_and_pin(keys, "A", held=4)
    assert (result.final, slots) == (False, [])
    assert world.cache._loading == dict.fromkeys(keys[2:], 1)  # A's pins were given up
    world.cache.complete_load(keys[2 : 2 + len(other)])
    world.settle()
