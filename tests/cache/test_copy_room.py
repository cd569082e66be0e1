from __future__ import annotations

from kvtier.cache.copy_room import CopyRoom


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_copies_beyond_the_room_wait_in_order_or_are_left_out():
    room = CopyRoom(limit=3, through=[0])
    assert room.admits(3) and not room.admits(4)
    assert room.counts(0, holds_slots=False) and room.counts(1, holds_slots=True)
    assert not room.counts(1, holds_slots=False)  # an early copy to a write-on-evict tier
    assert room.take(0, [k(1), k(2)], through=True) == (2, 0)
    assert room.take(0, [k(3), k(4), k(5)], through=True) == (1, 0)  # k(4), k(5) wait
    assert room.take(1, [k(6), k(7)], through=False) == (0, 2)  # evicted: nothing can wait
    room.started(1)  # the shared pool's copies count, unbounded
    assert room.held == 4
    room.ended(1)
    assert room.due() == []  # no room
    room.ended(2)
    assert room.due() == [0]
    assert room.take_waiting(0) == [k(4), k(5)]  # the caller copies them: take() holds them
    assert room.take(0, [k(4), k(5)], through=True) == (2, 0)
    assert room.due() == []


def test_waiting_keys_the_pool_evicts_are_dropped():
    room = CopyRoom(limit=1, through=[0, 1])
    room.take(0, [k(1), k(2), k(3)], through=True)
    room.take(1, [k(1), k(2)], through=True)
    room.take(1, [k(4)], through=True)
    assert room.evicted([k(2), k(9)]) == 2  # waiting for both tiers
    room.ended(1)
    assert room.take_waiting(0) == [k(3)]
    assert room.drop_waiting() == 2  # k(1) and k(4) for tier 1
    assert room.due() == []
