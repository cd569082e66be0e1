from __future__ import annotations

from kvtier.cache.copy_room import LAG_S, CopyRoom


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
    assert room.due(0.0) == []  # no room
    room.ended(2)
    assert room.due(0.0) == [0]
    assert room.take_waiting(0) == [k(4), k(5)]  # the caller copies them: take() holds them
    assert room.take(0, [k(4), k(5)], through=True) == (2, 0)
    assert room.due(0.0) == []


def test_waiting_keys_the_pool_evicts_are_dropped():
    room = CopyRoom(limit=1, through=[0, 1])
    room.take(0, [k(1), k(2), k(3)], through=True)
    room.take(1, [k(1), k(2)], through=True)
    room.take(1, [k(4)], through=True)
    assert room.evicted([k(2), k(9)]) == 2  # waiting for both tiers
    room.ended(1)
    assert room.take_waiting(0) == [k(3)]
    assert room.drop_waiting() == 2  # k(1) and k(4) for tier 1
    assert room.due(0.0) == []


def test_the_limit_halves_while_keys_wait_and_grows_back_once_none_do():
    """Copies in flight pin the pool for nothing while the tier lags behind the stores: in the
    scheduler replay with a disk at a quarter speed (8x4), half the pool pinned so cached 0.66x
    of what the pool alone did."""
    room = CopyRoom(limit=64, through=[0])
    room.take(0, [k(i) for i in range(80)], through=True)  # 16 wait
    room.adapt(0.0)
    room.adapt(LAG_S - 0.01)
    assert room.limit == 64  # not waiting long enough yet
    limits = []
    for second in range(1, 6):
        room.adapt(second * LAG_S)
        limits.append(room.limit)
    assert limits == [32, 16, 8, 8, 8]  # down to an eighth
    room.ended(64)
    assert len(room.take_waiting(0)) == 8  # the limit, not the ceiling
    room.ended(8)
    room.take_waiting(0)
    room.ended(8)
    assert room.due(5 * LAG_S) == []  # nothing waits now
    now = 5 * LAG_S
    room.adapt(now)
    room.adapt(now + 1.0)  # an eighth of the ceiling a second
    assert room.limit == 16
    room.adapt(now + 10.0)
    assert room.limit == 64
