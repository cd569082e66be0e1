"""Where the shared block index lives in the pool file, as numpy views over one mapping.

The file of a shared pool is the pool's slots (what ``HostPool`` maps, what workers copy to and
from) followed, at the next page, by the index: a header, a table of engines, the per-slot state,
a stack of free slots and an open-addressing table from key to slot. Every array here is a view of
the shared mapping: a write is seen by every process at once, nothing is copied.
"""

from __future__ import annotations

import mmap
from dataclasses import dataclass

import numpy as np

MAGIC = 0x6B76_7469_6572_5348  # "kvtierSH"
VERSION = 1
MAX_ENGINES = 64
"""Engines per shared pool: a slot's pins are one bit per engine in a 64-bit word."""
HEADER_WORDS = 32
ENGINE_WORDS = 8

# Header words.
H_MAGIC, H_VERSION, H_SLOTS, H_SLOT_BYTES, H_CAPACITY, H_DIRTY = 0, 1, 2, 3, 4, 5
H_FREE_TOP, H_TOMBS, H_LIVE, H_REPAIRS, H_NS0, H_NS1 = 6, 7, 8, 9, 10, 11

# Engine table words.
E_REGISTERED, E_PID, E_HITS_OWN, E_HITS_OTHERS, E_EVICTIONS, E_STORED, E_QUOTA = range(7)

# Slot states.
FREE, WRITING, VISIBLE = 0, 1, 2
# Table entries' slot field.
EMPTY, TOMB = -1, -2


def table_capacity(num_slots: int) -> int:
    """A power of two at least 4x the slots: the table is never more than half full (live
    entries and tombstones), so probes stay short."""
    capacity = 16
    while capacity < 4 * num_slots:
        capacity *= 2
    return capacity


def _align(n: int, to: int = 64) -> int:
    return -(-n // to) * to


@dataclass(frozen=True, slots=True)
class Layout:
    """Byte offsets of the index's arrays, from the index's start."""

    num_slots: int
    capacity: int
    engines: int
    state: int
    writer: int
    slot_keys: int
    pins: int
    last_use: int
    free: int
    table_keys: int
    table_slots: int
    size: int

    @classmethod
    def of(cls, num_slots: int) -> Layout:
        capacity = table_capacity(num_slots)
        sizes = [
            ("engines", MAX_ENGINES * ENGINE_WORDS * 8),
            ("state", num_slots * 4),
            ("writer", num_slots * 4),
            ("slot_keys", num_slots * 16),
            ("pins", num_slots * 8),
            ("last_use", num_slots * 8),
            ("free", num_slots * 4),
            ("table_keys", capacity * 16),
            ("table_slots", capacity * 4),
        ]
        offsets: dict[str, int] = {}
        at = HEADER_WORDS * 8
        for name, size in sizes:
            offsets[name] = at
            at = _align(at + size)
        return cls(num_slots=num_slots, capacity=capacity, size=at, **offsets)


def index_offset(slots_bytes: int) -> int:
    """Where the index starts in the file: after the slots, at a mappable offset."""
    return -(-slots_bytes // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY


class IndexArrays:
    """The index's arrays over ``buffer`` (the mapping of the index, ``Layout.size`` bytes)."""

    def __init__(self, buffer: memoryview, layout: Layout) -> None:
        n, cap = layout.num_slots, layout.capacity

        def view(offset: int, dtype: type, count: int) -> np.ndarray:
            return np.frombuffer(buffer, dtype=dtype, count=count, offset=offset)

        self.layout = layout
        self.header = view(0, np.int64, HEADER_WORDS)
        self.engines = view(layout.engines, np.int64, MAX_ENGINES * ENGINE_WORDS).reshape(
            MAX_ENGINES, ENGINE_WORDS
        )
        self.state = view(layout.state, np.int32, n)
        self.writer = view(layout.writer, np.int32, n)
        self.slot_keys = view(layout.slot_keys, np.uint64, 2 * n).reshape(n, 2)
        self.pins = view(layout.pins, np.uint64, n)
        self.last_use = view(layout.last_use, np.float64, n)
        self.free = view(layout.free, np.int32, n)
        self.table_keys = view(layout.table_keys, np.uint64, 2 * cap).reshape(cap, 2)
        self.table_slots = view(layout.table_slots, np.int32, cap)
        self.mask = cap - 1

    def initialise(self, slot_bytes: int, digest: bytes) -> None:
        """Fill a new index (a file nobody else can see yet): every slot free, table empty."""
        h, n = self.header, self.layout.num_slots
        h[:] = 0
        h[H_VERSION], h[H_SLOTS], h[H_SLOT_BYTES] = VERSION, n, slot_bytes
        h[H_CAPACITY] = self.layout.capacity
        h[H_NS0 : H_NS1 + 1] = np.frombuffer(digest, dtype=np.int64, count=2)
        self.engines[:] = 0
        self.state[:] = FREE
        self.writer[:] = -1
        self.pins[:] = 0
        self.last_use[:] = 0.0
        self.free[:] = np.arange(n - 1, -1, -1, dtype=np.int32)  # slot 0 handed out first
        h[H_FREE_TOP] = n
        self.table_slots[:] = EMPTY
        h[H_MAGIC] = MAGIC  # last: a half-made index is never taken for one

    def digest(self) -> bytes:
        return self.header[H_NS0 : H_NS1 + 1].tobytes()
