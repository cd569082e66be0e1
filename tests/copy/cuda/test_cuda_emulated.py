"""The CUDA backend's bookkeeping on the CPU, over an emulated runtime (see ``emulated_cuda``):
every byte lands, every job is reported once, streams and events go back on every path, errors
included, and the gate on the compute stream comes before the copy. The GPU itself is exercised by
``test_cuda_backend.py``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from support.emulated_cuda import COMPUTE_STREAM, EmulatedBackend, FakeRuntime, FakeTensor
from support.kv_reference import block_bytes, engine_arrays, logical_blocks, to_logical

from kvtier.copy.base import SKIP, CopyJob, CopyResults, Direction
from kvtier.copy.cuda.backend import CudaCopyOptions
from kvtier.copy.cuda.executor import ExecutorUnavailable
from kvtier.copy.cuda.plan import KVLayout
from kvtier.copy.cuda.staged import chunk_sizes
from kvtier.copy.options import CopyConfig, CopyStrategy
from kvtier.errors import ConfigError, PoolError
from kvtier.pool import HostPool

NUM_BLOCKS = 24
NUM_SLOTS = 16


@pytest.fixture
def pool(tmp_path: object) -> Iterator[HostPool]:
    block = logical_blocks(np.random.default_rng(0), 1)[0].nbytes
    with HostPool.create(NUM_SLOTS, 2 * 2 * block + 100, shm_dir=str(tmp_path)) as p:
        yield p


def _backend(
    pool: HostPool,
    layout: KVLayout,
    strategy: str,
    fake: FakeRuntime | None = None,
    seed: int = 0,
    **kwargs: object,
) -> tuple[EmulatedBackend, np.ndarray, list[np.ndarray]]:
    logical = logical_blocks(np.random.default_rng(seed), NUM_BLOCKS)
    arrays = engine_arrays(logical, layout)
    opts = kwargs.pop("options", None) or CudaCopyOptions(strategy=strategy, max_streams=4)
    backend = EmulatedBackend(
        [FakeTensor(a) for a in arrays], layout, pool, opts, fake=fake or FakeRuntime(), **kwargs
    )
    return backend, logical, arrays


def _idle(backend: EmulatedBackend) -> bool:
    return backend.stats().idle


def _slot_part(pool: HostPool, slot: int, offset: int, nbytes: int) -> bytes:
    return pool.array()[slot, offset : offset + nbytes].tobytes()


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("strategy", ["dma", "kernel", "staged"])
@pytest.mark.parametrize("layerwise", [False, True])
def test_store_then_load_every_byte(
    pool: HostPool, layout: KVLayout, strategy: str, layerwise: bool
) -> None:
    fake = FakeRuntime(deferred=True)
    block = logical_blocks(np.random.default_rng(0), 1)[0].nbytes
    # Staging buffers of two blocks: three chunks per job, so the two buffers are reused.
    opts = CudaCopyOptions(
        strategy=strategy, max_streams=4, stage_bytes=2 * block + 5, staged_min_blocks=1
    )
    backend, logical, arrays = _backend(
        pool, layout, strategy, fake, options=opts, blocks_per_slot=2, tp_rank=1, tp_size=2
    )
    assert backend.strategy == strategy
    part = backend.slot_part_bytes
    pool.array()[:] = 0xAB
    blocks = [5, 17, 3, 0, 23, 9]
    slots = [7, 2, 11]
    fake.calls.clear()
    backend.submit(CopyJob(1, Direction.STORE, blocks, slots), layerwise=layerwise)
    kinds = {c[0] for c in fake.calls}
    if strategy == "staged":  # through the staging buffers: kernel and copy engines
        assert kinds >= ({"launch"} if layerwise else {"launch", "memcpy"})
    assert backend.poll().done == []  # nothing ran yet
    fake.run()
    assert backend.poll().done == [1]
    assert backend.poll().done == []
    for i, slot in enumerate(slots):
        got = _slot_part(pool, slot, part, part)  # rank 1 owns the second half
        assert got == block_bytes(logical, blocks[2 * i]) + block_bytes(logical, blocks[2 * i + 1])
        assert (pool.array()[slot, :part] == 0xAB).all()
        assert (pool.array()[slot, 2 * part :] == 0xAB).all()
    untouched = sorted(set(range(NUM_SLOTS)) - set(slots))
    assert (pool.array()[untouched] == 0xAB).all()

    for a in arrays:
        a.fill(0xDEAD)
    targets = [1, 2, 20, 21, 4, 8]
    backend.submit(CopyJob(2, Direction.LOAD, targets, slots), layerwise=layerwise)
    backend.wait([2])
    assert backend.poll().done == [2]
    got = to_logical(arrays, layout)
    for i, b in enumerate(targets):
        assert got[b].tobytes() == block_bytes(logical, blocks[i])
    for b in set(range(NUM_BLOCKS)) - set(targets):
        assert (got[b] == 0xDEAD).all()
    assert _idle(backend)
    assert block == backend.geometry.block_bytes
    backend.close()
    assert fake.streams == set() and fake.events == set() and fake.registered == []


def test_auto_picks_dma_for_compact_blocks_and_kernel_for_small_pieces(pool: HostPool) -> None:
    opts = CudaCopyOptions(dma_min_piece_bytes=512)  # a block: 768 bytes, a piece: 128
    compact, _, _ = _backend(pool, KVLayout.BLOCK_COMPACT, "auto", options=opts)
    per_layer, _, _ = _backend(pool, KVLayout.LAYER_KV_FIRST, "auto", options=opts)
    assert compact.strategy == "dma" and compact.sms_used == 0
    assert per_layer.strategy == "staged" and per_layer.sms_used == 8
    no_dma = FakeRuntime(has_batch_memcpy=False)
    direct, _, _ = _backend(pool, KVLayout.LAYER_KV_FIRST, "auto", no_dma, options=opts)
    assert direct.strategy == "kernel"
    direct.close()
    compact.close()
    per_layer.close()


def test_gate_on_compute_stream_comes_before_the_copy(pool: HostPool) -> None:
    fake = FakeRuntime()
    backend, _, _ = _backend(pool, KVLayout.LAYER_KV_FIRST, "kernel", fake)
    fake.calls.clear()
    backend.submit(CopyJob(1, Direction.STORE, [1], [0]))
    record, wait, launch = fake.calls[0], fake.calls[1], fake.calls[2]
    assert record[0] == "record" and record[2] == COMPUTE_STREAM
    assert wait == ("wait", launch[1], record[1])
    assert launch[0] == "launch"
    fake.calls.clear()
    backend.submit(CopyJob(2, Direction.LOAD, [1], [0]), after=12345)
    assert fake.calls[0][0] == "wait" and fake.calls[0][2] == 12345
    assert all(c[0] != "record" or c[2] != COMPUTE_STREAM for c in fake.calls)
    assert sorted(backend.poll().done) == [1, 2]
    # The legacy default stream is handle 0: still a stream to record the gate on.
    backend._current_stream = lambda: 0  # type: ignore[method-assign]
    fake.calls.clear()
    backend.submit(CopyJob(3, Direction.STORE, [1], [0]))
    record, wait = fake.calls[0], fake.calls[1]
    assert record[0] == "record" and record[2] == 0 and wait == ("wait", wait[1], record[1])
    assert backend.poll().done == [3]
    backend.close()


def test_bad_jobs_are_reported_failed_once(pool: HostPool) -> None:
    backend, _, _ = _backend(pool, KVLayout.LAYER_KV_FIRST, "kernel")
    backend.submit(CopyJob(1, Direction.STORE, [NUM_BLOCKS], [0]))
    backend.submit(CopyJob(2, Direction.STORE, [0, 1], [0]))
    backend.submit(CopyJob(3, Direction.LOAD, [0], [NUM_SLOTS]))
    backend.submit(CopyJob(4, Direction.LOAD, [], []))
    res = backend.poll()
    assert res.failed == [1, 2, 3] and res.done == [4]
    assert backend.poll() == type(res)([], [])
    assert _idle(backend)
    backend.close()


def test_duplicate_in_flight_id_is_refused(pool: HostPool) -> None:
    fake = FakeRuntime(deferred=True)
    backend, _, _ = _backend(pool, KVLayout.BLOCK_COMPACT, "dma", fake)
    backend.submit(CopyJob(1, Direction.STORE, [0], [0]))
    backend.submit(CopyJob(1, Direction.STORE, [1], [1]))
    assert backend.poll().failed == [1]
    fake.run()
    assert backend.poll().done == [1]
    backend.close()


@pytest.mark.parametrize(
    ("method", "after_calls", "layerwise"),
    [
        ("stream_wait_event", 0, False),  # the gate fails
        ("launch", 0, False),  # the copy fails before anything ran
        ("launch", 1, True),  # fails after layer 0 was enqueued
        ("event_record", 1, False),  # the done event cannot be recorded (gate record passed)
        ("event_record", 2, True),  # a layer event cannot be recorded
        ("event_create", 0, False),  # no event for "done" (the gate reused an idle one)
        ("event_create", 0, True),  # no event for layer 0
    ],
)
def test_failures_return_streams_and_events(
    pool: HostPool, method: str, after_calls: int, layerwise: bool
) -> None:
    fake = FakeRuntime(deferred=True)
    backend, _, _ = _backend(
        pool,
        KVLayout.LAYER_KV_FIRST,
        "kernel",
        fake,
        options=CudaCopyOptions(strategy="kernel", max_streams=2, prefill_events=1),
    )
    backend.submit(CopyJob(9, Direction.STORE, [0], [0]))  # a healthy job alongside
    fake.fail[method] = after_calls
    backend.submit(CopyJob(1, Direction.LOAD, [3, 4], [1, 2]), layerwise=layerwise)
    fake.fail.clear()
    fake.run()
    res = backend.poll()
    assert res.failed == [1] and res.done == [9]
    assert backend.poll() == type(res)([], [])
    assert _idle(backend)
    # The backend keeps working.
    backend.submit(CopyJob(2, Direction.STORE, [5], [3]))
    fake.run()
    assert backend.poll().done == [2]
    backend.close()
    assert fake.streams == set() and fake.events == set()


def test_many_outstanding_share_streams_beyond_the_cap(pool: HostPool) -> None:
    fake = FakeRuntime(deferred=True)
    backend, _, _ = _backend(
        pool,
        KVLayout.BLOCK_COMPACT,
        "dma",
        fake,
        options=CudaCopyOptions(strategy="dma", max_streams=64, max_in_flight=256),
    )
    n = 10_000
    for job in range(n):
        backend.submit(CopyJob(job, Direction.STORE, [job % NUM_BLOCKS], [job % NUM_SLOTS]))
    stats = backend.stats()
    assert stats.in_flight == 256 and stats.queued == n - 256 and stats.streams_created == 64
    assert backend.poll().done == []
    done: list[int] = []
    while backend.stats().in_flight:
        fake.run()
        res = backend.poll()  # reports what ran, enqueues the next ones
        assert res.failed == []
        done += res.done
    assert sorted(done) == list(range(n))
    assert _idle(backend)
    backend.close()


def test_the_host_queue_feeds_the_device_in_order(pool: HostPool) -> None:
    fake = FakeRuntime(deferred=True)
    opts = CudaCopyOptions(strategy="dma", max_in_flight=4)
    backend, _, _ = _backend(pool, KVLayout.BLOCK_COMPACT, "dma", fake, options=opts)
    for job in range(10):
        backend.submit(CopyJob(job, Direction.LOAD, [job], [job]))
    assert backend.stats()[-2:] == (4, 6)
    # Waiting for a queued job enqueues the queue as room is made, never more than 4 at once.
    backend.wait([8])
    assert backend.stats()[-2:] == (2, 0)  # 8 and 9 enqueued (and run), not yet collected
    assert sorted(backend.poll().done) == list(range(10))
    # A job that must be waited on by a stream is enqueued at once, room or not.
    for job in range(10, 20):
        backend.submit(CopyJob(job, Direction.LOAD, [job], [job - 10]))
    backend.stream_wait(19)
    assert backend.stats()[-2:] == (5, 5)
    done: list[int] = []
    while backend.stats().in_flight:
        fake.run()
        done += backend.poll().done
    assert sorted(done) == list(range(10, 20))
    assert _idle(backend)
    # Queued jobs hold their gate event; close returns it.
    backend.submit(CopyJob(20, Direction.LOAD, [1], [1]), after=None)
    backend.close()
    assert fake.events == set() and fake.streams == set()


def test_device_operation_budget(pool: HostPool) -> None:
    fake = FakeRuntime(deferred=True)
    opts = CudaCopyOptions(strategy="dma", max_device_ops=10)
    backend, _, _ = _backend(pool, KVLayout.BLOCK_COMPACT, "dma", fake, options=opts)
    for job in range(4):  # 4 copies each: two fit in the budget of 10
        backend.submit(CopyJob(job, Direction.STORE, [4 * job + i for i in range(4)], [0, 1, 2, 3]))
    assert backend.stats()[-2:] == (2, 2)
    big = list(range(12))  # alone it exceeds the budget: it still runs, once nothing else does
    backend.submit(CopyJob(9, Direction.LOAD, big, big))
    done: list[int] = []
    while backend.stats().in_flight:
        fake.run()
        done += backend.poll().done
    assert done == [0, 1, 2, 3, 9]
    backend.close()


@pytest.mark.parametrize(
    ("layout", "strategy"),
    [(KVLayout.BLOCK_COMPACT, "dma"), (KVLayout.LAYER_KV_FIRST, "staged")],
)
def test_stream_creation_failure_unregisters_the_pool(
    pool: HostPool, layout: KVLayout, strategy: str
) -> None:
    """The third stream fails (the pool's, or the staging rings'): what was created is gone."""
    from kvtier.copy.cuda.runtime import CudaError

    fake = FakeRuntime(fail={"stream_create": 2})
    with pytest.raises(CudaError, match="injected"):
        _backend(pool, layout, strategy, fake)
    assert fake.registered == [] and fake.streams == set() and fake.events == set()


def test_pinning_failure_raises_unless_pageable_allowed(pool: HostPool) -> None:
    with pytest.raises(PoolError, match="cudaHostRegister"):
        _backend(pool, KVLayout.LAYER_KV_FIRST, "auto", FakeRuntime(register_code=2))
    backend, _, _ = _backend(
        pool,
        KVLayout.LAYER_KV_FIRST,
        "auto",
        FakeRuntime(register_code=2),
        options=CudaCopyOptions(allow_pageable=True),
    )
    assert not backend.pinned and backend.strategy == "dma"
    backend.close()
    with pytest.raises(ConfigError, match="kernel"):
        _backend(
            pool,
            KVLayout.LAYER_KV_FIRST,
            "kernel",
            FakeRuntime(register_code=2),
            options=CudaCopyOptions(strategy="kernel", allow_pageable=True),
        )


def test_pool_registered_in_slot_aligned_pieces(pool: HostPool) -> None:
    fake = FakeRuntime()
    chunk = 3 * pool.slot_stride + 7
    backend, _, _ = _backend(
        pool,
        KVLayout.BLOCK_COMPACT,
        "dma",
        fake,
        options=CudaCopyOptions(register_chunk_bytes=chunk),
    )
    sizes = [n for _, n in fake.registered]
    assert sum(sizes) == pool.num_slots * pool.slot_stride
    assert all(n % pool.slot_stride == 0 for n in sizes) and max(sizes) == 3 * pool.slot_stride
    backend.close()
    assert fake.registered == []


def test_events_are_created_up_front(pool: HostPool) -> None:
    opts = CudaCopyOptions(strategy="kernel", max_streams=2, prefill_events=5)
    backend, _, _ = _backend(pool, KVLayout.LAYER_KV_FIRST, "kernel", options=opts)
    created = backend.fake.events.copy()
    assert backend.stats().events_created == 5 == len(created) == backend.stats().events_idle
    backend.submit(CopyJob(1, Direction.STORE, [0], [0]))  # a gate and a done event: no new one
    backend.wait([1])
    assert backend.poll().done == [1] and backend.fake.events == created
    backend.close()


def test_options() -> None:
    with pytest.raises(ConfigError, match=r"copy\.strategy"):
        CudaCopyOptions(strategy="fast")
    with pytest.raises(ConfigError, match=r"copy\.max_sms"):
        CudaCopyOptions(max_sms=-1)

    copy = CopyConfig(CopyStrategy.KERNEL, max_sms=12)
    opts = CudaCopyOptions.from_copy(copy, True)
    assert (opts.strategy, opts.max_sms, opts.allow_pageable) == ("kernel", 12, True)


@pytest.mark.parametrize("layerwise", [False, True])
def test_dma_lanes_split_the_copy_and_join(pool: HostPool, layerwise: bool) -> None:
    fake = FakeRuntime(deferred=True)
    opts = CudaCopyOptions(strategy="dma", dma_lanes=3, max_streams=3)
    backend, logical, _ = _backend(pool, KVLayout.BLOCK_COMPACT, "dma", fake, options=opts)
    pool.array()[:] = 0xAB
    blocks, slots = [4, 9, 1, 7, 2], [3, 0, 8, 5, 6]
    fake.calls.clear()
    backend.submit(CopyJob(1, Direction.STORE, blocks, slots), layerwise=layerwise)
    copies = [c for c in fake.calls if c[0] == "memcpy"]
    assert len({c[1] for c in copies}) == 3  # three streams
    assert sum(c[2] for c in copies) == len(blocks) * (
        backend.geometry.num_layers if layerwise else 1
    )
    assert backend.stats().streams_created == 3
    fake.run()
    assert backend.poll().done == [1]
    for b, s in zip(blocks, slots, strict=True):
        assert _slot_part(pool, s, 0, backend.slot_part_bytes) == block_bytes(logical, b)
    assert _idle(backend)
    backend.close()


def test_chunk_sizes_ramp_at_the_exposed_end() -> None:
    # Equal chunks when the ramp is as large as a buffer.
    assert chunk_sizes(10, 4, 4, to_host=True) == [4, 4, 2]
    # A STORE starts small (its first gather cannot overlap a DMA), a LOAD ends small.
    assert chunk_sizes(100, 32, 1, to_host=True) == [1, 4, 16, 32, 32, 15]
    assert chunk_sizes(100, 32, 1, to_host=False) == [15, 32, 32, 16, 4, 1]
    assert chunk_sizes(3, 32, 2, to_host=False) == [1, 2]
    for n in range(1, 200):
        for to_host in (True, False):
            sizes = chunk_sizes(n, 16, 2, to_host)
            assert sum(sizes) == n and all(0 < s <= 16 for s in sizes)


def test_staged_ramp_moves_every_byte(pool: HostPool) -> None:
    """Ten blocks through 4-block buffers with a one-block ramp: chunks of 1, 4, 4, 1 blocks
    (equal chunks would be 4, 4, 2), and every block lands where it should."""
    fake = FakeRuntime(deferred=True)
    block = logical_blocks(np.random.default_rng(0), 1)[0].nbytes
    opts = CudaCopyOptions(
        strategy="staged",
        max_streams=4,
        stage_bytes=4 * block,
        stage_ramp_bytes=block,
        staged_min_blocks=1,
    )
    backend, logical, arrays = _backend(pool, KVLayout.LAYER_KV_FIRST, "staged", fake, options=opts)
    blocks = [5, 17, 3, 0, 23, 9, 11, 2, 14, 19]
    slots = [7, 2, 11, 0, 3, 15, 8, 9, 1, 4]
    fake.calls.clear()
    backend.submit(CopyJob(1, Direction.STORE, blocks, slots))
    assert [c[2] for c in fake.calls if c[0] == "memcpy"] == [1, 4, 4, 1]
    fake.run()
    assert backend.poll().done == [1]
    for a in arrays:
        a.fill(0xDEAD)
    targets = [1, 2, 20, 21, 4, 8, 6, 7, 10, 12]
    fake.calls.clear()
    backend.submit(CopyJob(2, Direction.LOAD, targets, slots))
    load_batches = [c[2] for c in fake.calls if c[0] == "memcpy"]
    backend.wait([2])
    assert backend.poll().done == [2]
    got = to_logical(arrays, KVLayout.LAYER_KV_FIRST)
    for i, b in enumerate(targets):
        assert got[b].tobytes() == block_bytes(logical, blocks[i])
    assert load_batches == [1, 4, 4, 1]
    assert _idle(backend)
    backend.close()


def test_staged_joins_copies_of_neighbouring_slots(tmp_path: object) -> None:
    """Slots next to each other in the pool go as one copy per staging chunk (the staging side
    is contiguous), and every byte still lands where it should."""
    block = logical_blocks(np.random.default_rng(0), 1)[0].nbytes
    with HostPool.create(NUM_SLOTS, block, shm_dir=str(tmp_path)) as tight:
        assert tight.slot_stride == block  # neighbouring slots are contiguous
        fake = FakeRuntime(deferred=True)
        opts = CudaCopyOptions(
            strategy="staged", max_streams=4, stage_bytes=4 * block, staged_min_blocks=1
        )
        backend, logical, arrays = _backend(
            tight, KVLayout.LAYER_KV_FIRST, "staged", fake, options=opts
        )
        blocks, slots = [5, 17, 3, 0, 23, 9], [2, 3, 4, 5, 6, 9]
        fake.calls.clear()
        backend.submit(CopyJob(1, Direction.STORE, blocks, slots))
        # Chunks of 4 and 2 blocks: slots 2-5 in one copy; 6 and 9 are not neighbours.
        assert [c[2] for c in fake.calls if c[0] == "memcpy"] == [1, 2]
        fake.run()
        assert backend.poll().done == [1]
        for a in arrays:
            a.fill(0xDEAD)
        backend.submit(CopyJob(2, Direction.LOAD, [1, 2, 20, 21, 4, 8], slots))
        backend.wait([2])
        assert backend.poll().done == [2]
        got = to_logical(arrays, KVLayout.LAYER_KV_FIRST)
        for target, source in zip([1, 2, 20, 21, 4, 8], blocks, strict=True):
            assert got[target].tobytes() == block_bytes(logical, source)
        backend.close()


# -- the executor thread ------------------------------------------------------------------------


class _Device:
    """Runs the fake runtime's queue every millisecond, as a GPU would, until stopped."""

    def __init__(self, fake: FakeRuntime) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(fake,), daemon=True)
        self._thread.start()

    def _loop(self, fake: FakeRuntime) -> None:
        while not self._stop.wait(0.001):
            fake.run()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def _threaded(
    pool: HostPool, layout: KVLayout, fake: FakeRuntime, **options: object
) -> tuple[EmulatedBackend, np.ndarray, list[np.ndarray]]:
    logical = logical_blocks(np.random.default_rng(3), NUM_BLOCKS)
    arrays = engine_arrays(logical, layout)
    opts = CudaCopyOptions(max_streams=4, **options)  # type: ignore[arg-type]
    backend = EmulatedBackend(
        [FakeTensor(a) for a in arrays], layout, pool, opts, fake=fake, threaded=True
    )
    return backend, logical, arrays


