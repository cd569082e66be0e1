"""The fs tier with ``io_process: true``: block reads and writes in helper processes
(``io_process.py``, ``io_helper.py``). The same files as the tier's own threads write, corrupt
blocks still dropped, and a helper that dies, hangs or cannot start fails its block only."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.blocks import fill, make_key, make_keys, payload_for
from support.drivers import Driver

from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.tiers.fs import io_helper, io_process
from kvtier.tiers.fs.files import BlockFiles, Read
from kvtier.tiers.fs.io_process import HelperFiles
from kvtier.tiers.fs.tier import FsTier, Options
from kvtier.tiers.payload import HEADER_BYTES
from kvtier.validation import Section
from tiers.conftest import SLOT_BYTES

FILE_BYTES = HEADER_BYTES + SLOT_BYTES
MakeTier = Callable[..., FsTier]


@pytest.fixture
def make_tier(tmp_path: Path, pool: HostPool, namespace: Namespace) -> Iterator[MakeTier]:
    tiers: list[FsTier] = []

    def make(io: bool = True, threads: int = 2, **options: object) -> FsTier:
        opts = Options(
            path=str(tmp_path / "kv"),
            capacity=100 * FILE_BYTES,
            io_process=io,
            threads=threads,
            **options,  # type: ignore[arg-type]
        )
        tier = FsTier("disk", namespace, pool, opts)
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.close()


def helpers(tier: FsTier) -> HelperFiles:
    files = tier._files
    assert isinstance(files, HelperFiles)
    return files


def processes(tier: FsTier) -> list[subprocess.Popen[bytes]]:
    return [h.process for h in helpers(tier)._all]


def block_file(tier: FsTier, key: bytes) -> Path:
    return Path(tier.root) / key.hex()[:2] / f"{key.hex()}.kvb"


def test_blocks_round_trip_through_the_helpers_in_the_tiers_own_format(
    make_tier: MakeTier, pool: HostPool
) -> None:
    tier = make_tier()
    assert len(processes(tier)) == 2 and all(p.poll() is None for p in processes(tier))
    drive = Driver(tier)
    keys = make_keys(6)
    assert drive.store(keys, first_slot=0) == [True] * 6
    assert drive.load_exact(keys, first_slot=10) == [True] * 6
    assert tier.counters.write_blocks == tier.counters.read_blocks == 6
    assert tier.counters.errors == tier.counters.corrupt == 0
    for key in keys:
        assert block_file(tier, key).stat().st_size == FILE_BYTES
    tier.close()
    # The files are the fs tier's: a tier without helpers reads them, and its own files are
    # read by helpers.
    plain = make_tier(io=False)
    assert len(plain) == 6
    assert Driver(plain).load_exact(keys, first_slot=20) == [True] * 6
    more = make_keys(8)[6:]
    assert Driver(plain).store(more, first_slot=30) == [True, True]
    plain.close()
    again = make_tier()
    assert Driver(again).load_exact([*keys, *more], first_slot=40) == [True] * 8


def one_helper(make_tier: MakeTier, **options: object) -> tuple[FsTier, Driver, bytes]:
    """A tier with one I/O thread (one helper: the next block meets it) and a block stored."""
    tier = make_tier(threads=1, **options)
    drive = Driver(tier)
    key = make_key(2)
    assert drive.store(key)
    return tier, drive, key


def test_a_helper_found_dead_is_replaced_before_its_block(make_tier: MakeTier) -> None:
    tier, drive, first = one_helper(make_tier)
    (process,) = processes(tier)
    process.kill()
    process.wait()
    key = make_key(3)
    assert drive.store(key) is True and drive.load_exact(key) is True
    assert helpers(tier).started == 2 and tier.counters.errors == 0
    (alive,) = processes(tier)
    assert alive.poll() is None and alive.pid != process.pid
    assert drive.load_exact(first) is True


def test_a_helper_that_dies_on_a_block_fails_that_block_only(make_tier: MakeTier) -> None:
    tier, drive, key = one_helper(make_tier)
    (process,) = processes(tier)
    os.kill(process.pid, signal.SIGSTOP)  # alive, so the next block is handed to it
    killer = threading.Timer(0.3, os.kill, (process.pid, signal.SIGKILL))
    killer.start()
    try:
        assert drive.load_exact(key) is False  # it died holding the block
    finally:
        killer.join()
    assert process.returncode == -signal.SIGKILL and tier.counters.errors == 1
    assert drive.load_exact(key) is True and helpers(tier).started == 2


def test_a_helper_that_hangs_is_killed_and_reaped_before_its_block_fails(
    make_tier: MakeTier,
) -> None:
    tier, drive, key = one_helper(make_tier, io_timeout_s=0.3)
    (process,) = processes(tier)
    os.kill(process.pid, signal.SIGSTOP)  # a hung NFS server, as the helper sees it
    started = time.monotonic()
    assert drive.load_exact(key) is False
    assert time.monotonic() - started < 10
    # Reaped before the block was reported: nothing can write the slot after its failure.
    assert process.returncode == -signal.SIGKILL
    assert drive.load_exact(key) is True  # a new helper


def test_a_helper_that_cannot_start_fails_the_tier_clearly(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    def exits(self: io_process.Spawn, socket_fd: int) -> list[str]:
        return [sys.executable, "-c", "import sys; sys.exit(3)"]

    monkeypatch.setattr(io_process.Spawn, "command", exits)
    with pytest.raises(OSError, match=r"I/O helper did not start \(exit 3\)"):
        make_tier()


def test_a_restart_that_fails_fails_its_block_and_waits_before_the_next(
    make_tier: MakeTier, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(threads=1)
    drive = Driver(tier)
    (process,) = processes(tier)
    process.kill()
    process.wait()
    starts: list[float] = []
    real = io_process.Helper.__init__

    def failing(self: io_process.Helper, spawn: io_process.Spawn) -> None:
        starts.append(time.monotonic())
        raise OSError(5, "no helper today")

    monkeypatch.setattr(io_process.Helper, "__init__", failing)
    assert drive.store(make_key(5)) is False  # the dead helper's replacement did not start
    assert drive.store(make_key(6)) is False  # no start tried: too soon
    assert drive.store(make_key(7)) is False
    assert len(starts) == 1
    monkeypatch.setattr(io_process.Helper, "__init__", real)
    monkeypatch.setattr(io_process, "RESTART_AFTER_S", 0.0)
    helpers(tier)._next_start = 0.0
    assert drive.store(make_key(8)) is True


def test_close_ends_every_helper(make_tier: MakeTier) -> None:
    tier = make_tier(threads=3)
    started = processes(tier)
    assert len(started) == 3
    tier.close()
    for process in started:
        assert process.wait(timeout=10) == 0  # its socket closed: it left on its own
    assert Driver(tier).store(make_key(9)) is False


def test_a_buffer_outside_the_pool_is_written_in_this_process(
    make_tier: MakeTier, pool: HostPool
) -> None:
    tier = make_tier()
    files = helpers(tier)
    key = make_key(10)
    payload = memoryview(bytearray(payload_for(key, SLOT_BYTES)))
    assert pool.slot_of(payload) is None
    files.write(key, [memoryview(bytes(HEADER_BYTES)), payload])
    assert block_file(tier, key).stat().st_size == FILE_BYTES


def test_slot_of_names_only_whole_slots(pool: HostPool) -> None:
    assert [pool.slot_of(pool.view(s)) for s in (0, 5, pool.num_slots - 1)] == [
        0,
        5,
        pool.num_slots - 1,
    ]
    assert pool.slot_of(pool.view(3)[1:]) is None
    assert pool.slot_of(memoryview(bytearray(pool.slot_bytes))) is None
    whole = memoryview(pool.array()).cast("B")
    assert pool.slot_of(whole[1 : 1 + pool.slot_bytes]) is None


def test_io_process_is_an_fs_option() -> None:
    base = {"path": "/tmp/kv", "capacity": "1GiB"}
    assert Options.parse(Section({**base, "io_process": True}, "tiers[0]")).io_process is True
    assert Options.parse(Section(dict(base), "tiers[0]")).io_process is False
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.io_process"):
        Options.parse(Section({**base, "io_process": "yes please"}, "tiers[0]"))


def test_a_write_error_in_a_helper_reaches_the_tier_as_that_error(
    make_tier: MakeTier, pool: HostPool
) -> None:
    tier = make_tier()
    key = make_key(11)
    fill(pool, 0, key)
    (Path(tier.root) / key.hex()[:2]).write_bytes(b"")  # a file where its shard directory goes
    with pytest.raises(OSError) as raised:
        helpers(tier).write(key, [memoryview(bytes(HEADER_BYTES)), pool.view(0)])
    assert raised.value.errno == errno.ENOTDIR
    assert Driver(tier).store(key) is False and tier.counters.errors == 1


def test_a_request_the_helper_cannot_take_is_refused_never_a_miss(
    pool: HostPool, tmp_path: Path
) -> None:
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        files = BlockFiles(root, 0o600, 0o700, False)
        key = make_key(13)

        def status(message: bytes) -> int:
            code, _ = io_helper.ANSWER.unpack_from(io_helper.handle(message, files, pool, 0))
            return int(code)

        refused = [
            b"W",  # shorter than a request
            io_helper.read_request(pool.num_slots, key),  # a slot outside the pool
            io_helper.write_request(0, key, b"short header"),
            io_helper.REQUEST.pack(b"X", 0, key),
        ]
        assert [status(m) for m in refused] == [io_helper.REFUSED] * 4
        assert io_helper.REFUSED not in {read.value for read in Read}
        assert status(io_helper.read_request(0, key)) == Read.MISSING.value
    finally:
        os.close(root)


def test_after_close_a_block_fails_at_once_and_a_helper_in_use_is_killed(
    make_tier: MakeTier, pool: HostPool
) -> None:
    tier = make_tier(threads=2)
    files = helpers(tier)
    borrowed = files._idle.get()  # a thread in the middle of a block
    assert borrowed is not None
    tier.close()
    assert borrowed.process.wait(timeout=10) == -signal.SIGKILL
    key = make_key(14)
    fill(pool, 0, key)
    started = time.monotonic()
    with pytest.raises(OSError, match="closed"):
        files.write(key, [memoryview(bytes(HEADER_BYTES)), pool.view(0)])
    assert time.monotonic() - started < 5
    borrowed.stop()


def test_an_answer_of_the_wrong_size_is_a_failed_read_never_a_block(
    make_tier: MakeTier, pool: HostPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier()
    files = helpers(tier)
    found = io_helper.answer(Read.FOUND.value, 0, b"too short for a header")
    monkeypatch.setattr(files, "_call", lambda message: found)
    header = memoryview(bytearray(HEADER_BYTES))
    assert files.read(make_key(15), [header, pool.view(0)], FILE_BYTES) is Read.FAILED
    assert bytes(header) == bytes(HEADER_BYTES)  # nothing copied
    monkeypatch.setattr(files, "_call", lambda message: io_helper.answer(io_helper.REFUSED))
    assert files.read(make_key(15), [header, pool.view(0)], FILE_BYTES) is Read.FAILED
