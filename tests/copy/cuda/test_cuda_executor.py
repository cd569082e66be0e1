"""The native executor (``executor.c``) and the recorder, on the CPU: the same calls in the
same order as a replay on the caller's thread, failures, no GIL, fallback when it cannot build."""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.emulated_cuda import EmulatedBackend, FakeRuntime, FakeTensor

from kvtier.copy.base import CopyJob, Direction
from kvtier.copy.cuda import executor as cuda_executor
from kvtier.copy.cuda.backend import CudaCopyOptions
from kvtier.copy.cuda.executor import (
    Executor,
    ExecutorFunctions,
    ExecutorUnavailable,
    Program,
    ProgramState,
    Recorder,
)
from kvtier.copy.cuda.plan import KVLayout
from kvtier.copy.cuda.runtime import memcpy_attributes
from kvtier.pool import HostPool


def _program(fake: FakeRuntime) -> tuple[Program, np.ndarray, np.ndarray]:
    """Every kind of op: wait, record, one copy, a batch of two, a launch-free tail."""
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    s1, s2 = fake.stream_create(), fake.stream_create()
    e1 = fake.event_create()
    rec = Recorder(has_batch_memcpy=True)
    rec.event_record(e1, s1)
    rec.stream_wait_event(s2, e1)
    rec.memcpy_async(dst.ctypes.data, src.ctypes.data, 16, s2)
    base_d, base_s = dst.ctypes.data, src.ctypes.data
    rec.memcpy_batch_async(
        np.array([base_d + 16, base_d + 40], dtype=np.uintp),
        np.array([base_s + 16, base_s + 40], dtype=np.uintp),
        np.array([24, 24], dtype=np.uintp),
        memcpy_attributes(False, 0, True),
        s1,
    )
    rec.stream_synchronize(s1)
    return rec.program, src, dst


def _run(program: Program, fake: FakeRuntime, native: bool) -> None:
    if not native:
        program.replay(fake)
        return
    executor = Executor(fake.executor_functions(), False, 0)
    try:
        executor.push(program)
        assert executor.wait(program.seq, 10)
        assert executor.executed() == 1
    finally:
        executor.close()
    assert fake.callback_errors == []


@pytest.mark.parametrize("native", [True, False])
def test_a_program_makes_its_calls_in_order(native: bool) -> None:
    fake = FakeRuntime()
    program, src, dst = _program(fake)
    _run(program, fake, native)
    assert program.state is ProgramState.DONE
    assert [c[0] for c in fake.calls] == ["record", "wait", "memcpy", "memcpy"]
    assert fake.calls[-1][2] == 2  # one batch of two copies
    assert dst.tobytes() == src.tobytes()
    assert program.seconds > 0


@pytest.mark.parametrize("native", [True, False])
def test_a_failing_call_skips_the_rest_and_drains_the_streams_used(native: bool) -> None:
    fake = FakeRuntime(deferred=True, fail={"memcpy": 0})  # the first copy fails
    program, _, dst = _program(fake)
    synced: list[int] = []
    real_sync = fake.stream_synchronize

    def sync(stream: int) -> None:
        synced.append(stream)
        real_sync(stream)

    fake.stream_synchronize = sync  # type: ignore[method-assign]
    _run(program, fake, native)
    assert program.state is ProgramState.FAILED
    assert int(program.status[1]) == 999 and int(program.status[2]) == 2
    assert "error 999 in CUDA call 2 of 5" in program.error
    assert [c[0] for c in fake.calls] == ["record", "wait"]  # nothing after the failure
    stream_s1, stream_s2 = program.rows()[0][2], program.rows()[1][1]  # record's, wait's
    assert set(synced) == {stream_s1, stream_s2}
    assert fake.queue == [] and not dst.any()  # the record ran (drained); no copy happened


def _usleep() -> int:
    return ctypes.cast(ctypes.CDLL(None).usleep, ctypes.c_void_p).value or 0


def test_the_executor_runs_while_python_holds_the_gil() -> None:
    """Its calls need no GIL: with a switch interval of 30 s a thread that needed the GIL
    would wait 30 s for it while this one spins in Python."""
    sleep = _usleep()  # usleep(first argument): a stand-in CUDA call that takes time
    executor = Executor(ExecutorFunctions(0, sleep, sleep, sleep, sleep, sleep, sleep), False, 0)
    rec = Recorder(has_batch_memcpy=True)
    for _ in range(4):
        rec.stream_wait_event(50_000, 0)  # 50 ms each
    program = rec.program
    old = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        t0 = time.perf_counter()
        executor.push(program)
        spins = 0
        while program.status[0] == ProgramState.QUEUED and time.perf_counter() - t0 < 10:
            spins += 1
        elapsed = time.perf_counter() - t0
    finally:
        sys.setswitchinterval(old)
        executor.close()
    assert program.state is ProgramState.DONE
    assert 0.19 < elapsed < 5 and spins > 1000