def _drain(
    backend: EmulatedBackend, ids: set[int], timeout: float = 10.0
) -> tuple[list[int], list[int]]:
    """Poll until every id was reported: (done, failed), each in the order reported."""
    done: list[int] = []
    failed: list[int] = []
    deadline = time.monotonic() + timeout
    while set(done) | set(failed) != ids:
        res = backend.poll()
        done += res.done
        failed += res.failed
        assert time.monotonic() < deadline, f"not reported: {ids - set(done) - set(failed)}"
        time.sleep(0.0005)
    return done, failed


def _drain_done(backend: EmulatedBackend, ids: set[int]) -> list[int]:
    """``_drain`` where every job must succeed: the ids, sorted."""
    done, failed = _drain(backend, ids)
    assert failed == []
    return sorted(done)


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("strategy", ["dma", "kernel", "staged"])
def test_executor_moves_every_byte(pool: HostPool, layout: KVLayout, strategy: str) -> None:
    fake = FakeRuntime(deferred=True)
    device = _Device(fake)
    block = logical_blocks(np.random.default_rng(0), 1)[0].nbytes
    backend, logical, arrays = _threaded(
        pool,
        layout,
        fake,
        strategy=strategy,
        stage_bytes=2 * block,
        staged_min_blocks=1,
        max_in_flight=3,
    )
    rng = np.random.default_rng(5)
    # 16 one-block STOREs polled while they run, then all 16 back into other, poisoned blocks.
    blocks = rng.permutation(NUM_BLOCKS)[:NUM_SLOTS].tolist()
    for slot, b in enumerate(blocks):
        backend.submit(CopyJob(slot, Direction.STORE, [b], [slot]))
    assert _drain_done(backend, set(range(NUM_SLOTS))) == list(range(NUM_SLOTS))
    for a in arrays:
        a.fill(0xBEEF)
    targets = rng.permutation(NUM_BLOCKS)[:NUM_SLOTS].tolist()
    backend.submit(CopyJob(100, Direction.LOAD, targets[:8], list(range(8))))
    backend.submit(CopyJob(101, Direction.LOAD, targets[8:], list(range(8, NUM_SLOTS))))
    backend.wait([100, 101])
    assert sorted(backend.poll().done) == [100, 101]
    got = to_logical(arrays, layout)
    for b, t in zip(blocks, targets, strict=True):
        assert got[t].tobytes() == block_bytes(logical, b)
    for b in set(range(NUM_BLOCKS)) - set(targets):
        assert (got[b] == 0xBEEF).all()
    assert _idle(backend)
    backend.close()
    device.stop()
    assert fake.streams == set() and fake.events == set() and fake.registered == []


