from __future__ import annotations

import logging

from kvtier.cache.write_back import WRITEBACK_RETRY_MIN_S, WriteBack


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_without_write_on_evict_tiers_nothing_becomes_dirty():
    wb = WriteBack([], window=8, max_pause_s=1.0, clock=lambda: 0.0)
    wb.stored([k(1), k(2)])
    assert wb.window == 0
    assert not wb.due()
    assert wb.take_evicted([k(1)], [7]) == ([], [])
    assert not wb.settles(0, holds_slots=False)


def test_evicted_dirty_keys_are_taken_once_with_their_slots():
    wb = WriteBack([1], window=0, max_pause_s=1.0, clock=lambda: 0.0)
    wb.stored([k(1), k(2), k(3)])
    assert wb.take_evicted([k(0), k(2), k(3)], [10, 12, 13]) == ([k(2), k(3)], [12, 13])
    assert wb.take_evicted([k(2), k(3)], [12, 13]) == ([], [])  # clean now
    assert not wb.due()  # window 0: no early copies
    assert not wb.settles(1, holds_slots=False)


def test_coldest_dirty_keys_are_taken_within_the_window():
    wb = WriteBack([0], window=3, max_pause_s=1.0, clock=lambda: 0.0)
    wb.stored([k(1), k(2)])
    asked: list[int] = []

    def coldest(n: int) -> list[bytes]:
        asked.append(n)
        return [k(5), k(2), k(1)]

    assert wb.due()
    assert wb.take_coldest(coldest) == [k(2), k(1)]
    assert asked == [3]
    assert not wb.due()  # nothing dirty left
    assert wb.settles(0, holds_slots=False)
    assert not wb.settles(0, holds_slots=True)  # a copy of evicted keys
    assert not wb.settles(1, holds_slots=False)  # not a write-on-evict tier


def test_failed_copies_are_dirty_again_and_pause_write_back(caplog):
    now = [10.0]
    wb = WriteBack([0], window=4, max_pause_s=0.15, clock=lambda: now[0])
    wb.stored([k(1), k(2), k(3)])
    assert wb.take_coldest(lambda n: [k(1), k(2), k(3)]) == [k(1), k(2), k(3)]
    with caplog.at_level(logging.WARNING, logger="kvtier.cache.write_back"):
        # k(3) left the pool meanwhile: not dirty again
        wb.settle("disk", [k(1), k(2), k(3)], [False, True, False], visible={k(1), k(2)})
        assert "tier disk: 2 of 3 block copies failed; write-back paused" in caplog.text
        assert not wb.due()
        now[0] += WRITEBACK_RETRY_MIN_S
        assert wb.due()
        assert wb.take_coldest(lambda n: [k(1), k(2), k(3)]) == [k(1)]
        wb.settle("disk", [k(1)], [False], visible={k(1)})  # doubles: 0.1 s
        now[0] += 0.09
        assert not wb.due()
        now[0] += 0.01
        assert wb.due()
        wb.take_coldest(lambda n: [k(1)])
        wb.settle("disk", [k(1)], [False], visible={k(1)})  # capped at max_pause_s
        now[0] += 0.15
        assert wb.due()
        assert caplog.text.count("write-back paused") == 1  # warned once per failing spell
        wb.take_coldest(lambda n: [k(1)])
        wb.settle("disk", [k(1)], [True], visible={k(1)})  # success ends the pause
        wb.stored([k(4)])
        assert wb.due()
