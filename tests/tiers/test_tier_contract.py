"""A plugin tier that breaks the ``Tier`` contract at run time: whatever its ``lookup``, ``poll``
or ``take_evicted`` returns, the manager counts an error in the tier's counters and goes on with
a miss or a failed job; nothing it returns or raises reaches the engine as an exception."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from support.blocks import keys_for
from support.scripted_tier import ScriptedTier

from kvtier.cache.manager import TierBinding, TieredCache
from kvtier.keys import BlockKey, Namespace
from kvtier.policies import LRUPolicy
from kvtier.pool import HostPool
from kvtier.tiers.base import JobResult
from kvtier.tiers.contract import job_flags, job_reports, lookup_flags


class BrokenTier(ScriptedTier):
    """A scripted tier whose answers a test replaces: ``lookup_answer`` maps the keys asked to what
    ``lookup`` returns, ``result_ok`` a job's real flags to the ok-list ``poll`` reports,
    ``poll_answer`` and ``evicted_answer`` replace ``poll`` / ``take_evicted`` outright."""

    def __init__(self, name: str, namespace: Namespace, pool: HostPool) -> None:
        super().__init__(name, namespace, pool)
        self.lookup_answer: Callable[[Sequence[BlockKey]], Any] | None = None
        self.result_ok: Callable[[list[bool]], Any] | None = None
        self.poll_answer: Any = None
        self.evicted_answer: Any = None

    def lookup(self, keys: Sequence[BlockKey]) -> Any:
        if self.lookup_answer is not None:
            return self.lookup_answer(keys)
        return super().lookup(keys)

    def poll(self) -> Any:
        if self.poll_answer is not None:
            return self.poll_answer
        results = super().poll()
        if self.result_ok is None:
            return results
        return [JobResult(r.job_id, self.result_ok(r.ok)) for r in results]

    def take_evicted(self) -> Any:
        if self.evicted_answer is not None:
            return self.evicted_answer
        return super().take_evicted()


def _generator(keys: Sequence[BlockKey]) -> Iterator[bool]:
    return (True for _ in keys)


BAD_LOOKUPS: dict[str, Callable[[Sequence[BlockKey]], Any]] = {
    "None": lambda keys: None,
    "a generator": _generator,
    "too short": lambda keys: [True] * (len(keys) - 1),
    "strings": lambda keys: ["yes"] * len(keys),
    "an int": lambda keys: 3,
    "a dict": lambda keys: dict.fromkeys(keys, True),
}


@pytest.fixture
def setup(
    ns: Namespace, make_pool: Callable[..., HostPool]
) -> tuple[HostPool, BrokenTier, TieredCache]:
    pool = make_pool(8, 64)
    tier = BrokenTier("plugin", ns, pool)
    return pool, tier, TieredCache(pool, LRUPolicy(), [TierBinding(tier)])


def _stored_in_tier(pool: HostPool, tier: BrokenTier, keys: list[BlockKey]) -> None:
    for key in keys:
        tier.stored[key] = bytes(pool.slot_bytes)


@pytest.mark.parametrize("answer", list(BAD_LOOKUPS), ids=str)
def test_a_malformed_lookup_answer_is_a_counted_miss(
    setup: tuple[HostPool, BrokenTier, TieredCache], ns: Namespace, answer: str
) -> None:
    """Before: ``TypeError: 'NoneType' object is not subscriptable`` (or ``object of type
    'generator' has no len()``) escaped ``TieredCache.lookup()``."""
    pool, tier, cache = setup
    keys = keys_for(ns, 3)
    _stored_in_tier(pool, tier, keys)
    tier.lookup_answer = BAD_LOOKUPS[answer]
    assert cache.lookup(keys) == (0, True)
    assert tier.counters.errors == 1
    assert tier.submitted == []  # nothing promoted on an answer that proves nothing


@pytest.mark.parametrize(
    "bad_ok",
    [lambda ok: None, lambda ok: [None] * len(ok), lambda ok: ["ok"] * len(ok), lambda ok: 7],
    ids=["None", "full of None", "strings", "an int"],
)
def test_a_malformed_ok_list_fails_the_job(
    setup: tuple[HostPool, BrokenTier, TieredCache],
    ns: Namespace,
    bad_ok: Callable[[list[bool]], Any],
) -> None:
    """Before: ``TypeError: object of type 'NoneType' has no len()`` (or, for a list of None,
    ``unsupported operand type(s) for +``) escaped ``TieredCache.step()``."""
    pool, tier, cache = setup
    keys = keys_for(ns, 2)
    _stored_in_tier(pool, tier, keys)
    tier.result_ok = bad_ok
    assert cache.lookup(keys) == (0, False)  # a promotion starts
    tier.release()
    assert cache.step() == 1
    assert tier.counters.errors == 1
    assert cache.lookup(keys) == (0, True)  # failed: a miss, not retried at once
    assert cache.stats().cache.promotion_failures == 2
    cache.check_invariants(settled=True)


@pytest.mark.parametrize(
    "reports",
    [
        "results",
        [object()],
        [JobResult("x", [True])],  # type: ignore[arg-type]
        [JobResult([1], [True])],  # type: ignore[arg-type]
        (r for r in ()),
    ],
    ids=["a string", "no results", "a string id", "a list id", "a generator"],
)
def test_a_malformed_poll_answer_is_counted_and_its_jobs_time_out(
    ns: Namespace, make_pool: Callable[..., HostPool], reports: Any
) -> None:
    now = [0.0]
    pool = make_pool(8, 64)
    tier = BrokenTier("plugin", ns, pool)
    cache = TieredCache(pool, LRUPolicy(), [TierBinding(tier)], clock=lambda: now[0])
    keys = keys_for(ns, 2)
    _stored_in_tier(pool, tier, keys)
    assert cache.lookup(keys) == (0, False)
    tier.poll_answer = reports
    assert cache.step() == 0
    assert tier.counters.errors >= 1
    now[0] += 60.0  # past job_timeout_s: the job is given up, the keys become misses
    cache.step()
    assert cache.lookup(keys) == (0, True)


@pytest.mark.parametrize("evicted", [7, [None, 3], (b"k" for _ in range(3)), "keys"])
def test_malformed_evictions_are_counted(
    setup: tuple[HostPool, BrokenTier, TieredCache], evicted: Any
) -> None:
    _pool, tier, cache = setup
    tier.evicted_answer = evicted
    cache.step()
    assert tier.counters.errors == 1
    assert cache.take_events() == []


def test_well_formed_answers_pass_unchanged() -> None:
    answer: list[bool | None] = [True, False, None]
    assert lookup_flags(answer, 3) is answer
    assert lookup_flags((True, None), 2) == [True, None]
    assert lookup_flags([1, 0], 2) is None  # ints are not flags
    assert job_flags([True, False], 2) == [True, False]
    assert job_flags([True, None], 2) is None  # "not known" is no job result


@pytest.mark.parametrize("busy", [float("nan"), float("inf"), -1.0, "0.1", 1, None])
def test_a_busy_time_that_is_no_time_is_left_out(busy: object) -> None:
    result = JobResult(3, [True])
    result.busy_s = busy  # type: ignore[assignment]
    assert job_reports([result]) == ([(3, [True], None)], 0)
    assert job_reports([JobResult(4, [True], 0.25)]) == ([(4, [True], 0.25)], 0)
