"""The eviction order of a request's blocks: a prefix's deepest blocks go before its leading ones.

A prefix hit needs a conversation's leading blocks; its deeper blocks without them are never hit.
So the manager touches and inserts a run of a request's blocks deepest first: a pool that evicts
part of a conversation keeps a usable prefix of it (vLLM's CPU offloading touches in the same
order). Before, it touched and stored first to last, and every eviction that took part of a
conversation took its head and left the rest useless.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from support.blocks import keys_for

from kvtier.cache.manager import TieredCache
from kvtier.keys import BlockKey
from kvtier.policies import ARCPolicy, HintedPolicy, LRUPolicy, RequestHint, SegmentedPolicy
from kvtier.policies.base import EvictionPolicy

BLOCKS = 4
"""Blocks of a conversation's prefix; the pools below hold one and a half of them."""
POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {
    "lru": lambda _: LRUPolicy(),
    "hinted": HintedPolicy,
    "arc": ARCPolicy,
    "segmented": SegmentedPolicy,
}


def store(cache: TieredCache, keys: list[BlockKey]) -> None:
    reservation = cache.prepare_store(keys)
    cache.complete_store(reservation.keys)


def load(cache: TieredCache, keys: list[BlockKey]) -> int:
    """Load the leading hits of ``keys`` (pinned, copied, unpinned); how many there were."""
    hits = cache.lookup(keys).hits
    slots = cache.prepare_load(keys[:hits])
    cache.complete_load(keys[: len(slots)])
    return hits


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_a_store_that_evicts_part_of_a_conversation_leaves_its_leading_blocks(kind, ns, make_pool):
    slots = BLOCKS * 3 // 2
    cache = TieredCache(make_pool(slots), POLICIES[kind](slots))
    a, b = keys_for(ns, BLOCKS, seed=1), keys_for(ns, BLOCKS, seed=2)
    store(cache, a)
    store(cache, b)  # evicts half of a: its tail
    assert cache.lookup(a).hits == BLOCKS // 2  # 0 when the head went first
    assert cache.lookup(b).hits == BLOCKS


@pytest.mark.parametrize("hints", [False, True], ids=["no hints", "late hints"])
@pytest.mark.parametrize("kind", ["lru", "hinted"])
def test_loads_evict_a_conversation_tail_first(kind, hints, ns, make_pool):
    """Two conversations stored and loaded, then a third store evicts: what stays of the
    conversation it evicts is its leading blocks. ``hinted`` with its hints late (after another
    request's stores, as an engine gives them) does not order a request's blocks itself (below
    the pressure it never reaches here): the manager's order is what counts."""
    slots = BLOCKS * 3 // 2
    policy = POLICIES[kind](slots)
    cache = TieredCache(make_pool(slots), policy)
    a, b, c = (keys_for(ns, n, seed=s) for s, n in ((1, BLOCKS), (2, 2), (3, 2)))
    store(cache, a)
    store(cache, b)  # the pool is full
    if hints:
        cache.hint_request(a, RequestHint(0, 16))  # late: b was stored since
    assert load(cache, a) == BLOCKS
    assert load(cache, b) == 2  # a is now the least recently used
    if hints:
        cache.hint_request(b, RequestHint(2, 16))
    store(cache, c)  # evicts two blocks of a
    assert not getattr(policy, "pressure", False)
    assert [cache.lookup([key]).hits for key in a] == [1, 1, 0, 0]  # [0, 0, 1, 1] before
    assert load(cache, a) == 2
    assert cache.lookup(b).hits == 2
