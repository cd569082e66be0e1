"""A bounded pool of I/O threads that stays usable when some of its threads hang.

Python cannot interrupt a thread stuck in a system call (a read from a hung NFS server, an
``open`` that waits on a FIFO), so the pool does not try to. Instead it bounds what a stuck thread
can cost:

* The number of threads is fixed; a stuck thread is never replaced, so stuck I/O cannot pile up
  threads (or file descriptors, or pool slots) without limit.
* A thread busy on one task for longer than ``stuck_after_s`` counts as stuck (``stuck``, logged
  once when it gets stuck and once when it comes back).
* ``submit`` refuses new work at once while every thread is stuck, and ``expire`` fails tasks that
  waited in the queue longer than ``stuck_after_s``: work is failed fast instead of queueing
  forever behind stuck threads. A refused or expired task's ``fail`` callback runs instead of its
  ``run`` (on the caller's thread), so its owner can report it.
* ``close(timeout_s)`` lets queued tasks run and returns within ``timeout_s``: what is still queued
  then is failed, what is still running is abandoned (logged). Threads are daemons, so abandoned
  ones do not keep the interpreter alive.

What a task may touch after its owner gave up on it is the owner's business: a task that is
running is never reported as failed by the pool, only tasks that never started.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Task:
    run: Callable[[], None]
    fail: Callable[[], None]
    label: str
    queued_at: float


@dataclass(slots=True)
class _Busy:
    label: str
    since: float
    stuck: bool = False
    """Already logged as stuck (log once per episode)."""


class WorkerPool:
    """``threads`` daemon threads taking tasks from one queue; see the module docstring."""

    def __init__(self, name: str, threads: int, stuck_after_s: float) -> None:
        if threads < 1:
            raise ValueError("a worker pool needs at least one thread")
        self.name = name
        self.stuck_after_s = stuck_after_s
        self._cond = threading.Condition()
        # Guarded by _cond.
        self._queue: deque[_Task] = deque()
        self._busy: list[_Busy | None] = [None] * threads
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, args=(i,), name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    # -- the caller's side ----------------------------------------------------------------------

    def submit(self, run: Callable[[], None], fail: Callable[[], None], label: str = "") -> bool:
        """Queue ``run``; False (and nothing queued) when closed or every thread is stuck: the
        caller then fails the work itself. Never blocks on I/O and never raises."""
        now = time.monotonic()
        with self._cond:
            if self._closed or self._all_stuck(now):
                return False
            self._queue.append(_Task(run, fail, label, now))
            self._cond.notify()
        return True

    def expire(self) -> int:
        """Fail (through their ``fail`` callbacks, on this thread) the queued tasks that waited
        longer than ``stuck_after_s``; log threads that became stuck. Cheap when nothing is due:
        call it often (a tier calls it from ``poll``). Returns the number of tasks failed."""
        now = time.monotonic()
        limit = now - self.stuck_after_s
        expired: list[_Task] = []
        with self._cond:
            queue = self._queue
            while queue and queue[0].queued_at < limit:
                expired.append(queue.popleft())
            self._note_stuck(now)
        for task in expired:
            _call(task.fail, self.name)
        return len(expired)

    @property
    def stuck(self) -> int:
        """Threads busy on one task for longer than ``stuck_after_s``."""
        now = time.monotonic()
        with self._cond:
            return sum(1 for busy in self._busy if busy is not None and self._is_stuck(busy, now))

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue)

    def close(self, timeout_s: float) -> list[str]:
        """Stop taking work; wait up to ``timeout_s`` for queued and running tasks, then fail the
        tasks still queued and abandon the running ones. Returns the labels of the abandoned tasks
        (empty when everything finished). Idempotent."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            while self._queue or any(busy is not None for busy in self._busy):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            leftover = list(self._queue)
            self._queue.clear()
            abandoned = [busy.label for busy in self._busy if busy is not None]
        for task in leftover:
            _call(task.fail, self.name)
        for thread in self._threads:
            # Threads with nothing left exit at once; stuck ones are not waited for.
            if thread is not threading.current_thread():
                thread.join(max(0.0, min(0.05, deadline - time.monotonic())))
        if leftover or abandoned:
            log.warning(
                "%s: closed after %.1f s with %d queued task(s) failed and %d abandoned on stuck "
                "threads: %s",
                self.name,
                timeout_s,
                len(leftover),
                len(abandoned),
                ", ".join(abandoned) or "-",
            )
        return abandoned

    # -- internals ------------------------------------------------------------------------------

    def _is_stuck(self, busy: _Busy, now: float) -> bool:
        return now - busy.since > self.stuck_after_s

    def _all_stuck(self, now: float) -> bool:
        """Under the lock: no thread can take new work within ``stuck_after_s``."""
        return all(busy is not None and self._is_stuck(busy, now) for busy in self._busy)

    def _note_stuck(self, now: float) -> None:
        """Under the lock: log each thread once when it becomes stuck."""
        for i, busy in enumerate(self._busy):
            if busy is not None and not busy.stuck and self._is_stuck(busy, now):
                busy.stuck = True
                log.warning(
                    "%s-%d: stuck for %.1f s on %s (I/O that does not return; the thread takes no "
                    "new work until it does)",
                    self.name,
                    i,
                    now - busy.since,
                    busy.label or "a task",
                )

    def _work(self, index: int) -> None:
        cond = self._cond
        while True:
            with cond:
                while not self._queue and not self._closed:
                    cond.wait()
                if not self._queue:
                    return  # closed and nothing left
                task = self._queue.popleft()
                self._busy[index] = _Busy(task.label, time.monotonic())
            try:
                _call(task.run, self.name)
            finally:
                with cond:
                    busy = self._busy[index]
                    self._busy[index] = None
                    cond.notify_all()  # close() waits for idle threads
                if busy is not None and busy.stuck:
                    log.warning(
                        "%s-%d: came back after %.1f s",
                        self.name,
                        index,
                        time.monotonic() - busy.since,
                    )


def _call(fn: Callable[[], None], name: str) -> None:
    """Run a task callback; an exception is logged, never raised into the pool or the caller."""
    try:
        fn()
    except Exception:
        log.exception("%s: a task failed", name)