def test_submit_does_not_wait_for_the_executor(pool: HostPool) -> None:
    """While the executor is stuck in a slow CUDA call, submits still return at once."""
    fake = FakeRuntime(deferred=True)
    stuck, entered = threading.Event(), threading.Event()
    real_copy = fake.memcpy_async

    def slow_copy(*args: Any) -> None:
        entered.set()
        assert stuck.wait(10)
        real_copy(*args)

    fake.memcpy_async = slow_copy  # type: ignore[method-assign]
    backend, _, _ = _threaded(pool, KVLayout.BLOCK_COMPACT, fake, strategy="dma")
    backend.submit(CopyJob(0, Direction.STORE, [0], [0]))
    assert entered.wait(10)
    t0 = time.perf_counter()
    for job in range(1, 200):
        backend.submit(CopyJob(job, Direction.STORE, [job % NUM_BLOCKS], [job % NUM_SLOTS]))
    elapsed = time.perf_counter() - t0
    stats = backend.stats()
    assert stats.in_flight == 32 and stats.queued == 168  # planned up to max_in_flight
    assert elapsed < 5  # (a blocked submit would wait the 10 s for `stuck`)
    stuck.set()
    device = _Device(fake)
    assert _drain_done(backend, set(range(200))) == list(range(200))
    assert _idle(backend)
    backend.close()
    device.stop()


