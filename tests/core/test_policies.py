from __future__ import annotations

import pytest

from kvtier.policies import ARCPolicy, EvictionKind, LRUPolicy, make_policy
from kvtier.policies.admission import AdmissionFilter


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


@pytest.mark.parametrize("kind", list(EvictionKind))
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
