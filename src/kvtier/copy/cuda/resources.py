"""The CUDA copy backend's device resources: pools of streams and events, the pinned host pool and
the staging rings (device buffers and the streams staged transfers share), each created at
registration and destroyed by ``close``. Creating them later costs: a stream can take milliseconds
to create (once 158 ms), and about 1,100 streams per process failed with
``cudaErrorAlreadyMapped``; an event's creation can wait for the driver's lock while the executor
is inside a long call."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kvtier.copy.cuda.plan import ONE_PIECE, PinnedPieces
from kvtier.copy.cuda.runtime import (
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED,
    CUDA_SUCCESS,
    CudaError,
    CudaRuntime,
)
from kvtier.errors import PoolError
from kvtier.pool import HostPool

log = logging.getLogger(__name__)


class ResourceStats(NamedTuple):
    streams_created: int
    streams_idle: int
    events_created: int
    events_idle: int
    events_staging: int
    """Events the staging buffers hold (each marks when its buffer is free again)."""
    in_flight: int
    """Transfers enqueued on the device and not yet reported."""
    queued: int
    """Transfers waiting on the host for room (``max_in_flight``)."""

    @property
    def idle(self) -> bool:
        """Nothing outstanding and every stream and event back in its pool."""
        return (
            self.in_flight == 0
            and self.queued == 0
            and self.streams_idle == self.streams_created
            and self.events_idle + self.events_staging == self.events_created
        )


class StreamPool:
    """``size`` streams created up front; a busy pool shares its streams round robin."""

    def __init__(self, rt: CudaRuntime, size: int, priority: int) -> None:
        self._rt = rt
        self._lock = threading.Lock()
        self._all: list[int] = []
        self._idle: list[int] = []
        self._users: dict[int, int] = {}
        self._next_shared = 0
        try:
            for _ in range(size):
                stream = rt.stream_create(priority)
                self._all.append(stream)
                self._idle.append(stream)
        except BaseException:
            self.destroy()
            raise

    def acquire(self) -> int:
        with self._lock:
            if self._idle:
                stream = self._idle.pop()
            else:
                stream = self._all[self._next_shared % len(self._all)]
                self._next_shared += 1
            self._users[stream] = self._users.get(stream, 0) + 1
            return stream

    def release(self, stream: int) -> None:
        with self._lock:
            users = self._users[stream] - 1
            if users:
                self._users[stream] = users
            else:
                del self._users[stream]
                self._idle.append(stream)

    @property
    def created(self) -> int:
        return len(self._all)

    @property
    def idle(self) -> int:
        return len(self._idle)

    def destroy(self) -> None:
        for stream in self._all:
            try:
                self._rt.stream_destroy(stream)
            except CudaError as exc:
                log.warning("destroying a copy stream failed: %s", exc)
        self._all, self._idle, self._users = [], [], {}


class EventPool:
    """Events for gates, copies and staging buffers. ``prefill`` are created at registration, so
    planning a transfer normally makes no CUDA call (creating one can wait for the driver's lock
    while the executor is inside a long call); more are created on demand. Destroyed at close."""

    def __init__(self, rt: CudaRuntime, prefill: int) -> None:
        self._rt = rt
        self._lock = threading.Lock()
        self._idle: list[int] = []
        self._created = 0
        for _ in range(prefill):
            self._idle.append(rt.event_create())
            self._created += 1

    def acquire(self) -> int:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        event = self._rt.event_create()
        with self._lock:
            self._created += 1
        return event

    def acquire_many(self, count: int) -> list[int]:
        with self._lock:
            split = max(0, len(self._idle) - count)
            taken = self._idle[split:]
            del self._idle[split:]
        try:
            while len(taken) < count:
                taken.append(self.acquire())
        except BaseException:
            for event in taken:
                self.release(event)
            raise
        return taken

    def release(self, event: int) -> None:
        with self._lock:
            self._idle.append(event)

    @property
    def created(self) -> int:
        return self._created

    @property
    def idle(self) -> int:
        return len(self._idle)

    def destroy(self) -> None:
        if len(self._idle) != self._created:
            log.warning("%d copy events still in use at close", self._created - len(self._idle))
        for event in self._idle:
            try:
                self._rt.event_destroy(event)
            except CudaError as exc:
                log.warning("destroying a copy event failed: %s", exc)
        self._idle, self._created = [], 0


class PinnedPool:
    """The host pool's mapping registered with CUDA (page-locked, mapped into the device's
    address space), in pieces of whole slots; unregistered by ``close``."""

    def __init__(
        self, rt: CudaRuntime, pool: HostPool, chunk_bytes: int, allow_pageable: bool
    ) -> None:
        self._rt = rt
        self._array: np.ndarray | None = pool.array()  # keeps the mapping alive while registered
        self.base = int(self._array.ctypes.data)
        self.nbytes = int(self._array.nbytes)
        self.pinned = False
        self.device_addressable = False
        """The device reaches the pool at the same addresses (needed by the kernel strategy)."""
        self.reason = ""
        self.pieces = ONE_PIECE
        """Where its registered pieces begin (one piece: unpinned, or one registration)."""
        self._owned: list[int] = []
        step = max(1, chunk_bytes // pool.slot_stride) * pool.slot_stride
        failure = ""
        for offset in range(0, self.nbytes, step):
            address, size = self.base + offset, min(step, self.nbytes - offset)
            code = rt.host_register(address, size)
            if code == CUDA_SUCCESS:
                self._owned.append(address)
            elif code != CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
                name, text = rt.error_text(code)
                failure = (
                    f"cudaHostRegister of host pool {pool.handle.path} ({size} bytes at offset "
                    f"{offset} of {self.nbytes}) failed: {name}: {text}"
                )
                break
        if failure:
            self._unregister()
            self.reason = failure + (
                "; check the memlock limit (ulimit -l) and free memory, or set "
                "pool.allow_pageable to run on pageable memory at a fraction of the speed"
            )
            if not allow_pageable:
                self._array = None
                raise PoolError(self.reason)
            log.warning("%s; running on pageable memory (DMA only)", self.reason)
            return
        self.pinned = True
        if step < self.nbytes:
            self.pieces = PinnedPieces(self.base, step)
        try:
            self.device_addressable = all(
                rt.host_device_pointer(self.base + off) == self.base + off
                for off in range(0, self.nbytes, step)
            )
        except CudaError as exc:
            log.warning("host pool not addressable from the device: %s", exc)

    def _unregister(self) -> None:
        for address in self._owned:
            try:
                self._rt.host_unregister(address)
            except CudaError as exc:
                log.warning("cudaHostUnregister failed: %s", exc)
        self._owned = []

    def close(self) -> None:
        self._unregister()
        self.pinned = False
        self._array = None


@dataclass(slots=True)
class StagingRing:
    """Device staging buffers of one direction, used in turn by every staged transfer, and the
    streams every staged transfer of that direction runs on.

    The buffers already order these transfers on the device, so sharing streams costs no
    overlap; it keeps the device from holding many streams blocked on events at once (the
    queued transfers' waits), which cost back-to-back loads 4-5% of their copy rate on an H100
    (52.5 against 55 GB/s per chunk), while a transfer alone ran at the contiguous copy's rate.
    """

    owner: Any
    base: int
    buffer_bytes: int
    free: list[int]
    """Per buffer: an event recorded after its last use (0: never used)."""
    next: int = 0
    """The buffer the next chunk takes."""
    main: int = 0
    """The kernel steps' stream (and each transfer's gate wait and final event)."""
    lanes: list[int] = field(default_factory=list)
    """The DMA streams, taken by chunks in turn."""


def open_rings(
    rings: dict[bool, StagingRing],
    rt: CudaRuntime,
    alloc: Callable[[int], tuple[Any, int]],
    buffer_bytes: int,
    buffers: int,
    lanes: int,
    priority: int,
) -> None:
    """A staging ring per direction into ``rings``, one at a time (so that ``close_rings`` frees
    a part-built set): ``buffers`` buffers of ``buffer_bytes`` from ``alloc``, a kernel stream
    and ``lanes`` DMA streams."""
    for to_host in (True, False):
        owner, base = alloc(buffer_bytes * buffers)
        ring = StagingRing(owner, base, buffer_bytes, [0] * buffers)
        rings[to_host] = ring
        ring.main = rt.stream_create(priority)
        for _ in range(lanes):
            ring.lanes.append(rt.stream_create(priority))


def close_rings(
    rings: dict[bool, StagingRing], rt: CudaRuntime, free: Callable[[Any], None]
) -> None:
    """Free the staging buffers (through ``free``) and destroy their streams."""
    for ring in rings.values():
        free(ring.owner)
        for stream in (ring.main, *ring.lanes):
            if stream:
                rt.stream_destroy(stream)
    rings.clear()


def ring_events(rings: dict[bool, StagingRing]) -> int:
    """Events the staging rings hold (each marks when its buffer is free again)."""
    return sum(1 for ring in rings.values() for event in ring.free if event)
