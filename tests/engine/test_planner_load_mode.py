"""Which loads the engine does not wait for (``PlannerSettings.load_mode``): the rule of
``LoadMode.AUTO``, and that a load order always carries the answer the engine was given last
(an engine told "asynchronous" waits for the request's load to be named finished; an order
without the request's id is never named, and the request would wait forever)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support import require

require.importorskip("torch", "vllm")

from engine.test_planner import (  # noqa: E402
    BLOCK_TOKENS,
    BPS,
    BS,
    RANKS,
    Tables,
    ToyPlanner,
    ToyRequest,
)
from kvtier.config import load_config  # noqa: E402
from kvtier.engine.load_mode import AUTO_STEP_REQUESTS, LoadMode, load_async  # noqa: E402
from kvtier.engine.orders import RankReport  # noqa: E402
from kvtier.engine.planner_settings import PlannerSettings  # noqa: E402
from kvtier.keys import Namespace  # noqa: E402

PROMPT = list(range(100, 133))  # 8 full kvtier blocks of 4 tokens and one token to compute


def test_auto_is_asynchronous_after_a_small_step_for_a_load_as_large_as_what_is_left() -> None:
    small = AUTO_STEP_REQUESTS - 1
    assert load_async(LoadMode.AUTO, hit_tokens=400, left_tokens=400, step_requests=small)
    assert not load_async(LoadMode.AUTO, 400, 401, small)  # more left to compute than loaded
    assert not load_async(LoadMode.AUTO, 400, 10, AUTO_STEP_REQUESTS)  # a full step
    for steps in (0, 5):
        assert load_async(LoadMode.ASYNC, 1, 1000, steps)
        assert not load_async(LoadMode.SYNC, 1000, 1, steps)


@pytest.fixture
def planner(tmp_path: Path) -> Iterator[ToyPlanner]:
    config = load_config({"model": "toy", "pool": {"size": 64 * 1024, "shm_dir": str(tmp_path)}})
    ns = Namespace(model="toy", dtype="uint8", block_tokens=BLOCK_TOKENS, tp_size=RANKS)
    settings = PlannerSettings(blocks_per_slot=BPS, load_mode=LoadMode.AUTO)
    planner = ToyPlanner(config, settings, ns, RANKS * 2 * BPS * 64, BS, RANKS)
    # One request stores the prompt's 8 blocks (both ranks report the store).
    first = ToyRequest("first", PROMPT, blocks=list(range(17)))
    assert planner.matched_tokens(first, 0) == (0, False)
    (store,) = planner.plan_step({"first": len(PROMPT)}, Tables(first=first.blocks), None).stores
    planner.on_report(RankReport({store.job_id: RANKS}))
    planner.request_finished(first)
    yield planner
    planner.close()


def _step(planner: ToyPlanner, requests: int) -> list[object]:
    """An engine step that ran ``requests`` requests; its load orders."""
    running = {f"other{i}": 1 for i in range(requests)}
    return list(planner.plan_step(running, Tables(), None).loads)


def test_auto_loads_asynchronously_after_a_small_step(planner: ToyPlanner) -> None:
    _step(planner, AUTO_STEP_REQUESTS - 1)
    request = ToyRequest("b", PROMPT, blocks=list(range(20, 37)))
    # 32 tokens to load, 1 to compute: asynchronous.
    assert planner.matched_tokens(request, 0) == (32, True)
    planner.after_alloc(request, request.blocks, 32)
    (load,) = _step(planner, 1)
    assert load.request_id == "b"


def test_auto_loads_synchronously_after_a_full_step(planner: ToyPlanner) -> None:
    _step(planner, AUTO_STEP_REQUESTS)
    request = ToyRequest("b", PROMPT, blocks=list(range(20, 37)))
    assert planner.matched_tokens(request, 0) == (32, False)
    planner.after_alloc(request, request.blocks, 32)
    (load,) = _step(planner, AUTO_STEP_REQUESTS)
    assert load.request_id is None


def test_auto_loads_synchronously_what_is_small_beside_the_request(planner: ToyPlanner) -> None:
    _step(planner, 1)
    # The stored prefix and 40 tokens of its own: more to compute than to load.
    request = ToyRequest("b", PROMPT[:32] + list(range(1, 41)), blocks=list(range(20, 38)))
    assert planner.matched_tokens(request, 0) == (32, False)


def test_the_order_follows_the_last_answer_to_the_engine(planner: ToyPlanner) -> None:
    """vLLM asks again each step until it allocates; the step between changes the answer."""
    _step(planner, 1)
    request = ToyRequest("b", PROMPT, blocks=list(range(20, 37)))
    assert planner.matched_tokens(request, 0) == (32, True)
    _step(planner, AUTO_STEP_REQUESTS + 1)  # the request could not be allocated; others ran
    assert planner.matched_tokens(request, 0) == (32, False)
    planner.after_alloc(request, request.blocks, 32)
    (load,) = _step(planner, AUTO_STEP_REQUESTS + 1)
    assert load.request_id is None
    planner.on_report(RankReport({load.job_id: RANKS}))
    planner.request_finished(request)
    # And the other way round.
    again = ToyRequest("c", PROMPT, blocks=list(range(20, 37)))
    assert planner.matched_tokens(again, 0) == (32, False)
    _step(planner, 1)
    assert planner.matched_tokens(again, 0) == (32, True)
    planner.after_alloc(again, again.blocks, 32)
    (load,) = _step(planner, 1)
    assert load.request_id == "c"
