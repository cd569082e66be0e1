from __future__ import annotations

import pytest

from kvtier.policies import ARCPolicy, HintedPolicy, LRUPolicy, SegmentedPolicy, make_policy
from kvtier.policies.admission import AdmissionFilter
from kvtier.registry import POLICIES


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_lru_evicts_oldest_unpinned_first():
    lru = LRUPolicy()
    for i in range(5):
        lru.insert(k(i))
    lru.access(k(0))
    assert lru.evict(2, pinned={k(1)}) == [k(2), k(3)]
    assert len(lru) == 3
    lru.remove(k(4))
    lru.remove(k(99))  # unknown keys are ignored
    assert lru.evict(5, pinned=set()) == [k(1), k(0)]
    assert lru.evict(1, pinned=set()) == []


@pytest.mark.parametrize("kind", POLICIES.names())
def test_all_pinned_gives_no_victims(kind):
    policy = make_policy(kind, 3)
    for i in range(3):
        policy.insert(k(i))
    assert policy.evict(2, pinned={k(0), k(1), k(2)}) == []
    assert len(policy) == 3


def test_arc_resists_a_scan():
    capacity = 10
    arc, lru = ARCPolicy(capacity), LRUPolicy()
    resident: dict[str, set[bytes]] = {"arc": set(), "lru": set()}
    hot = [k(i) for i in range(5)]

    def use(policy, name, key):
        if key in resident[name]:
            policy.access(key)
            return
        if len(resident[name]) >= capacity:
            resident[name].difference_update(policy.evict(1, set()))
        policy.insert(key)
        resident[name].add(key)

    for _ in range(3):  # the hot set is used repeatedly: ARC moves it to T2
        for key in hot:
            use(arc, "arc", key)
            use(lru, "lru", key)
    for i in range(100, 130):  # a one-pass scan of cold keys
        use(arc, "arc", k(i))
        use(lru, "lru", k(i))
    assert set(hot) <= resident["arc"]
    assert not set(hot) & resident["lru"]


def test_arc_ghost_hit_adapts_target():
    arc = ARCPolicy(2)
    arc.insert(k(1))
    arc.insert(k(2))
    assert arc.evict(1, set()) == [k(1)]  # to ghost B1
    p_before = arc.p
    arc.insert(k(1))  # ghost hit in B1: favour recency, goes to T2
    assert arc.p > p_before
    assert len(arc) == 2
    arc.remove(k(1))
    assert len(arc) == 1


def test_admission_counts_offers_and_is_bounded():
    f = AdmissionFilter(min_seen=3, max_tracked=2)
    assert not f.admit(k(1)) and not f.admit(k(1))
    assert f.admit(k(1))
    assert not f.admit(k(2)) and not f.admit(k(3)) and not f.admit(k(4))  # k(2) forgotten
    assert not f.admit(k(2))
    with pytest.raises(ValueError):
        AdmissionFilter(0)


def test_segmented_protects_blocks_used_twice_over_new_ones() -> None:
    policy = SegmentedPolicy(capacity=20, probation_fraction=0.1, ghost_factor=2.0)
    for i in range(20):
        policy.insert(k(i))
    for i in range(5):
        policy.access(k(i))  # second use: protected
    # The probation surplus (15 keys over a target of 2) goes first, oldest first.
    assert policy.evict(3, pinned={k(5)}) == [k(6), k(7), k(8)]
    assert policy.coldest(2) == [k(5), k(9)]
    # Down to its target (2 keys), probation gives victims; then protected, oldest first.
    victims = policy.evict(10, pinned=set())
    assert set(victims).isdisjoint(k(i) for i in range(5))
    assert policy.evict(1, pinned=set()) == [k(0)]
    assert len(policy) == 6


def test_segmented_ghost_sends_a_returning_key_to_protected() -> None:
    policy = SegmentedPolicy(capacity=4, probation_fraction=0.25, ghost_factor=1.0)
    for i in range(4):
        policy.insert(k(i))
    assert policy.evict(1, pinned=set()) == [k(0)]
    policy.insert(k(0))  # stored again after its eviction: remembered by the ghost history
    policy.insert(k(9))
    # Probation holds 1, 2, 3, 9 (surplus 3): they go before the returning key.
    assert policy.evict(4, pinned=set()) == [k(1), k(2), k(3), k(0)]
    assert len(policy) == 1


def test_segmented_ghost_history_is_bounded() -> None:
    policy = SegmentedPolicy(capacity=2, probation_fraction=0.5, ghost_factor=1.5)
    for i in range(10):
        policy.insert(k(i))
        policy.evict(max(0, len(policy) - 2), pinned=set())
    assert len(policy._ghost) == 3
    policy.insert(k(0))  # forgotten long ago: probation, not protected
    assert k(0) in policy._probation


def test_segmented_remove_and_bad_arguments() -> None:
    policy = SegmentedPolicy(capacity=4)
    policy.insert(k(1))
    policy.insert(k(2))
    policy.access(k(2))
    policy.remove(k(1))
    policy.remove(k(2))
    policy.remove(k(3))
    assert len(policy) == 0
    for kwargs in ({"capacity": 0}, {"capacity": 4, "probation_fraction": 1.0}):
        with pytest.raises(ValueError):
            SegmentedPolicy(**kwargs)
    with pytest.raises(ValueError, match="ghost_factor"):
        SegmentedPolicy(4, ghost_factor=-1)


def test_every_eviction_kind_has_its_own_policy_and_unknown_ones_fail() -> None:
    classes = {kind: type(make_policy(kind, 8)) for kind in POLICIES}
    assert classes == {
        "arc": ARCPolicy,
        "hinted": HintedPolicy,
        "lru": LRUPolicy,
        "segmented": SegmentedPolicy,
    }
    with pytest.raises(ValueError, match=r"one of .arc., .hinted., .lru., .segmented. or"):
        make_policy("mru", 8)
