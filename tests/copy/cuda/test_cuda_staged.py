"""The staged pipeline's recorded ops, checked for ordering as a GPU would run them.

The emulated runtime runs everything in one FIFO, so it cannot catch a missing wait between
streams. Here the recorded programs of several staged transfers are replayed through a model of
CUDA's ordering rules (an op follows everything before it on its stream; a wait adds what the
event's latest record followed): every two ops touching the same staging buffer must be ordered,
every kernel (the only op touching engine blocks) must follow the transfer's gate, and the
transfer's final event everything it did.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.emulated_cuda import COMPUTE_STREAM, EmulatedBackend, FakeRuntime, FakeTensor
from support.kv_reference import block_bytes, engine_arrays, logical_blocks, to_logical

from kvtier.copy.base import CopyJob, Direction
from kvtier.copy.cuda import executor as cuda_executor
from kvtier.copy.cuda.backend import CudaCopyOptions
from kvtier.copy.cuda.executor import (
    OP_BATCH,
    OP_LAUNCH,
    OP_MEMCPY,
    OP_RECORD,
    OP_SYNC,
    OP_WAIT,
    STREAM_WORD,
    Program,
)
from kvtier.copy.cuda.plan import (
    ONE_PIECE,
    PARAM_HEADER_BYTES,
    KVLayout,
    pack_params,
    param_bytes,
)
from kvtier.copy.cuda.resources import StagingRing
from kvtier.copy.cuda.staged import StagedKernel, chunk_sizes, plan_staged
from kvtier.errors import ConfigError
from kvtier.pool import HostPool

NUM_BLOCKS = 40
NUM_SLOTS = 40
BLOCK = logical_blocks(np.random.default_rng(0), 1)[0].nbytes
"""Bytes of one engine block of the reference KV."""


@pytest.fixture
def pool(tmp_path: object) -> Iterator[HostPool]:
    with HostPool.create(NUM_SLOTS, BLOCK + 64, shm_dir=str(tmp_path)) as p:
        yield p


@dataclass
class Op:
    program: int
    index: int
    code: int
    stream: int
    buffers: set[tuple[bool, int]]
    """(ring, buffer) pairs of the staging memory the op touches."""


def _word(address: int) -> int:
    return int(ctypes.c_uint64.from_address(address).value)


def _staging_buffers(backend: EmulatedBackend, addresses: list[int]) -> set[tuple[bool, int]]:
    found = set()
    for to_host, ring in backend._rings.items():
        size = ring.buffer_bytes * len(ring.free)
        for a in addresses:
            if ring.base <= a < ring.base + size:
                found.add((to_host, (a - ring.base) // ring.buffer_bytes))
    return found


def _touched(backend: EmulatedBackend, op: list[int]) -> list[int]:
    """The addresses an op reads or writes (first and last of each list suffice: a chunk's
    staging side is one buffer)."""
    code = op[0]
    if code == OP_MEMCPY:
        return [op[1], op[2]]
    if code == OP_BATCH:
        count = op[4]
        return [_word(op[w] + 8 * i) for w in (1, 2) for i in (0, count - 1)]
    if code == OP_LAUNCH:
        params = _word(op[4])  # kernelParams[0]: the parameter bytes
        n_blocks = int(ctypes.c_int32.from_address(params + 24).value)
        return [_word(params + PARAM_HEADER_BYTES + 8 * i) for i in range(n_blocks)]
    return []


def _ordering(programs: list[list[list[int]]]) -> tuple[list[Op], list[set[int]]]:
    """Every op and the set of ops (by position) that precede it on the GPU."""
    ops: list[Op] = []
    before: list[set[int]] = []
    stream_state: dict[int, set[int]] = {}
    event_state: dict[int, set[int]] = {}
    for p, rows in enumerate(programs):
        for i, row in enumerate(rows):
            code, stream = row[0], row[STREAM_WORD[row[0]]]
            state = stream_state.setdefault(stream, set())
            if code == OP_WAIT:
                state |= event_state.get(row[2], set())
            elif code == OP_RECORD:
                event_state[row[1]] = set(state)
            position = len(ops)
            ops.append(Op(p, i, code, stream, set()))
            before.append(set(state))
            state.add(position)
    return ops, before


def _backend(
    pool: HostPool,
    opts: CudaCopyOptions,
    fake: FakeRuntime | None = None,
    seed: int = 1,
    threaded: bool = False,
) -> tuple[EmulatedBackend, np.ndarray, list[np.ndarray]]:
    """A backend over per-layer engine tensors of random blocks: (backend, logical, arrays)."""
    logical = logical_blocks(np.random.default_rng(seed), NUM_BLOCKS)
    arrays = engine_arrays(logical, KVLayout.LAYER_KV_FIRST)
    kv = [FakeTensor(a) for a in arrays]
    fake = fake or FakeRuntime()
    backend = EmulatedBackend(kv, KVLayout.LAYER_KV_FIRST, pool, opts, fake=fake, threaded=threaded)
    return backend, logical, arrays


def _staged_options(**options: Any) -> CudaCopyOptions:
    """``staged`` through three-block buffers with one-block ramps, unless overridden."""
    base: dict[str, Any] = {
        "strategy": "staged",
        "max_streams": 8,
        "stage_bytes": 3 * BLOCK,
        "stage_ramp_bytes": BLOCK,
        "staged_min_blocks": 1,
    }
    return CudaCopyOptions(**{**base, **options})


def _run_jobs(
    pool: HostPool, jobs: list[tuple[Direction, list[int], list[int]]], **options: Any
) -> tuple[EmulatedBackend, list[Program], np.ndarray, list[np.ndarray]]:
    """Submits and completes ``jobs``; their programs (which hold what their ops point at)."""
    opts = _staged_options(**options)
    backend, logical, arrays = _backend(pool, opts, FakeRuntime(deferred=True))
    programs = []
    for job_id, (direction, blocks, slots) in enumerate(jobs, 1):
        backend.submit(CopyJob(job_id, direction, blocks, slots))
        program = backend._queue.inflight[job_id].program
        assert program is not None
        programs.append(program)
    backend.wait(list(range(1, len(jobs) + 1)))
    assert sorted(backend.poll().done) == list(range(1, len(jobs) + 1))
    return backend, programs, logical, arrays


@pytest.mark.parametrize("shared", [True, False], ids=["shared-streams", "own-streams"])
@pytest.mark.parametrize("buffers", [2, 3])
def test_staged_ops_are_ordered_like_the_pipeline_needs(
    pool: HostPool, buffers: int, shared: bool
) -> None:
    rng = np.random.default_rng(buffers)
    blocks = [rng.permutation(NUM_BLOCKS)[:n].tolist() for n in (17, 11, 1, 13)]
    slots = [rng.permutation(NUM_SLOTS)[:n].tolist() for n in (17, 11, 1, 13)]
    jobs = [
        (Direction.STORE, blocks[0], slots[0]),
        (Direction.LOAD, blocks[1], slots[1]),
        (Direction.STORE, blocks[2], slots[2]),
        (Direction.LOAD, blocks[3], slots[3]),
        (Direction.STORE, blocks[3], slots[0][:13]),
    ]
    backend, kept, _, _ = _run_jobs(pool, jobs, stage_buffers=buffers, stage_shared_streams=shared)
    programs = [program.rows() for program in kept]
    ops, before = _ordering(programs)
    for op in ops:
        op.buffers = _staging_buffers(backend, _touched(backend, programs[op.program][op.index]))
    staging = [i for i, op in enumerate(ops) if op.buffers]
    # Every chunk touches its buffer twice (the kernel and the copy engine), in ~4 chunks.
    assert len(staging) >= 2 * sum(len(chunk_sizes(len(b), 3, 1, True)) for _, b, _ in jobs)
    for later in staging:
        for earlier in staging:
            if earlier < later and ops[earlier].buffers & ops[later].buffers:
                assert earlier in before[later], (ops[earlier], ops[later])
    for p, rows in enumerate(programs):
        mine = [i for i, op in enumerate(ops) if op.program == p]
        gate_wait = mine[1]  # the gate's record on the compute stream, then the wait on it
        assert rows[0][:3] == [OP_RECORD, rows[0][1], COMPUTE_STREAM]
        assert rows[1][0] == OP_WAIT and rows[1][2] == rows[0][1]
        done = mine[-1]  # the final record on the transfer's stream
        assert rows[-1][0] == OP_RECORD
        for i in mine[2:-1]:
            if ops[i].code == OP_LAUNCH:  # the only ops touching engine blocks
                assert gate_wait in before[i]
            if ops[i].code in (OP_LAUNCH, OP_MEMCPY, OP_BATCH):
                assert i in before[done]
        assert all(op[0] != OP_SYNC for op in rows)
    assert backend.stats().idle
    backend.close()


def test_staged_transfers_move_every_byte_in_many_chunks(pool: HostPool) -> None:
    """Stores then loads of 1 to 40 blocks through three-block buffers."""
    rng = np.random.default_rng(7)
    sizes = [1, 2, 3, 4, 7, 40]
    stores, loads = [], []
    for n in sizes:
        slots = rng.permutation(NUM_SLOTS)[:n].tolist()
        stores.append((Direction.STORE, rng.permutation(NUM_BLOCKS)[:n].tolist(), slots))
        loads.append((Direction.LOAD, rng.permutation(NUM_BLOCKS)[:n].tolist(), slots))
    for store, load in zip(stores, loads, strict=True):
        backend, _, logical, arrays = _run_jobs(pool, [store])
        for a in arrays:
            a.fill(0xDEAD)
        backend.submit(CopyJob(9, *load))
        backend.wait([9])
        assert backend.poll().done == [9]
        got = to_logical(arrays, KVLayout.LAYER_KV_FIRST)
        for target, source in zip(load[1], store[1], strict=True):
            assert got[target].tobytes() == block_bytes(logical, source)
        assert backend.stats().idle
        backend.close()


def test_staged_transfers_of_a_direction_share_its_staging_streams(pool: HostPool) -> None:
    """Staged transfers run on their ring's streams (kernels and gate on ``main``, DMAs on the
    lanes), not on the pool's; a small job still takes a pool stream; close destroys them all."""
    opts = _staged_options(max_streams=4, staged_min_blocks=2)
    fake = FakeRuntime(deferred=True)
    backend, _, _ = _backend(pool, opts, fake)
    store, load = backend._rings[True], backend._rings[False]
    jobs = [
        (1, Direction.STORE, [0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5, 6]),
        (2, Direction.STORE, [7, 8], [7, 8]),
        (3, Direction.LOAD, [9, 10, 11, 12], [0, 1, 2, 3]),
        (4, Direction.LOAD, [13], [4]),  # below staged_min_blocks: the kernel, a pool stream
    ]
    for job_id, direction, blocks, slots in jobs:
        backend.submit(CopyJob(job_id, direction, blocks, slots))
    transfers = {job_id: backend._queue.inflight[job_id] for job_id, *_ in jobs}
    assert transfers[1].stream == transfers[2].stream == store.main
    assert transfers[3].stream == load.main
    ring_streams = {store.main, *store.lanes, load.main, *load.lanes}
    assert len(ring_streams) == 2 * (1 + opts.stage_lanes)
    assert transfers[4].stream not in ring_streams
    assert backend.stats().streams_idle == backend.stats().streams_created - 1
    for job_id, ring in ((1, store), (3, load)):
        program = transfers[job_id].program
        assert program is not None
        rows = program.rows()
        kernels = {row[STREAM_WORD[OP_LAUNCH]] for row in rows if row[0] == OP_LAUNCH}
        dmas = {row[STREAM_WORD[row[0]]] for row in rows if row[0] in (OP_BATCH, OP_MEMCPY)}
        assert kernels == {ring.main}
        assert dmas == set(ring.lanes)
    fake.run()
    backend.wait([1, 2, 3, 4])
    assert sorted(backend.poll().done) == [1, 2, 3, 4]
    assert backend.stats().idle
    backend.close()
    assert fake.streams == set()


