"""The planner's stats file (``vllm.stats_path``), written on a thread of its own.

The engine's scheduler thread only hands over a snapshot: a call that builds the stats dict from
parts it copied (``Planner.stats_snapshot``); building the dict, encoding it and writing the
file (``safe_files.write_atomic``: a private, atomic replace that never opens what someone
planted at the name) happen here. On the step they cost milliseconds, a p99 spike of the
connector's time per step. Only the newest snapshot is kept (a slow disk skips snapshots, it
never queues them), written at most once per ``interval_s`` and at the latest ``interval_s``
after it was offered: the last steps of a burst reach the file even when no step follows (an
idle engine makes none, so a write waiting for the next step left the file stale). Shutdown
writes at once (``offer(now=True)``, ``close``), before the slow parts of closing: vLLM kills
an engine process that is not done 5 s after it asked it to stop.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.safe_files import write_atomic
from kvtier.stats_report import STATS_MAX_BYTES

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
CLOSE_WAIT_S = 5.0
"""``close`` waits this long for the last write (a hung filesystem must not hang shutdown)."""


Snapshot = Callable[[], dict[str, Any]]
"""Builds one stats dict; called on the writer's thread, so it must read only what it owns."""


class StatsFile:
    def __init__(
        self, path: str, interval_s: float = INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.path = path
        self._interval_s = interval_s
        self._clock = clock
        self._offered_at: float | None = None
        self._written_at: float | None = None
        self._latest: Snapshot | None = None
        self._urgent = False
        self._wake = threading.Condition()
        self._closing = False
        self._failing = False
        self._thread: threading.Thread | None = None

    def due(self) -> bool:
        """Whether a snapshot is wanted now (one per ``interval_s``)."""
        last = self._offered_at
        return last is None or self._clock() - last >= self._interval_s

    def offer(self, snapshot: Snapshot, *, now: bool = False) -> None:
        """Hand over a snapshot; returns at once. ``now``: write it without the wait between
        writes (shutdown)."""
        self._offered_at = self._clock()
        with self._wake:
            self._latest = snapshot
            self._urgent = self._urgent or now
            self._wake.notify()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvtier-stats", daemon=True)
            self._thread.start()

    def close(self, snapshot: Snapshot) -> None:
        """Write ``snapshot`` last and stop (waits at most ``CLOSE_WAIT_S``)."""
        self.offer(snapshot, now=True)
        with self._wake:
            self._closing = True
            self._wake.notify()
        assert self._thread is not None
        self._thread.join(CLOSE_WAIT_S)

    def _run(self) -> None:
        while True:
            with self._wake:
                while self._latest is None and not self._closing:
                    self._wake.wait()
                while self._latest is not None and not (self._closing or self._urgent):
                    if self._written_at is None:
                        break
                    left = self._written_at + self._interval_s - self._clock()
                    if left <= 0:
                        break
                    self._wake.wait(left)  # a newer snapshot may replace it meanwhile
                snapshot, self._latest = self._latest, None
                self._urgent = False
                closing = self._closing
            if snapshot is not None:
                self._written_at = self._clock()
                self._write(snapshot)
            if closing and snapshot is None:
                return

    def _write(self, snapshot: Snapshot) -> None:
        try:
            write_atomic(self.path, json.dumps(snapshot(), indent=1).encode(), STATS_MAX_BYTES)
        except (OSError, ValueError) as exc:
            if not self._failing:  # once per run of failures, not once a second
                log.error("cannot write kvtier stats to %s: %s", self.path, describe(exc))
            self._failing = True
            return
        if self._failing:
            log.warning("kvtier stats are written to %s again", self.path)
        self._failing = False


def describe(exc: Exception) -> str:
    return str(getattr(exc, "strerror", None) or exc)