def test_in_flight_stays_bounded_and_wait_finds_queued_jobs(
    pool: HostPool,
) -> None:
    fake = FakeRuntime(deferred=True)
    seen: list[int] = []
    real_query = fake.event_query

    def query(event: int) -> bool:
        seen.append(backend.stats().in_flight)
        return real_query(event)

    fake.event_query = query  # type: ignore[method-assign]
    backend, _, _ = _threaded(pool, KVLayout.BLOCK_COMPACT, fake, strategy="dma", max_in_flight=2)
    for job in range(10):
        backend.submit(CopyJob(job, Direction.LOAD, [job], [job]))
    device = _Device(fake)
    backend.wait([9])  # queued behind 8 others: wait makes room
    assert 9 not in {t.job_id for t in backend._queue.queued}
    assert _drain_done(backend, set(range(10))) == list(range(10))
    assert max(seen) <= 2
    backend.close()
    device.stop()


def test_stream_wait_enqueues_a_queued_job_at_once(pool: HostPool) -> None:
    fake = FakeRuntime(deferred=True, sync_runs=False)  # the device runs nothing until told
    backend, _, _ = _threaded(pool, KVLayout.BLOCK_COMPACT, fake, strategy="dma", max_in_flight=1)
    for job in range(3):
        backend.submit(CopyJob(job, Direction.LOAD, [job], [job]))
    deadline = time.monotonic() + 10
    while backend.stats().in_flight < 1:  # job 0 enqueued; 1 and 2 wait for room
        assert time.monotonic() < deadline
        time.sleep(0.001)
    backend.stream_wait(2)  # now, ahead of job 1, though the device holds one transfer at most
    waits = [c for c in fake.calls if c[0] == "wait" and c[1] == COMPUTE_STREAM]
    assert len(waits) == 1
    records = {c[1]: c[2] for c in fake.calls if c[0] == "record"}
    assert records[waits[0][2]] != COMPUTE_STREAM  # it waits for an event on a copy stream
    assert backend.stats().in_flight == 2 and backend.stats().queued == 1
    device = _Device(fake)
    assert _drain_done(backend, {0, 1, 2}) == [0, 1, 2]
    backend.close()
    device.stop()
    assert fake.streams == set() and fake.events == set()


