"""The ledger settles a copy job once every tensor-parallel rank reported it."""

from __future__ import annotations

import pytest

from kvtier.copy.base import Direction
from kvtier.engine.ledger import JobLedger
from kvtier.engine.orders import RankReport


def test_a_job_settles_when_every_rank_reported_it() -> None:
    ledger = JobLedger(ranks=2)
    store = ledger.open(Direction.STORE, [b"a"])
    load = ledger.open(Direction.LOAD, [b"b", b"c"])
    assert (store, load) == (0, 1) and len(ledger) == 2
    assert ledger.settle(RankReport({store: 1, load: 1})) == []  # one rank of two
    settled = ledger.settle(RankReport({load: 1}, {store: 1}))
    assert [(s.job_id, s.direction, s.keys, s.ok) for s in settled] == [
        (load, Direction.LOAD, [b"b", b"c"], True),
        (store, Direction.STORE, [b"a"], False),  # one failed share fails the job
    ]
    assert len(ledger) == 0


def test_merged_reports_count_every_rank_and_late_reports_are_ignored() -> None:
    ledger = JobLedger(ranks=4)
    job = ledger.open(Direction.LOAD, [b"k"])
    merged = RankReport({job: 1}).merged(RankReport({job: 2}, {}))
    assert merged == RankReport({job: 3}, {})
    assert ledger.settle(merged) == []
    (settled,) = ledger.settle(RankReport({}, {job: 1}))
    assert not settled.ok
    assert ledger.settle(RankReport({job: 1})) == []  # already settled: nothing again
    assert ledger.settle(RankReport({99: 4})) == []  # never opened
    assert ledger.open(Direction.STORE, []) == job + 1  # ids are not reused


def test_a_ledger_needs_a_rank() -> None:
    with pytest.raises(ValueError, match="ranks"):
        JobLedger(ranks=0)
