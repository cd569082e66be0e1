"""The tier skeleton (``BlockTier``) over a storage that only puts, gets, checks and deletes.

The storage here is a dict whose answers a test can script; everything asserted (validation,
verification, corrupt -> drop, pins, counters, fan-out to threads, stuck threads, close) is the
skeleton's.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Iterator, Sequence

import pytest

from kvtier.keys import BlockKey, Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import JobResult, TierJob, TierJobKind
from kvtier.tiers.block_tier import BlockTier, Got, Put, valid_block
from kvtier.tiers.payload import HEADER_BYTES, encode_header

SLOT_BYTES = 1000
NS = Namespace(model="skeleton-test", dtype="float16", block_tokens=16)
OTHER_NS = Namespace(model="another-model", dtype="float16", block_tokens=16)


def key(i: int) -> BlockKey:
    return hashlib.blake2b(str(i).encode(), digest_size=16).digest()


def payload(k: BlockKey) -> bytes:
    return (k * (SLOT_BYTES // len(k) + 1))[:SLOT_BYTES]


class DictStorage(BlockTier):
    def __init__(self, pool: HostPool, threads: int = 0, stuck_after_s: float = 10.0) -> None:
        super().__init__("dict", NS, pool, threads=threads, stuck_after_s=stuck_after_s)
        self.blocks: dict[BlockKey, bytes] = {}
        self.answer: dict[BlockKey, Got] = {}
        """Scripted ``get`` answers instead of the dict's."""
        self.gate = threading.Event()
        self.gate.set()
        self.pinned_seen: list[bool] = []
        self.closed_with: bool | None = None

    def exists(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        return [k in self.blocks for k in keys]

    def put(self, key: BlockKey, header: bytes, payload: memoryview) -> Put:
        self.gate.wait()
        with self._lock:
            self.pinned_seen.append(self.pinned(key))
        if key in self.blocks:
            return Put.KEPT
        if len(self.blocks) >= 8:
            return Put.REJECTED
        self.blocks[key] = header + bytes(payload)
        return Put.STORED

    def get(self, key: BlockKey, header: memoryview, payload: memoryview) -> Got:
        self.gate.wait()
        scripted = self.answer.get(key)
        if scripted is not None:
            return scripted
        data = self.blocks.get(key)
        if data is None:
            return Got.MISSING
        header[:] = data[:HEADER_BYTES]
        payload[:] = data[HEADER_BYTES:]
        return Got.FOUND

    def delete(self, key: BlockKey) -> bool:
        return self.blocks.pop(key, None) is not None

    def _close_storage(self, abandoned: bool) -> None:
        self.closed_with = abandoned


@pytest.fixture
def pool() -> Iterator[HostPool]:
    pool = HostPool.create(16, SLOT_BYTES)
    yield pool
    pool.close()


JOB_IDS = iter(range(1, 1_000_000))


def run(tier: BlockTier, kind: TierJobKind, keys: list[BlockKey], slots: list[int]) -> list[bool]:
    job_id = next(JOB_IDS)
    tier.submit(TierJob(job_id, kind, keys, slots))
    end = time.monotonic() + 10
    while True:
        results: list[JobResult] = tier.poll()
        if results:
            assert [r.job_id for r in results] == [job_id]
            return results[0].ok
        assert time.monotonic() < end, "job not reported"
        time.sleep(0.001)


def store(tier: BlockTier, pool: HostPool, keys: list[BlockKey]) -> list[bool]:
    for slot, k in enumerate(keys):
        pool.view(slot)[:] = payload(k)
    return run(tier, TierJobKind.WRITE, keys, list(range(len(keys))))


@pytest.mark.parametrize("threads", [0, 3])
def test_round_trip_with_header_and_counters(pool: HostPool, threads: int) -> None:
    tier = DictStorage(pool, threads=threads)
    keys = [key(i) for i in range(5)]
    assert store(tier, pool, keys) == [True] * 5
    stored = tier.blocks[keys[0]]
    assert stored[:HEADER_BYTES] == encode_header(NS.digest, keys[0], payload(keys[0]))
    for slot in range(5):
        pool.view(slot)[:] = b"\xa5" * SLOT_BYTES
    assert run(tier, TierJobKind.READ, keys, [4, 3, 2, 1, 0]) == [True] * 5
    assert [bytes(pool.view(4 - i)) for i in range(5)] == [payload(k) for k in keys]
    assert tier.lookup([keys[0], key(99)]) == [True, False]
    c = tier.counters
    assert (c.write_jobs, c.write_blocks, c.write_bytes) == (1, 5, 5 * SLOT_BYTES)
    assert (c.read_jobs, c.read_blocks, c.read_bytes) == (1, 5, 5 * SLOT_BYTES)
    assert (c.lookups, c.lookup_hits, c.errors, c.corrupt) == (2, 1, 0, 0)
    assert all(tier.pinned_seen) and tier._pins == {}  # pinned while moved, released after
    tier.close()
    assert tier.closed_with is False


def test_kept_rejected_and_failed_puts_are_counted(pool: HostPool) -> None:
    tier = DictStorage(pool)
    keys = [key(i) for i in range(9)]
    assert store(tier, pool, keys) == [True] * 8 + [False]  # the 9th finds no room
    assert store(tier, pool, keys[:1]) == [True]  # kept: held already
    assert (tier.counters.write_blocks, tier.counters.rejected) == (8, 1)


@pytest.mark.parametrize(
    ("damage", "counted"),
    [
        ("payload", "corrupt"),
        ("header_key", "corrupt"),
        ("namespace", "corrupt"),
        ("damaged", "corrupt"),
        ("failed", "errors"),
        ("missing", None),
    ],
)
def test_read_outcomes(pool: HostPool, damage: str, counted: str | None) -> None:
    tier = DictStorage(pool)
    k = key(1)
    assert store(tier, pool, [k]) == [True]
    data = bytearray(tier.blocks[k])
    if damage == "payload":
        data[-1] ^= 1
    elif damage == "header_key":
        data[:HEADER_BYTES] = encode_header(NS.digest, key(2), payload(k))
    elif damage == "namespace":
        data[:HEADER_BYTES] = encode_header(OTHER_NS.digest, k, payload(k))
    elif damage == "damaged":
        tier.answer[k] = Got.DAMAGED
    elif damage == "failed":
        tier.answer[k] = Got.FAILED
    else:
        tier.answer[k] = Got.MISSING
    tier.blocks[k] = bytes(data)
    assert run(tier, TierJobKind.READ, [k], [3]) == [False]
    c = tier.counters
    assert (c.corrupt, c.errors) == (int(counted == "corrupt"), int(counted == "errors"))
    dropped = counted == "corrupt"
    assert (k in tier.blocks) is not dropped  # corrupt -> deleted; a failed read keeps it
    assert tier.take_evicted() == ([k] if dropped else [])


def test_invalid_blocks_fail_alone_and_a_mismatched_job_whole(pool: HostPool) -> None:
    tier = DictStorage(pool)
    ok = key(1)
    pool.view(0)[:] = payload(ok)
    assert run(tier, TierJobKind.WRITE, [b"short", ok, ok], [0, 0, 16]) == [False, True, False]
    assert tier.counters.errors == 2
    assert run(tier, TierJobKind.WRITE, [ok, ok], [0]) == [False, False]
    assert tier.counters.errors == 4
    assert run(tier, TierJobKind.READ, [], []) == []
    assert list(tier.blocks) == [ok]
    assert valid_block(ok, 15, 16)
    assert not valid_block(ok, "1", 16) and not valid_block(ok, -1, 16)
    assert not valid_block(ok + b"x", 1, 16) and not valid_block(bytearray(ok), 1, 16)


def test_storage_exception_fails_the_block_not_the_report(pool: HostPool) -> None:
    class Raising(DictStorage):
        def put(self, key: BlockKey, header: bytes, payload: memoryview) -> Put:
            raise OSError("disk on fire")

    tier = Raising(pool, threads=2)
    assert store(tier, pool, [key(1), key(2)]) == [False, False]
    assert tier.counters.errors == 2
    tier.close()


def test_every_thread_stuck_fails_new_jobs_at_once_and_close_returns(pool: HostPool) -> None:
    tier = DictStorage(pool, threads=1, stuck_after_s=0.2)
    tier.gate.clear()  # the storage hangs
    pool.view(0)[:] = payload(key(1))
    tier.submit(TierJob(1, TierJobKind.WRITE, [key(1)], [0]))
    time.sleep(0.3)
    assert tier.stuck_threads == 1
    assert not tier._run_on_worker(lambda: None, lambda: None, "own task")  # nobody to take it
    started = time.monotonic()
    assert run(tier, TierJobKind.WRITE, [key(2)], [1]) == [False]  # refused, not queued
    assert time.monotonic() - started < 0.2
    tier.close()
    assert tier.closed_with is True  # a thread was abandoned in the storage
    tier.gate.set()  # the stuck block comes back and is reported
    end = time.monotonic() + 5
    while not (results := tier.poll()):
        assert time.monotonic() < end
        time.sleep(0.005)
    assert [(r.job_id, r.ok) for r in results] == [(1, [True])]


def test_closed_tier_fails_jobs_without_touching_storage(pool: HostPool) -> None:
    tier = DictStorage(pool, threads=2)
    tier.close()
    tier.close()
    assert store(tier, pool, [key(1)]) == [False]
    assert tier.blocks == {}


def test_a_tiers_own_tasks_run_on_its_threads(pool: HostPool) -> None:
    inline = DictStorage(pool)
    assert not inline._run_on_worker(lambda: None, lambda: None, "own task")
    assert inline.stuck_threads == 0
    tier = DictStorage(pool, threads=2)
    ran_on: list[str] = []
    done = threading.Event()

    def task() -> None:
        ran_on.append(threading.current_thread().name)
        done.set()

    assert tier._run_on_worker(task, lambda: None, "own task")
    assert done.wait(5) and ran_on[0].startswith("kvtier-dict-")
    assert tier.stuck_threads == 0
    tier.close()
    assert not tier._run_on_worker(task, lambda: None, "after close") and len(ran_on) == 1


class BatchStorage(DictStorage):
    """Batches of ``batch_size``, a health gate, a cut-off and a per-thread state."""

    cut_off_grace_s = 1.0

    def __init__(self, pool: HostPool, threads: int = 2, batch_size: int = 3) -> None:
        BlockTier.__init__(
            self,
            "batch",
            NS,
            pool,
            threads=threads,
            batch_size=batch_size,
            reads_first=True,
            aside_thread=True,
            thread_state=Connection,
            close_timeout_s=0.2,
        )
        self.blocks = {}
        self.answer = {}
        self.gate = threading.Event()
        self.gate.set()
        self.pinned_seen = []
        self.closed_with = None
        self.batches: list[tuple[str, int]] = []
        self.failed: list[tuple[str, int]] = []
        self.health = True
        self.raise_on: BlockKey | None = None

    def put_batch(self, keys, headers, payloads):  # type: ignore[no-untyped-def]
        self._record("put", keys)
        return super().put_batch(keys, headers, payloads)

    def get_batch(self, keys, headers, payloads):  # type: ignore[no-untyped-def]
        self._record("get", keys)
        return super().get_batch(keys, headers, payloads)

    def _record(self, what: str, keys: Sequence[BlockKey]) -> None:
        conn = self._thread_state()
        assert isinstance(conn, Connection)
        conn.used += 1
        self.batches.append((what, len(keys)))
        if self.raise_on in keys:
            raise ConnectionError("server gone")

    def _healthy(self) -> bool:
        return self.health

    def _batch_failed(self, exc: Exception, keys: list[BlockKey], reading: bool) -> None:
        self.failed.append((type(exc).__name__, len(keys)))
        self._count(timeouts=len(keys))

    def _cut_off(self) -> None:
        self.gate.set()


class Connection:
    made: list[Connection] = []

    def __init__(self) -> None:
        self.used = 0
        self.closed = False
        Connection.made.append(self)

    def close(self) -> None:
        self.closed = True


def test_batches_of_batch_size_with_invalid_blocks_left_out(pool: HostPool) -> None:
    Connection.made.clear()
    tier = BatchStorage(pool, threads=1, batch_size=3)
    keys = [key(i) for i in range(7)]
    for slot, k in enumerate(keys):
        pool.view(slot)[:] = payload(k)
    slots = list(range(7))
    slots[4] = 99  # not a slot: fails alone, never handed to the storage
    assert run(tier, TierJobKind.WRITE, keys, slots) == [True] * 4 + [False] + [True] * 2
    assert tier.batches == [("put", 3), ("put", 2), ("put", 1)]
    assert run(tier, TierJobKind.READ, keys[:6], [10, 11, 12, 13, 14, 15][:6]) == [
        True,
        True,
        True,
        True,
        False,  # never stored
        True,
    ]
    assert tier.batches[3:] == [("get", 3), ("get", 3)]
    c = tier.counters
    assert (c.errors, c.write_blocks, c.read_blocks) == (1, 6, 5)
    # One connection for the one I/O thread, kept between batches, closed with the thread.
    assert len(Connection.made) == 1 and Connection.made[0].used == 5
    tier.close()
    assert Connection.made[0].closed


def test_an_exception_fails_its_batch_through_the_hook(pool: HostPool) -> None:
    tier = BatchStorage(pool, threads=1, batch_size=2)
    keys = [key(i) for i in range(4)]
    tier.raise_on = keys[3]
    assert store(tier, pool, keys) == [True, True, False, False]
    assert tier.failed == [("ConnectionError", 2)]
    assert (tier.counters.timeouts, tier.counters.errors) == (2, 0)
    assert tier._pins == {}
    tier.close()


def test_the_health_gate_fails_jobs_and_queued_batches_unsent(pool: HostPool) -> None:
    tier = BatchStorage(pool, threads=1, batch_size=1)
    keys = [key(i) for i in range(3)]
    tier.health = False
    assert store(tier, pool, keys) == [False] * 3
    assert run(tier, TierJobKind.READ, keys, [5, 6, 7]) == [False] * 3
    assert (tier.counters.rejected, tier.counters.errors, tier.batches) == (3, 3, [])
    # Unhealthy while a job's later batches wait: they fail unsent.
    tier.health = True
    tier.gate.clear()
    for slot, k in enumerate(keys):
        pool.view(slot)[:] = payload(k)
    tier.submit(TierJob(1, TierJobKind.WRITE, keys, [0, 1, 2]))
    time.sleep(0.05)
    tier.health = False
    tier.gate.set()
    end = time.monotonic() + 5
    while not (results := tier.poll()):
        assert time.monotonic() < end
        time.sleep(0.005)
    assert results[0].ok == [True, False, False]
    assert tier.counters.rejected == 5 and tier.batches == [("put", 1)]
    tier.close()


def test_reads_go_ahead_of_queued_writes(pool: HostPool) -> None:
    tier = BatchStorage(pool, threads=1, batch_size=1)
    keys = [key(i) for i in range(4)]
    assert store(tier, pool, keys[:1]) == [True]
    tier.batches.clear()
    tier.gate.clear()
    tier.submit(TierJob(1, TierJobKind.WRITE, keys[1:], [1, 2, 3]))
    time.sleep(0.05)  # the first write batch is running
    tier.submit(TierJob(2, TierJobKind.READ, keys[:1], [9]))
    tier.gate.set()
    end = time.monotonic() + 5
    done: dict[int, list[bool]] = {}
    while len(done) < 2:
        assert time.monotonic() < end
        done.update((r.job_id, r.ok) for r in tier.poll())
        time.sleep(0.005)
    assert done == {1: [True] * 3, 2: [True]}
    assert tier.batches == [("put", 1), ("get", 1), ("put", 1), ("put", 1)]
    tier.close()


def test_aside_tasks_run_while_every_io_thread_is_busy(pool: HostPool) -> None:
    tier = BatchStorage(pool, threads=1)
    tier.gate.clear()
    pool.view(0)[:] = payload(key(1))
    tier.submit(TierJob(1, TierJobKind.WRITE, [key(1)], [0]))
    ran = threading.Event()
    assert tier._run_on_worker(ran.set, lambda: None, "key check", aside=True)
    assert ran.wait(5)
    tier.gate.set()
    tier.close()
    assert not DictStorage(pool, threads=1)._run_on_worker(ran.set, lambda: None, "x", aside=True)


def test_close_cuts_off_what_still_runs_and_reports_every_job(pool: HostPool) -> None:
    tier = BatchStorage(pool, threads=1, batch_size=1)
    tier.gate.clear()  # hangs until _cut_off opens it
    keys = [key(i) for i in range(3)]
    for slot, k in enumerate(keys):
        pool.view(slot)[:] = payload(k)
        tier.submit(TierJob(slot, TierJobKind.WRITE, [k], [slot]))
    started = time.monotonic()
    tier.close()
    assert 0.2 <= time.monotonic() - started < 0.2 + tier.cut_off_grace_s
    assert tier.gate.is_set() and tier.closed_with is False
    assert sorted(r.job_id for r in tier.poll()) == [0, 1, 2]
