"""Asynchronous loads that ended, until vLLM schedules their requests.

vLLM 0.25.1's scheduler (FCFS) serves its ``skipped_waiting`` queue first and stops its pass at
the first request it cannot allocate blocks for. A request whose asynchronous load is in flight
holds its GPU blocks in that queue (``WAITING_FOR_REMOTE_KVS``) and is taken back into the
schedule only when the pass reaches it after the load ended. A request that a connector deferred
(its lookup answered ``None``) is put in front of it, holding no blocks; once its answer is final
and it does not fit, every pass stops there, before the landed loads that hold the blocks it
needs. With nothing running, nothing ever frees a block: the engine stalls for good (seen in the
scheduler replay at 32 in flight, 8 GiB, ``vllm.async_loads`` auto, kvtier + fs; vLLM issue
45388, pull request 57841). 0.32 drains requests holding KV blocks first.

So while a request's load has landed and vLLM has not scheduled it, kvtier defers the lookups
of the requests in that queue in front of it: those it deferred before and vLLM has not
scheduled since (a request in the main queue is reached only after the whole skipped queue).
The pass skips them and reaches the landed one. For a few passes at most: a landed request that
does not fit stops the pass with or without the others.
"""

from __future__ import annotations

from collections.abc import Iterable

PASSES = 4
"""Scheduling passes a landed load defers the skipped requests' lookups for, unless vLLM
schedules its request first (the next pass does, when nothing else stops it)."""


class LandedLoads:
    """Requests whose asynchronous load ended (copied or failed), not yet scheduled again, and
    the requests deferred since their last scheduling (in vLLM's skipped queue)."""

    def __init__(self, passes: int = PASSES) -> None:
        self.passes = passes
        self._left: dict[str, int] = {}
        """Landed request -> passes it still defers the skipped requests' lookups for."""
        self._skipped: set[str] = set()

    def landed(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self._left[req_id] = self.passes

    def defers(self, req_id: str) -> bool:
        """Whether a lookup of ``req_id`` waits for a landed request to be scheduled first."""
        return bool(self._left) and req_id in self._skipped and req_id not in self._left

    def answered(self, req_id: str, deferred: bool) -> None:
        """A lookup of ``req_id`` was answered; ``deferred``: with None (vLLM skips it)."""
        if deferred:
            self._skipped.add(req_id)

    def after_pass(self, scheduled: Iterable[str]) -> None:
        """A scheduling pass ended (``build_connector_meta``) with ``scheduled`` requests."""
        if not self._left and not self._skipped:
            return
        for req_id in scheduled:
            self._left.pop(req_id, None)
            self._skipped.discard(req_id)
        self._left = {req_id: left - 1 for req_id, left in self._left.items() if left > 1}

    def forget(self, req_id: str) -> None:
        self._left.pop(req_id, None)
        self._skipped.discard(req_id)