def test_wait_times_out_and_close_runs_what_was_pushed() -> None:
    sleep = _usleep()
    executor = Executor(ExecutorFunctions(0, sleep, sleep, sleep, sleep, sleep, sleep), False, 0)
    programs = []
    for _ in range(3):
        rec = Recorder(has_batch_memcpy=True)
        rec.stream_wait_event(100_000, 0)
        programs.append(rec.program)
        executor.push(rec.program)
    assert [p.seq for p in programs] == [1, 2, 3]
    assert not executor.wait(3, 0.05)
    executor.close()
    assert all(p.state is ProgramState.DONE for p in programs)
    executor.close()  # twice is fine


def _compact_backend(pool: HostPool, fake: FakeRuntime) -> EmulatedBackend:
    arrays = [np.zeros((16, 2, 2, 4, 8, 8), dtype=np.uint16)]  # [blocks, layers, 2, tok, h, d]
    return EmulatedBackend(
        [FakeTensor(a) for a in arrays],
        KVLayout.BLOCK_COMPACT,
        pool,
        CudaCopyOptions(strategy="dma", max_streams=4),
        fake=fake,
        threaded=True,
    )


@pytest.fixture
def pool(tmp_path: Path) -> Any:
    with HostPool.create(8, 16 * 1024, shm_dir=str(tmp_path)) as p:
        yield p


def test_no_compiler_falls_back_to_the_callers_thread(
    pool: HostPool,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(cuda_executor, "_LIBRARY", None)
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", "false")  # a compiler that always fails
    with pytest.raises(ExecutorUnavailable, match=r"failed on executor\.c"):
        cuda_executor.load_library()
    fake = FakeRuntime()
    with caplog.at_level(logging.WARNING, logger="kvtier.copy.cuda.backend"):
        backend = _compact_backend(pool, fake)
    assert backend._executor is None
    assert "CUDA calls on the caller's thread" in caplog.text
    pool.array()[3] = 7
    backend.submit(CopyJob(1, Direction.LOAD, [5], [3]))
    backend.wait([1])
    assert backend.poll().done == [1]
    assert (backend._kv_refs[0].array[5].view(np.uint8) == 7).all()
    backend.close()


def test_events_go_back_to_the_pool_only_after_their_program_ran(pool: HostPool) -> None:
    """A wait that has not been made yet binds to the event's next record: if a gate event
    went back to the pool when recorded, a later submit could record it again and move it."""
    fake = FakeRuntime(deferred=True)
    stuck = threading.Event()
    real_copy = fake.memcpy_async

    def slow_copy(*args: Any) -> None:
        assert stuck.wait(10)
        real_copy(*args)

    fake.memcpy_async = slow_copy  # type: ignore[method-assign]
    backend = _compact_backend(pool, fake)
    for job in range(6):
        backend.submit(CopyJob(job, Direction.STORE, [job], [job]))
    pending = [t.program for t in backend._queue.inflight.values()]
    referenced = {
        op[2] if op[0] == cuda_executor.OP_WAIT else op[1]
        for p in pending
        if p is not None and p.state is ProgramState.QUEUED
        for op in p.rows()
        if op[0] in (cuda_executor.OP_WAIT, cuda_executor.OP_RECORD)
    }
    assert referenced and not referenced & set(backend._events._idle)
    stuck.set()
    backend.wait(list(range(6)))
    assert sorted(backend.poll().done) == list(range(6))
    assert backend.stats().idle
    backend.close()
    assert fake.streams == set() and fake.events == set() and fake.callback_errors == []


def test_dropped_programs_and_executor_are_run_before_their_memory_goes() -> None:
    """The caller may drop its programs, and the executor object, while the thread still has
    them queued: it holds them until they ran, and a collected executor first runs them. The
    stand-in copy is ``read(2)`` on a pipe, so the thread stays busy until the test writes."""
    libc = ctypes.CDLL(None)
    read = ctypes.cast(libc.read, ctypes.c_void_p).value or 0
    sleep = _usleep()
    reader, writer = os.pipe()
    scratch = np.zeros(1, dtype=np.uint8)
    executor = Executor(ExecutorFunctions(0, sleep, sleep, read, sleep, sleep, sleep), False, 0)
    for _ in range(20):
        rec = Recorder(has_batch_memcpy=True)
        rec.memcpy_async(reader, scratch.ctypes.data, 1, 0)  # read(reader, scratch, 1)
        executor.push(rec.program)
    del rec
    gc.collect()
    watch = executor._pending[-1]
    assert watch.state is ProgramState.QUEUED  # the thread waits in the first read
    feeder = threading.Timer(0.5, os.write, (writer, bytes(20)))
    feeder.start()
    del executor
    gc.collect()  # __del__ closes: waits until the 20 programs ran, then joins the thread
    assert watch.state is not ProgramState.QUEUED  # (it ran: read's byte count reads as an error)
    feeder.join()
    os.close(reader)
    os.close(writer)
    del scratch


@pytest.mark.parametrize("native", [True, False])
def test_an_empty_program_runs_and_is_done(native: bool) -> None:
    fake = FakeRuntime()
    program = Program()
    assert program.buffer()[1] == 0 and len(program.ops) == 0
    _run(program, fake, native)
    assert program.state is ProgramState.DONE and fake.calls == []
