"""The CUDA copy backend's transfers and the host-side queue that feeds them to the device.

A submitted transfer waits here (``queued``, a FIFO) until the device has room: fewer than
``max_in_flight`` transfers and ``max_device_ops`` copies and launches enqueued and unfinished
(the driver blocks the host once about 1,000 operations wait in one of its hardware queues). It is
then planned and enqueued and stays ``in flight`` until the backend sees it finished; its job id
then goes to the report lists that ``poll`` hands out, each job exactly once. The queue makes no
CUDA call; the backend drives it.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from kvtier.copy.base import CopyJob, CopyResults
from kvtier.copy.cuda.executor import Program


@dataclass(slots=True)
class Transfer:
    job: CopyJob
    """As submitted; checked and turned into a ``plan.Plan`` when it is enqueued on the
    device."""
    layerwise: bool
    after: int
    """The caller's event the copy waits for before touching engine memory (0: none)."""
    gate_stream: int | None
    """Without ``after``: the caller's stream at submit (0 is the legacy default stream); the
    transfer's first call records an event there and the copy waits for it."""
    stream: int = 0
    done: int = 0
    """Event recorded after the last copy; 0 when none (nothing enqueued, or drained)."""
    program: Program | None = None
    """Its recorded CUDA calls, once planned; it counts as enqueued when the program ran."""
    layer_events: list[int] = field(default_factory=list)
    aux_streams: list[int] = field(default_factory=list)
    """DMA lanes; they join ``stream`` before ``done`` is recorded."""
    shares_streams: bool = False
    """It runs on its staging ring's streams, not on streams of its own from the pool."""
    ops: int = 0
    """Device operations (copies, launches) it counts against ``max_device_ops``."""
    failed: bool = False

    @property
    def job_id(self) -> int:
        return self.job.job_id


class TransferQueue:
    """Queued and in-flight transfers, the device operations they count, and the job ids to
    report. Its lock guards bookkeeping only and is never held across a CUDA call."""

    def __init__(self, max_in_flight: int, max_device_ops: int) -> None:
        self._max_in_flight = max_in_flight
        self._max_device_ops = max_device_ops
        self._lock = threading.Lock()
        self.inflight: dict[int, Transfer] = {}
        """Enqueued on the device (or being enqueued) and not yet reported, oldest first."""
        # A deque, not a dict: a dict of thousands of queued jobs resizes (an O(n) copy, over
        # 100 us at ~5,000 entries) inside some unlucky submit.
        self.queued: deque[Transfer] = deque()
        self._ops = 0
        self._done: list[int] = []
        self._failed: list[int] = []

    def is_in_flight(self, job_id: int) -> bool:
        """Read without the lock: only the backend's thread adds transfers in flight."""
        return job_id in self.inflight

    def report(self, job_id: int, ok: bool) -> None:
        """Report ``job_id`` by the next ``results`` without it ever having been in flight."""
        with self._lock:
            (self._done if ok else self._failed).append(job_id)

    def push(self, transfer: Transfer) -> None:
        with self._lock:
            self.queued.append(transfer)

    def pop_ready(self) -> Transfer | None:
        """The oldest queued transfer if the device has room for it (always when nothing is in
        flight, however large), taken off the queue; else None."""
        with self._lock:
            if not self.queued:
                return None
            transfer = self.queued[0]
            full = (
                len(self.inflight) >= self._max_in_flight
                or self._ops + transfer.ops > self._max_device_ops
            )
            if self.inflight and full:
                return None
            self.queued.popleft()
        return transfer

    def take(self, job_ids: Collection[int]) -> list[Transfer]:
        """These jobs' queued transfers, taken off the queue, room or not."""
        with self._lock:
            taken = [t for t in self.queued if t.job_id in job_ids]
            for transfer in taken:
                self.queued.remove(transfer)
        return taken

    def any_queued(self, job_ids: Collection[int]) -> bool:
        with self._lock:
            return any(t.job_id in job_ids for t in self.queued)

    def oldest(self) -> Transfer | None:
        """The oldest transfer in flight."""
        with self._lock:
            return next(iter(self.inflight.values()), None)

    def get(self, job_id: int) -> Transfer | None:
        with self._lock:
            return self.inflight.get(job_id)

    def find(self, job_ids: Sequence[int]) -> list[Transfer | None]:
        with self._lock:
            return [self.inflight.get(job_id) for job_id in job_ids]

    def in_flight(self) -> list[Transfer]:
        with self._lock:
            return list(self.inflight.values())

    def enqueued(self, transfer: Transfer) -> None:
        """``transfer`` is in flight from now on (its program handed to the device)."""
        with self._lock:
            self.inflight[transfer.job_id] = transfer
            self._ops += transfer.ops

    def finish(self, finished: list[Transfer], release: Callable[[Transfer], None]) -> None:
        """These in-flight transfers are over: ``release`` their resources and report them."""
        with self._lock:
            for transfer in finished:
                del self.inflight[transfer.job_id]
                self._ops -= transfer.ops
                release(transfer)
                (self._failed if transfer.failed else self._done).append(transfer.job_id)

    def results(self) -> CopyResults:
        """The job ids reported since the last call."""
        with self._lock:
            done, failed = self._done, self._failed
            self._done, self._failed = [], []
        return CopyResults(done, failed)

    def counts(self) -> tuple[int, int]:
        """(in flight, queued)."""
        with self._lock:
            return len(self.inflight), len(self.queued)

    def drain(self) -> list[Transfer]:
        """Forget every transfer (at close): queued ones never run; the ones in flight are
        returned, for the caller to wait for and release. Nothing is reported any more."""
        with self._lock:
            self.queued.clear()
            transfers = list(self.inflight.values())
            self.inflight.clear()
        return transfers