def test_executor_failures_are_reported_and_return_resources(pool: HostPool) -> None:
    fake = FakeRuntime(fail={"memcpy": 1})  # the second transfer's copy fails
    backend, _, _ = _threaded(pool, KVLayout.BLOCK_COMPACT, fake, strategy="dma")
    backend.submit(CopyJob(1, Direction.STORE, [1], [1]))
    backend.wait([1])
    backend.submit(CopyJob(2, Direction.STORE, [2], [2]))
    backend.submit(CopyJob(3, Direction.STORE, [3], [NUM_SLOTS]))  # bad slot
    backend.submit(CopyJob(4, Direction.STORE, [4], [4]))
    backend.wait([2, 3, 4])
    done, failed = _drain(backend, {1, 2, 3, 4})
    assert sorted(done) == [1, 4] and sorted(failed) == [2, 3]
    assert _idle(backend)
    backend.close()
    assert fake.streams == set() and fake.events == set()


def test_close_stops_the_executor_with_work_queued(pool: HostPool) -> None:
    fake = FakeRuntime(deferred=True)
    backend, _, _ = _threaded(pool, KVLayout.BLOCK_COMPACT, fake, strategy="dma", max_in_flight=2)
    for job in range(20):
        backend.submit(CopyJob(job, Direction.STORE, [job % NUM_BLOCKS], [job % NUM_SLOTS]))
    assert backend._executor is not None
    backend.close()  # the executor makes the pushed calls; event_synchronize runs the queue
    assert backend._executor is None and fake.callback_errors == []
    assert fake.streams == set() and fake.events == set() and fake.registered == []
    backend.submit(CopyJob(99, Direction.STORE, [0], [0]))
    assert backend.poll().failed == [99]


