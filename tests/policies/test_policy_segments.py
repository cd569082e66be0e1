from __future__ import annotations

from collections import OrderedDict

import pytest

from kvtier.policies.segments import oldest_unpinned, remember_evicted, segment_sizes, take


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_segment_sizes_and_errors_name_the_option():
    assert segment_sizes("segmented", 100, 0.05, 4.0) == (5, 400)
    assert segment_sizes("hinted", 3, 0.05, 0.0) == (1, 0)  # probation keeps at least one
    with pytest.raises(ValueError, match="hinted policy capacity must be positive, got 0"):
        segment_sizes("hinted", 0, 0.05, 4.0)
    for fraction in (0.0, 1.0):
        with pytest.raises(ValueError, match=r"probation_fraction must be in \(0, 1\)"):
            segment_sizes("segmented", 10, fraction, 4.0)
    with pytest.raises(ValueError, match=r"ghost_factor must be >= 0, got -0\.5"):
        segment_sizes("segmented", 10, 0.5, -0.5)


def test_take_moves_the_oldest_unpinned_keys():
    order: OrderedDict[bytes, None] = OrderedDict((k(i), None) for i in range(5))
    assert oldest_unpinned(order, 2, {k(0)}) == [k(1), k(2)]
    assert len(order) == 5  # only looked at
    victims = [k(9)]
    take(order, 3, {k(1), k(3)}, victims)
    assert victims == [k(9), k(0), k(2), k(4)]
    assert list(order) == [k(1), k(3)]
    take(order, 2, {k(1), k(3)}, victims)  # all pinned: nothing moves
    assert list(order) == [k(1), k(3)]


def test_the_ghost_history_forgets_its_oldest_beyond_capacity():
    ghost: OrderedDict[bytes, None] = OrderedDict()
    remember_evicted(ghost, [k(1), k(2), k(3)], 2)
    assert list(ghost) == [k(2), k(3)]
    remember_evicted(ghost, [k(4)], 0)  # no history
    assert list(ghost) == [k(2), k(3)]


def test_a_key_remembered_again_keeps_its_place_in_the_ghost_history():
    ghost: OrderedDict[bytes, None] = OrderedDict()
    remember_evicted(ghost, [k(1), k(2)], 3)
    remember_evicted(ghost, [k(3), k(1), k(4)], 3)  # k(1) is not made newer: k(1) goes first
    assert list(ghost) == [k(2), k(3), k(4)]