def test_staged_transfers_can_run_on_streams_of_their_own(pool: HostPool) -> None:
    opts = _staged_options(stage_shared_streams=False)
    fake = FakeRuntime(deferred=True)
    backend, _, _ = _backend(pool, opts, fake)
    for job_id in (1, 2):
        blocks = list(range(10 * job_id, 10 * job_id + 9))
        backend.submit(CopyJob(job_id, Direction.LOAD, blocks, list(range(9))))
    ring = backend._rings[False]
    taken = [backend._queue.inflight[job_id] for job_id in (1, 2)]
    streams = [t.stream for t in taken] + [s for t in taken for s in t.aux_streams]
    assert len(set(streams)) == 2 * (1 + opts.stage_lanes)
    assert not set(streams) & {ring.main, *ring.lanes}
    assert backend.stats().streams_idle == backend.stats().streams_created - len(streams)
    fake.run()
    backend.wait([1, 2])
    assert sorted(backend.poll().done) == [1, 2]
    assert backend.stats().idle
    backend.close()
    assert fake.streams == set()


def test_the_native_plan_packs_what_pack_params_packs() -> None:
    """Each chunk's kernel parameters are what ``pack_params`` writes for its blocks and
    staging addresses; its copy list joins neighbouring slots; the ring moves on and keeps the
    newest free event per buffer."""
    block = 4096
    rng = np.random.default_rng(8)
    sizes = [5, 8, 8, 2]
    n = sum(sizes)
    blocks = rng.permutation(1000)[:n].astype(np.int64)
    slots = rng.permutation(64)[:n]
    slots[6:9] = [40, 41, 42]  # three neighbours in chunk 1: one copy
    hosts = (0x7000_0000 + slots * block).astype(np.uint64)
    ring = StagingRing(None, 0x1_0000_0000, 8 * block, [0, 555], next=1)
    kernel = StagedKernel(77, 64, 512, 16, 8, 0xABC0, 1024, 4)
    events = list(range(1000, 1000 + 2 * len(sizes)))
    staged = plan_staged(
        blocks, hosts, False, block, sizes, 9, [21, 22], events, ring, kernel, 5, ONE_PIECE
    )
    rows = staged.rows.tolist()
    launches = [op for op in rows if op[0] == OP_LAUNCH]
    copies = [op for op in rows if op[0] in (OP_MEMCPY, OP_BATCH)]
    assert len(launches) == len(copies) == len(sizes)
    start = 0
    for k, (launch, copy, size) in enumerate(zip(launches, copies, sizes, strict=True)):
        buffer = (1 + k) % 2
        stage = ring.base + buffer * ring.buffer_bytes + block * np.arange(size, dtype=np.uint64)
        expected = np.zeros(param_bytes(64), dtype=np.uint8)
        part = slice(start, start + size)
        pack_params(expected, 64, 0xABC0, 1024, 0, 4, False, blocks[part], stage)
        got = ctypes.string_at(_word(launch[4]), param_bytes(64))
        assert got == expected.tobytes()
        assert launch[1:4] == [77, min(8, -(-size * 4 // 16)), 512] and launch[5] == 9
        targets = [int(a) for a in stage]
        if copy[0] == OP_MEMCPY:
            assert (copy[1], copy[2], copy[3]) == (targets[0], int(hosts[start]), size * block)
        else:
            dsts, srcs, lengths = (
                [_word(copy[w] + 8 * i) for i in range(copy[4])] for w in (1, 2, 3)
            )
            assert sum(lengths) == size * block and dsts[0] == targets[0]
            assert len(dsts) == (size - 2 if k == 1 else size)  # chunk 1's neighbours joined
            assert srcs[0] == int(hosts[start])
        assert copy[STREAM_WORD[copy[0]]] == [21, 22][k % 2]
        start += size
    # Chunk 0 took buffer 1 (after event 555), chunk 1 buffer 0 (never used), then each chunk
    # waits for the free event of the chunk two before it.
    waits = [
        op[2] for op in rows if (op[0] == OP_WAIT and op[2] >= 1000 + len(sizes)) or op[2] == 555
    ]
    assert waits == [555, 1004, 1005]
    assert ring.next == 1 and ring.free == [1007, 1006]
    assert sorted(staged.retired) == [555, 1000, 1001, 1002, 1003, 1004, 1005]


@pytest.mark.parametrize("threaded", [False, True])
def test_a_staged_transfer_failing_midway_returns_everything(
    pool: HostPool, threaded: bool
) -> None:
    """The second chunk's copy fails: the transfer is reported failed once, every stream and
    event goes back, and the ring still serves the next transfers byte for byte."""
    fake = FakeRuntime(fail={"memcpy": 1})
    opts = CudaCopyOptions(
        strategy="staged", max_streams=8, stage_bytes=3 * BLOCK, staged_min_blocks=1
    )
    backend, logical, arrays = _backend(pool, opts, fake, seed=2, threaded=threaded)
    backend.submit(CopyJob(1, Direction.STORE, list(range(9)), list(range(9))))
    backend.wait([1])
    assert backend.poll().failed == [1]
    assert backend.stats().idle and "memcpy" not in fake.fail
    backend.submit(CopyJob(2, Direction.STORE, list(range(9)), list(range(9))))
    backend.wait([2])
    for a in arrays:
        a.fill(0xDEAD)
    backend.submit(CopyJob(3, Direction.LOAD, list(range(10, 19)), list(range(9))))
    backend.wait([3])
    assert backend.poll().done == [2, 3]
    got = to_logical(arrays, KVLayout.LAYER_KV_FIRST)
    for i in range(9):
        assert got[10 + i].tobytes() == block_bytes(logical, i)
    assert backend.stats().idle and fake.callback_errors == []
    backend.close()
    assert fake.streams == set() and fake.events == set()


def test_running_out_of_events_while_planning_loses_none(pool: HostPool) -> None:
    """No events prefilled and event creation failing halfway through a staged plan's events:
    the job fails, and the events it had already taken go back to the pool."""
    fake = FakeRuntime()
    opts = CudaCopyOptions(
        strategy="staged",
        max_streams=4,
        stage_bytes=BLOCK,
        staged_min_blocks=1,
        prefill_events=0,
    )
    backend, _, _ = _backend(pool, opts, fake, seed=3)
    fake.fail["event_create"] = 3  # the gate's, then two of the plan's six, then a failure
    backend.submit(CopyJob(1, Direction.STORE, [1, 2, 3], [0, 1, 2]))
    backend.wait([1])
    assert backend.poll().failed == [1]
    stats = backend.stats()
    assert stats.idle and stats.events_created == 3 == stats.events_idle
    backend.close()
    assert fake.events == set()


@pytest.mark.parametrize("shared", [True, False], ids=["shared-streams", "own-streams"])
def test_a_store_failing_after_its_copies_were_recorded_drains_every_stream(
    pool: HostPool, shared: bool
) -> None:
    """Event creation fails at the store's closing hand-over, after its chunks' copies were
    recorded: the program synchronizes every stream they went to (the lanes too), so the job
    is reported failed only once nothing can touch its slots any more."""
    fake = FakeRuntime(deferred=True)
    opts = _staged_options(stage_bytes=BLOCK, prefill_events=0, stage_shared_streams=shared)
    backend, _, _ = _backend(pool, opts, fake, seed=4)
    fake.fail["event_create"] = 7  # the gate's and the plan's six, then the hand-over's: fails
    backend.submit(CopyJob(1, Direction.STORE, [1, 2, 3], [0, 1, 2]))
    transfer = backend._queue.inflight[1]
    assert transfer.failed and transfer.program is not None
    rows = transfer.program.rows()
    copies = {row[STREAM_WORD[row[0]]] for row in rows if row[0] in (OP_BATCH, OP_MEMCPY)}
    synced = {row[1] for row in rows if row[0] == OP_SYNC}
    assert len(copies) == opts.stage_lanes and copies | {transfer.stream} <= synced
    fake.run()
    backend.wait([1])
    assert backend.poll().failed == [1]
    assert backend.stats().idle
    backend.close()
    assert fake.events == set() and fake.streams == set()


def test_without_the_native_planner_staged_is_not_chosen(
    pool: HostPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the C file cannot be built, ``auto`` picks the kernel for small pieces and asking
    for ``staged`` is a configuration error that says why."""
    monkeypatch.setattr(cuda_executor, "_LIBRARY", None)
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    auto, _, _ = _backend(pool, CudaCopyOptions(max_streams=2), seed=4)
    assert auto.strategy == "kernel"
    auto.close()
    with pytest.raises(ConfigError, match="native planner"):
        _backend(pool, CudaCopyOptions(strategy="staged", max_streams=2), seed=4)


@pytest.mark.parametrize("threaded", [False, True])
def test_a_job_failing_before_any_call_is_recorded(pool: HostPool, threaded: bool) -> None:
    """No event for the gate (the first thing planned): the job fails alone, nothing leaks."""
    fake = FakeRuntime()
    opts = CudaCopyOptions(strategy="kernel", max_streams=2, prefill_events=0)
    backend, _, _ = _backend(pool, opts, fake, seed=5, threaded=threaded)
    fake.fail["event_create"] = 0
    backend.submit(CopyJob(1, Direction.STORE, [1], [0]))
    backend.wait([1])
    assert backend.poll().failed == [1]
    backend.submit(CopyJob(2, Direction.STORE, [1], [0]))
    backend.wait([2])
    assert backend.poll().done == [2]
    assert backend.stats().idle and fake.callback_errors == []
    backend.close()
