"""``vllm.keep_order``: the requests vLLM asks about after a deferred lookup in the same
scheduling pass are deferred too, so that they cannot take the GPU KV cache room of the one in
front of them (vLLM moves a deferred request aside and schedules the ones behind it)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from integrations.vllm.test_vllm_landed_loads import request, scheduled
from kvtier.config import load_config
from kvtier.engine.planner_settings import PlannerSettings
from kvtier.integrations.vllm.scheduler import HOLD_BEHIND_S, HOLD_BEHIND_STEPS, SchedulerSide
from kvtier.integrations.vllm.settings import VllmSettings
from kvtier.keys import Namespace

SHARED = list(range(100, 117))  # 4 full blocks of 4 tokens, one token to compute
OTHER = list(range(300, 317))


def make_side(tmp_path: Path, keep_order: bool) -> SchedulerSide:
    config = load_config({"pool": {"size": 64 * 64, "shm_dir": str(tmp_path)}})
    settings = VllmSettings(planner=PlannerSettings(), keep_order=keep_order)
    namespace = Namespace(model="m", dtype="bfloat16", block_tokens=4)
    side = SchedulerSide(config, settings, namespace, 64, 4, 1)
    for prompt in (SHARED, OTHER):  # both prompts are in the pool
        keys = side._request_keys(request(f"stored-{prompt[0]}", prompt))
        assert keys is not None
        side.cache.complete_store(side.cache.prepare_store(keys[:4]).keys)
    return side


def deferred_pass(side: SchedulerSide) -> SimpleNamespace:
    """``a`` loads the shared prompt; in the next pass ``b``, the same prompt, is deferred
    while that load runs (loading a block twice would waste engine memory)."""
    a = request("a", SHARED)
    assert side.matched_tokens(a, 0) == (16, False)
    side.after_alloc(a, [10, 11, 12, 13, 14], 16)
    side.build_meta(scheduled("a"))
    b = request("b", SHARED)
    assert side.matched_tokens(b, 0) == (None, False)
    return b


@pytest.mark.parametrize("keep_order", [True, False])
def test_a_request_behind_a_deferred_one_waits_with_keep_order(
    tmp_path: Path, keep_order: bool
) -> None:
    side = make_side(tmp_path, keep_order)
    try:
        deferred_pass(side)
        c = request("c", OTHER)  # its blocks are in the pool, not loading: a hit
        if keep_order:
            assert side.matched_tokens(c, 0) == (None, False)
            assert side.counters.lookups_held_in_order == 1
            assert side.counters.deferred_lookups == 1  # ``b``'s alone
            side.build_meta(scheduled())  # the pass ends: ``c`` is asked again in the next
        assert side.matched_tokens(c, 0) == (16, False)
        assert side.counters.lookups_held_in_order == int(keep_order)
    finally:
        side.close()


def test_the_deferred_request_itself_and_the_next_pass_are_not_held(tmp_path: Path) -> None:
    side = make_side(tmp_path, keep_order=True)
    try:
        b = deferred_pass(side)
        assert side.matched_tokens(b, 0) == (None, False)  # still loading: its own deferral
        assert side.counters.lookups_held_in_order == 0
        side.build_meta(scheduled())
        c = request("c", OTHER)
        assert side.matched_tokens(c, 0) == (16, False)  # asked first in a new pass
        assert side.counters.lookups_held_in_order == 0
    finally:
        side.close()


def test_a_long_wait_holds_no_one(tmp_path: Path) -> None:
    """Without promotion costs, or behind a stuck load, a deferred request can wait for
    ``job_timeout_s``: the requests behind it are held only for ``HOLD_BEHIND_S`` of that."""
    side = make_side(tmp_path, keep_order=True)
    try:
        deferred_pass(side)
        side._deferred_since["b"] -= HOLD_BEHIND_S + 0.1  # ``b`` has waited that long
        assert side.matched_tokens(request("c", OTHER), 0) == (16, False)
        assert side.counters.lookups_held_in_order == 0
    finally:
        side.close()


def test_a_wait_longer_than_two_engine_steps_holds_no_one(tmp_path: Path) -> None:
    """A read from a disk slower than the engine: the requests behind it are held for
    ``HOLD_BEHIND_STEPS`` engine steps of its wait, not all of it (the engine would run only
    the others' decodes meanwhile)."""
    side = make_side(tmp_path, keep_order=True)
    try:
        deferred_pass(side)
        side.cache._rules.compute.step_s = 0.05  # the engine's steps take 50 ms
        side._deferred_since["b"] -= HOLD_BEHIND_STEPS * 0.05 - 0.02  # within the two steps
        assert side.matched_tokens(request("c", OTHER), 0) == (None, False)
        assert side.counters.lookups_held_in_order == 1
        side._deferred_since["b"] -= 0.04  # past them, far below ``HOLD_BEHIND_S``
        assert side.matched_tokens(request("d", OTHER), 0) == (16, False)
        assert side.counters.lookups_held_in_order == 1
    finally:
        side.close()


def test_keep_order_is_on_unless_the_config_turns_it_off() -> None:
    assert VllmSettings.parse({}, tiered=True).keep_order is True
    assert VllmSettings.parse({"keep_order": False}, tiered=True).keep_order is False
