"""The prefill rate the promotion cost rules measure, under an engine that queues steps (vLLM's
batch queue with asynchronous scheduling): the time between two ``plan_step`` calls is then the
step scheduled one call earlier's, and pairing it with the newest step's tokens overstated the
rate ~20x in the scheduler replay (most fs promotions declined)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support import require

require.importorskip("torch", "vllm")

from engine.test_planner import BPS, BS, RANKS, Tables, ToyPlanner  # noqa: E402
from kvtier.config import load_config  # noqa: E402
from kvtier.engine.planner_settings import PlannerSettings  # noqa: E402
from kvtier.keys import Namespace  # noqa: E402

TOKENS_PER_S = 10_000.0
PREFILL = {"prefill": 2000}
DECODE = {f"decode{i}": 1 for i in range(16)}  # too few tokens to say anything of the rate


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


SCHEDULE_S = 0.0005
"""The scheduler's time per step, after which the device may start it."""


def batch_queue_schedule(steps: list[dict[str, int]], queue: int) -> list[float]:
    """When an engine with ``queue`` steps in flight schedules each step: at once while the
    queue has room, else once the oldest step ended; the device runs the steps one after the
    other, each for its tokens at ``TOKENS_PER_S``."""
    times: list[float] = []
    ends: list[float] = []
    for i, step in enumerate(steps):
        ready = times[-1] + SCHEDULE_S if times else 0.0
        times.append(max(ready, ends[i - queue]) if i >= queue else ready)
        start = max(times[-1] + SCHEDULE_S, ends[-1] if ends else 0.0)
        ends.append(start + sum(step.values()) / TOKENS_PER_S)
    return times


@pytest.fixture
def make_planner(tmp_path: Path) -> Iterator[Callable[[int], ToyPlanner]]:
    made: list[ToyPlanner] = []

    def make(steps_in_flight: int) -> ToyPlanner:
        config = load_config(
            {"model": "toy", "pool": {"size": 64 * 1024, "shm_dir": str(tmp_path)}}
        )
        ns = Namespace(model="toy", dtype="uint8", block_tokens=BS * BPS, tp_size=RANKS)
        settings = PlannerSettings(blocks_per_slot=BPS, steps_in_flight=steps_in_flight)
        planner = ToyPlanner(config, settings, ns, RANKS * 2 * BPS * 64, BS, RANKS)
        made.append(planner)
        return planner

    yield make
    for planner in made:
        planner.close()


def measured_rate(planner: ToyPlanner, queue: int, count: int = 40) -> float | None:
    """The rate the planner's cache measured after ``count`` steps, alternately a prefill and a
    decode, under an engine with ``queue`` steps in flight."""
    clock = Clock()
    planner.cache._clock = clock
    steps = ([PREFILL, DECODE] * count)[:count]
    for step, at in zip(steps, batch_queue_schedule(steps, queue), strict=True):
        clock.now = at
        planner.plan_step(step, Tables(), None)
    return planner.cache._rules.compute.tokens_per_s


@pytest.mark.parametrize("queue", [1, 2, 3])
def test_the_rate_is_the_engines_when_the_planner_knows_its_queue(make_planner, queue) -> None:
    # A synchronous engine's steps include the scheduler's time.
    assert measured_rate(make_planner(queue), queue) == pytest.approx(TOKENS_PER_S, rel=0.1)


@pytest.mark.parametrize("queue", [2, 3])
def test_the_first_rate_measured_is_the_engines(make_planner, queue) -> None:
    # While the queue fills, steps are scheduled a scheduling pass apart: the first step timed
    # by that read 4,000x the rate.
    rate = measured_rate(make_planner(queue), queue, count=queue + 1)
    assert rate == pytest.approx(TOKENS_PER_S, rel=0.1)


def test_a_queued_engine_taken_for_a_synchronous_one_overstates_the_rate(make_planner) -> None:
    rate = measured_rate(make_planner(1), queue=2)
    assert rate is not None
    assert rate > 10 * TOKENS_PER_S  # prefill tokens over a decode step's time


@pytest.mark.parametrize("queue", [1, 2])
def test_the_rules_know_whether_the_running_step_is_shared(make_planner, queue) -> None:
    """A step that runs other requests beside a prefill (``SHARED_WEIGHT``): the step the
    planner reports as running, not the newest scheduled."""
    planner = make_planner(queue)
    compute = planner.cache._rules.compute
    steps = [PREFILL, DECODE, PREFILL, PREFILL]
    shared = []
    for step in steps:
        planner.plan_step(step, Tables(), None)
        shared.append(compute.shared)
    # The step running after each call: the one scheduled ``queue - 1`` calls earlier.
    running = [len(s) > 1 for s in steps]
    expected = running if queue == 1 else [False, *running[:-1]]
    assert shared == expected
