"""The live-traffic recorder (``vllm.trace_path``): Mooncake lines ``kvtier simulate`` reads,
salted ids (equal prefixes equal, nothing recoverable), a salt that survives restarts."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvtier.errors import ConfigError
from kvtier.keys import Namespace, chain_keys
from kvtier.recorder import TraceRecorder, salt_path
from kvtier.sim.trace import read_trace

NS = Namespace(model="m", dtype="float32", block_tokens=4)


def request(req_id: str, tokens: list[int], max_tokens: int = 7) -> SimpleNamespace:
    return SimpleNamespace(request_id=req_id, num_prompt_tokens=len(tokens), max_tokens=max_tokens)


def keys(tokens: list[int]) -> list[bytes]:
    return chain_keys(NS, tokens[: len(tokens) // 4 * 4], None)


def test_lines_replay_and_ids_follow_prefixes(tmp_path: Path) -> None:
    clock = iter([1000.0, 1000.5, 1002.0]).__next__
    rec = TraceRecorder(tmp_path / "t.jsonl", 4, clock=clock)
    a = list(range(10))  # 2 full blocks + 2 tokens
    b = list(range(8)) + [99] * 5  # same first 2 blocks, then 1 more full block
    rec.record(request("a", a), keys(a))
    rec.record(request("a", a), keys(a))  # asked again (deferred, preempted): one line
    rec.record(request("b", b, 3), keys(b))
    rec.close()
    trace = read_trace(tmp_path / "t.jsonl")
    assert [(r.timestamp, r.input_length, r.output_length) for r in trace] == [
        (500.0, 10, 7),
        (2000.0, 13, 3),
    ]
    assert len(trace[0].hash_ids) == 2 and len(trace[1].hash_ids) == 3
    assert trace[1].hash_ids[:2] == trace[0].hash_ids
    assert len(set(trace[1].hash_ids)) == 3 and all(0 <= h < 2**63 for h in trace[1].hash_ids)
    assert stat.S_IMODE(os.stat(salt_path(tmp_path / "t.jsonl")).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "t.jsonl").st_mode) == 0o600


def test_salt_is_kept_across_restarts_and_differs_between_files(tmp_path: Path) -> None:
    tokens = list(range(8))
    first = TraceRecorder(tmp_path / "t.jsonl", 4)
    first.record(request("a", tokens), keys(tokens))
    first.close()
    again = TraceRecorder(tmp_path / "t.jsonl", 4)  # the engine restarted
    again.record(request("a", tokens), keys(tokens))
    again.close()
    other = TraceRecorder(tmp_path / "u.jsonl", 4)
    other.record(request("a", tokens), keys(tokens))
    other.close()
    one, two = read_trace(tmp_path / "t.jsonl")
    (three,) = read_trace(tmp_path / "u.jsonl")
    assert one.hash_ids == two.hash_ids
    assert set(three.hash_ids).isdisjoint(one.hash_ids)
    # Neither keys nor token ids appear in the file.
    text = (tmp_path / "t.jsonl").read_text()
    assert all(k.hex() not in text for k in keys(tokens))


def test_finished_request_id_may_be_recorded_again(tmp_path: Path) -> None:
    rec = TraceRecorder(tmp_path / "t.jsonl", 4)
    tokens = list(range(8))
    rec.record(request("a", tokens), keys(tokens))
    rec.forget("a")
    rec.record(request("a", tokens), keys(tokens))
    rec.close()
    assert len(read_trace(tmp_path / "t.jsonl")) == 2


def test_salt_of_another_block_size_or_garbage_is_refused(tmp_path: Path) -> None:
    TraceRecorder(tmp_path / "t.jsonl", 4).close()
    with pytest.raises(ConfigError, match=r"vllm\.trace_path.*8-token blocks"):
        TraceRecorder(tmp_path / "t.jsonl", 8)
    salt_path(tmp_path / "g.jsonl").write_text("not json")
    with pytest.raises(ConfigError, match=r"vllm\.trace_path.*salt file"):
        TraceRecorder(tmp_path / "g.jsonl", 4)
    with pytest.raises(ConfigError, match=r"vllm\.trace_path"):
        TraceRecorder(tmp_path / "missing-dir" / "t.jsonl", 4)


def test_a_failed_write_stops_recording_without_raising(tmp_path: Path) -> None:
    rec = TraceRecorder(tmp_path / "t.jsonl", 4)
    tokens = list(range(8))

    class Broken:
        def write(self, text: str) -> int:
            raise OSError(28, "No space left on device")

        def close(self) -> None:
            pass

    rec._file = Broken()  # type: ignore[assignment]
    rec.record(request("a", tokens), keys(tokens))  # logged, not raised
    rec.record(request("b", tokens), keys(tokens))
    assert rec.recorded == 0
    assert json.loads(salt_path(tmp_path / "t.jsonl").read_text())["block_tokens"] == 4


def constructed_in_time(path: Path, seconds: float = 5.0) -> TraceRecorder | BaseException:
    """``TraceRecorder(path, 4)`` on a thread that must end within ``seconds``: the recorder or
    what it raised."""
    out: list[TraceRecorder | BaseException] = []

    def build() -> None:
        try:
            out.append(TraceRecorder(path, 4))
        except BaseException as exc:  # handed to the test
            out.append(exc)

    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "the recorder's constructor blocked"
    return out[0]


@pytest.mark.parametrize("where", ["trace", "salt"])
def test_a_fifo_at_the_trace_or_its_salt_is_refused_without_blocking(
    tmp_path: Path, where: str
) -> None:
    trace = tmp_path / "t.jsonl"
    if where == "salt":
        TraceRecorder(trace, 4).close()
        salt_path(trace).unlink()
    os.mkfifo(trace if where == "trace" else salt_path(trace))
    got = constructed_in_time(trace)
    assert isinstance(got, ConfigError), got
    assert "vllm.trace_path" in str(got) and "not a regular file (a FIFO)" in str(got)


@pytest.mark.parametrize("target", ["/dev/zero", "real"])
def test_a_salt_or_trace_that_is_a_link_is_refused(tmp_path: Path, target: str) -> None:
    trace = tmp_path / "t.jsonl"
    if target == "real":  # even to a salt this recorder wrote
        TraceRecorder(tmp_path / "r.jsonl", 4).close()
        target = str(salt_path(tmp_path / "r.jsonl"))
    salt_path(trace).symlink_to(target)
    got = constructed_in_time(trace)
    assert isinstance(got, ConfigError) and "symbolic link" in str(got), got
    salt_path(trace).unlink()
    trace.symlink_to(tmp_path / "elsewhere.jsonl")
    got = constructed_in_time(trace)
    assert isinstance(got, ConfigError) and "symbolic link" in str(got), got
    assert not (tmp_path / "elsewhere.jsonl").exists()


@contextlib.contextmanager
def no_file_may_grow() -> Iterator[None]:
    """Every write to a regular file fails (EFBIG), as on a full disk, for this process."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_a_full_disk_at_the_first_start_disables_recording_and_leaves_no_salt(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    trace = tmp_path / "t.jsonl"
    tokens = list(range(8))
    with no_file_may_grow():
        rec = TraceRecorder(trace, 4)  # the engine starts anyway
        rec.record(request("a", tokens), keys(tokens))
        rec.close()
    assert rec.recorded == 0
    errors = [r for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "recording" in errors[0].getMessage()
    assert not salt_path(trace).exists()
    # Room again: the next start records (no bad salt blocks it).
    again = TraceRecorder(trace, 4)
    again.record(request("a", tokens), keys(tokens))
    again.close()
    assert again.recorded == 1 and len(read_trace(trace)) == 1


BAD_NUMBERS: list[object] = [
    float("nan"),
    float("inf"),
    -float("inf"),
    None,
    "12",
    -3,
    10**30,
    True,
    2.5,
    [],
]


def test_record_never_raises_on_odd_request_fields(tmp_path: Path) -> None:
    rec = TraceRecorder(tmp_path / "t.jsonl", 4)
    tokens = list(range(8))
    for i, bad in enumerate(BAD_NUMBERS):
        rec.record(
            SimpleNamespace(request_id=f"p{i}", num_prompt_tokens=bad, max_tokens=7),
            keys(tokens),
        )
        rec.record(
            SimpleNamespace(request_id=f"m{i}", num_prompt_tokens=8, max_tokens=bad),
            keys(tokens),
        )
    rec.record(SimpleNamespace(request_id=["unhashable"], num_prompt_tokens=8), keys(tokens))
    rec.record(SimpleNamespace(), keys(tokens))
    rec.close()
    trace = read_trace(tmp_path / "t.jsonl")  # every line written is one the replay reads
    assert rec.recorded == len(trace) >= 2 * len(BAD_NUMBERS)
    by_output = [r for r in trace if r.output_length == 7]
    assert all(r.input_length == 8 and len(r.hash_ids) == 2 for r in by_output)