def test_a_failure_while_planning_fails_the_job_and_drains_what_it_recorded(
    pool: HostPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exception in the middle of recording (here: the second layer's event) fails that job
    only; the calls recorded before it still run and their streams are synchronized."""
    fake = FakeRuntime(deferred=True)
    backend, _, _ = _threaded(pool, KVLayout.LAYER_KV_FIRST, fake, strategy="kernel")
    real = backend._events.acquire
    calls = {"n": 0}

    def flaky() -> int:
        calls["n"] += 1
        if calls["n"] == 3:  # gate, layer 0, then layer 1
            raise RuntimeError("injected")
        return real()

    monkeypatch.setattr(backend._events, "acquire", flaky)
    backend.submit(CopyJob(1, Direction.STORE, [1, 2], [0, 1]), layerwise=True)
    monkeypatch.setattr(backend._events, "acquire", real)
    backend.submit(CopyJob(2, Direction.STORE, [3], [2]))
    device = _Device(fake)
    done, failed = _drain(backend, {1, 2})
    assert failed == [1] and done == [2]
    assert _idle(backend) and fake.callback_errors == []
    backend.close()
    device.stop()
    assert fake.streams == set() and fake.events == set()


def test_an_executor_that_stops_taking_work_hands_over_to_the_callers_thread(
    pool: HostPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeRuntime(deferred=True)
    backend, logical, _ = _threaded(pool, KVLayout.BLOCK_COMPACT, fake, strategy="dma")
    backend.submit(CopyJob(1, Direction.STORE, [1], [1]))
    executor = backend._executor
    assert executor is not None

    def refuse(program: Any) -> None:
        raise ExecutorUnavailable("out of memory (injected)")

    monkeypatch.setattr(executor, "push", refuse)
    backend.submit(CopyJob(2, Direction.STORE, [2], [2]))  # replayed here, after job 1 ran
    assert backend._executor is None
    backend.wait([1, 2])
    assert sorted(backend.poll().done) == [1, 2]
    for slot, block in ((1, 1), (2, 2)):
        assert _slot_part(pool, slot, 0, logical[block].nbytes) == block_bytes(logical, block)
    backend.close()
    assert fake.streams == set() and fake.events == set() and fake.callback_errors == []


@pytest.mark.parametrize("strategy", ["dma", "kernel", "staged"])
@pytest.mark.parametrize("blocks_per_slot", [2, 4])
def test_a_load_skips_the_positions_the_engine_holds(
    pool: HostPool, strategy: str, blocks_per_slot: int
) -> None:
    """``SKIP`` (vLLM's own cache holds the start of the first kvtier block): the skipped
    engine blocks stay as they are, every other position lands in its own engine block."""
    bps = blocks_per_slot
    fake = FakeRuntime(deferred=True)
    block = logical_blocks(np.random.default_rng(0), 1)[0].nbytes
    opts = CudaCopyOptions(
        strategy=strategy, max_streams=4, stage_bytes=2 * block + 5, staged_min_blocks=1
    )
    backend, logical, arrays = _backend(
        pool, KVLayout.LAYER_KV_FIRST, strategy, fake, options=opts, blocks_per_slot=bps
    )
    stored = list(range(2 * bps))  # two slots
    backend.submit(CopyJob(1, Direction.STORE, stored, [3, 6]))
    fake.run()
    assert backend.poll().done == [1]
    for a in arrays:
        a.fill(0xDEAD)
    targets = [SKIP] * (bps - 1) + list(range(10, 10 + bps + 1))
    backend.submit(CopyJob(2, Direction.LOAD, targets, [3, 6]))
    backend.wait([2])
    assert backend.poll().done == [2]
    got = to_logical(arrays, KVLayout.LAYER_KV_FIRST)
    for position, target in enumerate(targets):
        if target != SKIP:
            assert got[target].tobytes() == block_bytes(logical, stored[position]), position
    for b in set(range(NUM_BLOCKS)) - set(targets):
        assert (got[b] == 0xDEAD).all(), b
    # Nothing to copy: done at once. SKIP in a STORE: failed, never raised.
    backend.submit(CopyJob(3, Direction.LOAD, [SKIP] * bps, [3]))
    backend.submit(CopyJob(4, Direction.STORE, [SKIP, *range(1, bps)], [5]))
    backend.wait([3, 4])
    results = backend.poll()
    assert results.done == [3] and results.failed == [4]
    assert _idle(backend)
    backend.close()
    assert fake.streams == set() and fake.events == set()


@pytest.mark.parametrize("strategy", ["dma", "staged"])
def test_no_copy_runs_across_two_pinned_pieces(tmp_path: object, strategy: str) -> None:
    """Neighbouring slots are joined into one copy only inside one ``cudaHostRegister`` piece:
    a copy across two pieces fails on the device (cudaErrorInvalidValue on an H100, CUDA 13:
    it failed 44 of 164 stores of the 8-in-flight grid point and dropped 13,735 blocks)."""
    block = logical_blocks(np.random.default_rng(0), 1)[0].nbytes
    with HostPool.create(NUM_SLOTS, block, shm_dir=str(tmp_path)) as tight:
        fake = FakeRuntime(deferred=True)
        opts = CudaCopyOptions(
            strategy=strategy,
            max_streams=4,
            stage_bytes=8 * block,
            staged_min_blocks=1,
            register_chunk_bytes=4 * block,  # pieces of slots 0-3, 4-7, ...
        )
        backend, logical, arrays = _backend(
            tight, KVLayout.BLOCK_COMPACT, strategy, fake, options=opts
        )
        assert [n for _, n in fake.registered] == [4 * block] * (NUM_SLOTS // 4)
        blocks, slots = [5, 6, 7, 8, 9, 10], [2, 3, 4, 5, 6, 7]
        backend.submit(CopyJob(1, Direction.STORE, blocks, slots))
        fake.run()
        assert backend.poll() == CopyResults([1], [])
        # Slots 2-3 and 4-7 are two runs: one copy each, not one across slots 3 and 4.
        assert sum(c[2] for c in fake.calls if c[0] == "memcpy") == 2
        for a in arrays:
            a.fill(0xDEAD)
        targets = [1, 2, 20, 21, 4, 11]
        backend.submit(CopyJob(2, Direction.LOAD, targets, slots))
        backend.wait([2])
        assert backend.poll() == CopyResults([2], [])
        got = to_logical(arrays, KVLayout.BLOCK_COMPACT)
        for target, source in zip(targets, blocks, strict=True):
            assert got[target].tobytes() == block_bytes(logical, source)
        backend.close()
