from __future__ import annotations

import logging

from support.blocks import keys_for
from support.scripted_tier import ScriptedTier

from kvtier.cache.tier_jobs import TierJobs
from kvtier.tiers.base import TierJobKind


def test_jobs_settle_by_tier_and_id_and_unknown_ids_are_ignored(ns, make_pool):
    pool = make_pool(8)
    tiers = [ScriptedTier("a", ns, pool), ScriptedTier("b", ns, pool)]
    jobs = TierJobs(tiers, 5.0, clock=lambda: 100.0)
    keys = keys_for(ns, 3)
    assert jobs.submit(0, TierJobKind.READ, keys[:1], [0], False) is None
    assert jobs.submit(1, TierJobKind.WRITE, keys[1:], [1, 2], True) is None
    assert len(jobs) == 2
    assert jobs.any_writes()
    assert jobs.waiting() == {"a": 1, "b": 1}
    read_id, write_id = tiers[0].submitted[0].job_id, tiers[1].submitted[0].job_id
    assert read_id != write_id  # ids are unique across tiers
    assert jobs.settle(1, read_id) is None  # that id is tier a's
    job = jobs.settle(1, write_id)
    assert job is not None and job.keys == keys[1:] and job.holds_slots
    assert job.deadline == 105.0
    assert jobs.settle(1, write_id) is None  # settled once
    assert not jobs.any_writes()
    assert len(jobs) == 1


def test_a_job_its_tier_refuses_is_returned_and_not_open(ns, make_pool):
    pool = make_pool(4)
    tier = ScriptedTier("a", ns, pool)
    tier.raise_on.add("submit")
    jobs = TierJobs([tier], 5.0, clock=lambda: 0.0)
    refused = jobs.submit(0, TierJobKind.WRITE, keys_for(ns, 2), [0, 1], False)
    assert refused is not None and refused.slots == [0, 1]
    assert len(jobs) == 0
    assert tier.counters.errors == 1


def test_late_jobs_are_abandoned_once_and_warned_once_per_late_spell(ns, make_pool, caplog):
    now = [0.0]
    pool = make_pool(8)
    tier = ScriptedTier("slow", ns, pool)
    jobs = TierJobs([tier], 1.0, clock=lambda: now[0])
    keys = keys_for(ns, 3)
    for i in range(3):
        jobs.submit(0, TierJobKind.READ, keys[i : i + 1], [i], False)
    ids = [job.job_id for job in tier.submitted]
    with caplog.at_level(logging.WARNING, logger="kvtier.cache.tier_jobs"):
        assert jobs.time_out(0.99) == []
        late = jobs.time_out(1.0)
        assert [job.keys for job in late] == [keys[:1], keys[1:2], keys[2:]]
        assert jobs.time_out(2.0) == []  # abandoned once
        assert len(jobs) == 3  # still open until the tier reports them
        assert jobs.waiting() == {}
        assert tier.counters.timeouts == 3
        assert caplog.text.count("did not end within job_timeout_s=1 s") == 1
        jobs.settle(0, ids[0])  # an abandoned job ending says nothing about being in time
        assert "end in time again" not in caplog.text
        now[0] = 2.0
        jobs.submit(0, TierJobKind.READ, keys[:1], [3], False)
        jobs.settle(0, tier.submitted[-1].job_id)
        assert caplog.text.count("tier slow: jobs end in time again") == 1
        jobs.submit(0, TierJobKind.READ, keys[:1], [4], False)
        assert len(jobs.time_out(3.0)) == 1
        assert caplog.text.count("did not end within") == 2  # a new late spell
