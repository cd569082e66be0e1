"""Which loads the engine does not wait for in its step (``PlannerSettings.load_mode``; vLLM's
``vllm.async_loads``): an asynchronous load's request waits for its blocks while the others run
(``CopyOrder.request_id``), a synchronous load is done before the step's forward pass."""

from __future__ import annotations

from enum import Enum


class LoadMode(Enum):
    """Which loads are asynchronous."""

    SYNC = "sync"
    """None: the step's forward pass waits for the step's loads."""
    ASYNC = "async"
    """Every load."""
    AUTO = "auto"
    """Per request (``load_async``)."""


AUTO_STEP_REQUESTS = 3
"""``LoadMode.AUTO`` makes a load asynchronous only after a step that ran fewer requests than
this, and only one of at least as many tokens as the request computes after it."""


def load_async(mode: LoadMode, hit_tokens: int, left_tokens: int, step_requests: int) -> bool:
    """Whether a load of ``hit_tokens`` is asynchronous, the request having ``left_tokens`` to
    compute after it and the engine's last step ``step_requests`` requests.

    ``AUTO``, from the scheduler replay of the GPU grid (``benchmarks/scheduler_replay.py``, vLLM
    0.25.1): synchronous loads keep a closed loop of conversations in lockstep (requests that
    start in one step end in one, and the next turns arrive together and share one long prefill
    step: vLLM alone's schedule, TTFT p50 1.5-1.9x native's at 4 conversations in flight), while
    an asynchronous load's request holds its GPU blocks and comes back steps later, which costs
    where the GPU's KV cache is the bottleneck (8 and 16 in flight: tokens/s, cached tokens, p99).
    A small step is where requests just ended together; a load at least the size of what is left
    to compute is where waiting for it in the step delays the others most for the least of the
    request's own work. See docs/vllm.md for the figures.
    """
    if mode is LoadMode.AUTO:
        return step_requests < AUTO_STEP_REQUESTS and hit_tokens >= left_tokens
    return mode is LoadMode.ASYNC
