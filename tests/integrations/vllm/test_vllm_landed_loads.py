"""While an asynchronous load has landed and vLLM has not scheduled its request, the other
lookups defer (``landed_loads``): vLLM 0.25.1's scheduler otherwise stops every pass at a
request that does not fit, in front of the landed loads holding the blocks it needs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from integrations.vllm.test_vllm_policy_hint import request as hinted_request
from kvtier.config import load_config
from kvtier.engine.load_mode import LoadMode
from kvtier.engine.orders import RankReport
from kvtier.engine.planner_settings import PlannerSettings
from kvtier.integrations.vllm import compat
from kvtier.integrations.vllm.landed_loads import PASSES, LandedLoads
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.settings import VllmSettings
from kvtier.keys import Namespace

PROMPT = list(range(100, 117))  # 4 full blocks of 4 tokens, one token to compute


def request(req_id: str, prompt: list[int]) -> SimpleNamespace:
    return hinted_request(req_id, prompt, output=0)


def scheduled(*req_ids: str) -> SimpleNamespace:
    """A scheduler output that ran ``req_ids`` (the attributes ``build_meta`` reads)."""
    return SimpleNamespace(num_scheduled_tokens=dict.fromkeys(req_ids, 1))


def make_side(tmp_path: Path, landed: LandedLoads | None) -> SchedulerSide:
    config = load_config({"pool": {"size": 64 * 16, "shm_dir": str(tmp_path)}})
    settings = VllmSettings(planner=PlannerSettings(load_mode=LoadMode.ASYNC))
    ns = Namespace(model="m", dtype="bfloat16", block_tokens=4)
    side = SchedulerSide(config, settings, ns, 64, 4, 1, (), landed)
    keys = side._request_keys(request("stored", PROMPT))
    assert keys is not None
    side.cache.complete_store(side.cache.prepare_store(keys[:4]).keys)  # the prompt is pooled
    return side


def order_a_load(side: SchedulerSide) -> int:
    """Request ``a`` loads the pooled prompt asynchronously: its job id."""
    a = request("a", PROMPT)
    assert side.matched_tokens(a, 0) == (16, True)
    side.after_alloc(a, [10, 11, 12, 13, 14], 16)
    (order,) = side.build_meta(scheduled()).loads
    assert order.request_id == "a"
    return order.job_id


def land(side: SchedulerSide, job_id: int, ok: bool = True) -> None:
    """The worker reports the load's copy."""
    job = {job_id: 1}
    side.on_worker_meta(RankReport(job) if ok else RankReport({}, job))


def skipped_request(side: SchedulerSide) -> SimpleNamespace:
    """``b``, the same prompt, deferred while ``a``'s load of its blocks runs: vLLM puts it in
    its skipped queue, in front of ``a``."""
    b = request("b", PROMPT)
    assert side.matched_tokens(b, 0) == (None, False)
    return b


@pytest.fixture
def side(tmp_path: Path) -> Iterator[SchedulerSide]:
    side = make_side(tmp_path, LandedLoads())
    yield side
    side.close()


def test_skipped_lookups_defer_until_vllm_schedules_the_landed_request(
    side: SchedulerSide,
) -> None:
    job = order_a_load(side)
    b = skipped_request(side)
    land(side, job)
    assert side.matched_tokens(b, 0) == (None, False)
    assert side.matched_tokens(b, 0) == (None, False)  # asked again in the same pass
    assert side.counters.lookups_deferred_for_landed_loads == 2
    # A request reached after the deferred ``b`` in the same pass waits behind it
    # (``keep_order``): vLLM puts it in its skipped queue too, so it defers to the landed load
    # as well, until vLLM has scheduled ``a``.
    c = request("c", list(range(200, 217)))
    assert side.matched_tokens(c, 0) == (None, False)
    assert side.counters.lookups_held_in_order == 1
    side.build_meta(scheduled())  # a pass that did not schedule ``a``: both still deferred
    assert side.matched_tokens(b, 0) == (None, False)
    assert side.matched_tokens(c, 0) == (None, False)
    assert side.counters.lookups_deferred_for_landed_loads == 4
    side.build_meta(scheduled("a"))
    assert side.matched_tokens(b, 0) == (16, True)  # the pool's blocks, no longer loading
    assert side.matched_tokens(c, 0) == (0, False)


def test_a_request_scheduled_since_its_deferral_is_not_held_back(side: SchedulerSide) -> None:
    job = order_a_load(side)
    b = skipped_request(side)
    side.build_meta(scheduled("b"))  # scheduled since (say, preempted after): not in the queue
    land(side, job)
    assert side.matched_tokens(b, 0) == (16, True)


def test_a_failed_load_lands_too(side: SchedulerSide) -> None:
    """vLLM takes a request whose load failed back the same way (its blocks held meanwhile)."""
    job = order_a_load(side)
    b = skipped_request(side)
    land(side, job, ok=False)
    assert side.matched_tokens(b, 0) == (None, False)


def test_the_deferral_ends_after_a_few_passes(side: SchedulerSide) -> None:
    """A landed request that does not fit stops vLLM's pass whatever the others answer: they
    are not held back for longer."""
    job = order_a_load(side)
    b = skipped_request(side)
    land(side, job)
    for _ in range(PASSES):
        assert side.matched_tokens(b, 0) == (None, False)
        side.build_meta(scheduled())
    assert side.matched_tokens(b, 0) == (16, True)


def test_a_landed_request_that_finishes_defers_nothing(side: SchedulerSide) -> None:
    job = order_a_load(side)
    b = skipped_request(side)
    land(side, job)
    side.request_finished(request("a", PROMPT))  # aborted before vLLM scheduled it again
    assert side.matched_tokens(b, 0) == (16, True)


def test_releases_that_take_requests_holding_blocks_first_defer_nothing(tmp_path: Path) -> None:
    assert compat.strands_landed_loads((0, 25, 1))
    assert not compat.strands_landed_loads((0, 32, 0))
    side = make_side(tmp_path, None)
    try:
        job = order_a_load(side)
        b = skipped_request(side)
        land(side, job)
        assert side.matched_tokens(b, 0) == (16, True)
    finally:
        side.close()
