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
  ones do not keep the interpreter alive. With a ``cut_off`` callback, it is called at
  ``timeout_s`` (to make running tasks return: a tier cuts off its network commands) and the
  pool waits up to ``grace_s`` more before failing and abandoning.

Three options cost nothing when unused:

* **Lines.** ``submit(..., line=Line.FIRST)`` queues ahead of ``Line.NORMAL`` tasks (FIFO within
  each); a long NORMAL task calls ``run_first`` between its steps so that FIRST work does not wait
  for it to end. ``aside_threads`` threads take only ``Line.ASIDE`` tasks: short work (a key check)
  that must never wait behind the others.
* **Thread state.** ``thread_state`` makes a per-thread object (a kept connection) the first time
  a task on that thread asks ``state()``; the pool closes it when the thread ends.

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
from enum import Enum
from typing import Protocol

log = logging.getLogger(__name__)


class Line(Enum):
    """Which queue a task waits in."""

    FIRST = "first"
    """Taken before NORMAL tasks by the pool's threads (a tier's reads: on a request's path)."""
    NORMAL = "normal"
    ASIDE = "aside"
    """Taken only by the ``aside_threads``: short work that never waits behind the others."""


class ThreadState(Protocol):
    """What ``thread_state`` makes: closed by the pool when its thread ends."""

    def close(self) -> None: ...


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
    """``threads`` daemon threads taking FIRST, then NORMAL tasks, and ``aside_threads`` taking
    ASIDE tasks; see the module docstring."""

    def __init__(
        self,
        name: str,
        threads: int,
        stuck_after_s: float,
        *,
        aside_threads: int = 0,
        thread_state: Callable[[], ThreadState] | None = None,
    ) -> None:
        if threads < 1 or aside_threads < 0:
            raise ValueError("a worker pool needs at least one thread and no negative aside count")
        self.name = name
        self.stuck_after_s = stuck_after_s
        self._make_state = thread_state
        self._local = threading.local()
        lock = threading.Lock()
        self._cond = threading.Condition(lock)
        self._aside_cond = threading.Condition(lock)
        """Aside threads wait here: a NORMAL task wakes an I/O thread, never an aside one."""
        self._idle_cond = threading.Condition(lock)
        """``close`` waits here for running tasks to end: a task's end wakes no idle thread
        (each would take the GIL, from the engine's thread too, to find nothing to do)."""
        # Guarded by _cond.
        self._queues: dict[Line, deque[_Task]] = {line: deque() for line in Line}
        self._first = self._queues[Line.FIRST]
        self._busy: list[_Busy | None] = [None] * (threads + aside_threads)
        self._io = threads
        """Threads 0.._io-1 take FIRST and NORMAL tasks, the others ASIDE tasks."""
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, args=(i,), name=f"{name}-{i}", daemon=True)
            for i in range(threads)
        ] + [
            threading.Thread(
                target=self._work, args=(threads + i,), name=f"{name}-aside{i}", daemon=True
            )
            for i in range(aside_threads)
        ]
        for thread in self._threads:
            thread.start()

    # -- the caller's side ----------------------------------------------------------------------

    def submit(
        self,
        run: Callable[[], None],
        fail: Callable[[], None],
        label: str = "",
        line: Line = Line.NORMAL,
        copies: int = 1,
    ) -> bool:
        """Queue ``copies`` tasks of ``run`` in ``line`` (in one hold of the lock, which the
        pool's threads take for every task); False (and nothing queued) when closed, when the
        pool has no aside thread for an ASIDE task, or when every thread that would take it is
        stuck: the caller then fails the work itself. Never blocks on I/O and never raises."""
        now = time.monotonic()
        with self._cond:
            if self._closed or self._all_stuck(now, line is Line.ASIDE):
                return False
            self._queues[line].extend(_Task(run, fail, label, now) for _ in range(copies))
            (self._aside_cond if line is Line.ASIDE else self._cond).notify(copies)
        return True

    def run_first(self) -> None:
        """On a pool thread between the steps of a long task: run the FIRST tasks queued
        meanwhile, so that they wait at most one step. Cheap when none is queued."""
        first = self._first
        while first:  # unlocked peek: a deque's length is read atomically
            with self._cond:
                if not first:
                    return
                task = first.popleft()
            _call(task.run, self.name)

    def state(self) -> ThreadState:
        """This pool thread's state, made by ``thread_state`` on first use (closed by the pool
        when the thread ends). A pool without ``thread_state`` raises ``RuntimeError``."""
        state: ThreadState | None = getattr(self._local, "state", None)
        if state is None:
            if self._make_state is None:
                raise RuntimeError(f"{self.name}: no thread_state")
            state = self._local.state = self._make_state()
        return state

    def expire(self) -> int:
        """Fail (through their ``fail`` callbacks, on this thread) the queued tasks that waited
        longer than ``stuck_after_s``; log threads that became stuck. Cheap when nothing is due:
        call it often (a tier calls it from ``poll``). Returns the number of tasks failed."""
        now = time.monotonic()
        limit = now - self.stuck_after_s
        if not self._due(now, limit):
            return 0
        expired: list[_Task] = []
        with self._cond:
            for queue in self._queues.values():
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
            return sum(len(queue) for queue in self._queues.values())

    def close(
        self, timeout_s: float, cut_off: Callable[[], None] | None = None, grace_s: float = 0.0
    ) -> list[str]:
        """Stop taking work; wait up to ``timeout_s`` for queued and running tasks (then call
        ``cut_off`` and wait up to ``grace_s`` more, when given), then fail the tasks still
        queued and abandon the running ones. Returns the labels of the abandoned tasks (empty
        when everything finished). Idempotent."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            self._aside_cond.notify_all()
            idle = self._wait_idle(deadline)
        if not idle and cut_off is not None:
            _call(cut_off, self.name)
            deadline = time.monotonic() + max(0.0, grace_s)
            with self._cond:
                self._wait_idle(deadline)
        with self._cond:
            leftover = [task for queue in self._queues.values() for task in queue]
            for queue in self._queues.values():
                queue.clear()
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

    def _wait_idle(self, deadline: float) -> bool:
        """Under the lock: wait until nothing is queued or running, or ``deadline``."""
        while any(self._queues.values()) or any(busy is not None for busy in self._busy):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._idle_cond.wait(left)
        return True

    def _due(self, now: float, limit: float) -> bool:
        """Whether ``expire`` has anything to do: a task queued before ``limit`` or a thread
        newly stuck. Read without the lock (a deque's head and a list's items are read
        atomically; what changes meanwhile is seen at the next call): the tier asks every
        engine step, and its I/O threads take the lock for every task."""
        for queue in self._queues.values():
            try:
                if queue[0].queued_at < limit:
                    return True
            except IndexError:
                continue
        stuck_after = self.stuck_after_s
        for busy in self._busy:
            if busy is not None and not busy.stuck and now - busy.since > stuck_after:
                return True
        return False

    def _is_stuck(self, busy: _Busy, now: float) -> bool:
        return now - busy.since > self.stuck_after_s

    def _all_stuck(self, now: float, aside: bool) -> bool:
        """Under the lock: no thread of the line's kind can take new work within
        ``stuck_after_s`` (true for aside work in a pool without aside threads)."""
        threads = self._busy[self._io :] if aside else self._busy[: self._io]
        return all(busy is not None and self._is_stuck(busy, now) for busy in threads)

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
        try:
            self._take_tasks(index)
        finally:
            state: ThreadState | None = getattr(self._local, "state", None)
            if state is not None:
                _call(state.close, self.name)

    def _take_tasks(self, index: int) -> None:
        cond = self._cond
        aside = index >= self._io
        ready = self._aside_cond if aside else cond
        queues = (self._queues[Line.ASIDE],) if aside else (self._first, self._queues[Line.NORMAL])
        while True:
            with cond:
                while not any(queues) and not self._closed:
                    ready.wait()
                queue = next((q for q in queues if q), None)
                if queue is None:
                    return  # closed and nothing left
                task = queue.popleft()
                self._busy[index] = _Busy(task.label, time.monotonic())
            try:
                _call(task.run, self.name)
            finally:
                with cond:
                    busy = self._busy[index]
                    self._busy[index] = None
                    self._idle_cond.notify_all()  # close() waits for idle threads
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
