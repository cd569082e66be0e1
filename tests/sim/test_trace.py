"""Reading Mooncake-format traces."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest

from kvtier.sim.trace import TraceError, TraceRequest, bundled_trace_path, read_trace


def test_bundled_trace() -> None:
    requests = read_trace(bundled_trace_path())
    assert len(requests) == 3993
    assert sum(len(r.hash_ids) for r in requests) == 121877
    first = requests[0]
    assert first.timestamp == 0 and first.input_length == 40160 and first.output_length == 6
    assert first.hash_ids == tuple(range(79))
    # Each hash id covers a 512-token block of the prompt.
    assert all(-(-r.input_length // 512) == len(r.hash_ids) for r in requests)


def test_limit_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"hash_ids": [1, 2]}\n\n{"timestamp": 5.5, "hash_ids": [3]}\n{"hash_ids": []}\n'
    )
    assert read_trace(path) == [
        TraceRequest(0.0, 1024, 0, (1, 2)),
        TraceRequest(5.5, 512, 0, (3,)),
        TraceRequest(0.0, 0, 0, ()),
    ]
    assert len(read_trace(path, limit=2)) == 2


def short_id(value: object) -> str:
    """Test ids of a readable length (some inputs are 100,000 characters)."""
    text = str(value)
    return text if len(text) <= 40 else f"{text[:30]}...({len(text)} chars)"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "a JSON object per line"),
        ('{"input_length": 5}', "hash_ids must be a list of 128-bit signed integers"),
        ('{"hash_ids": [1, "2"]}', "hash_ids must be a list of 128-bit"),
        ('{"hash_ids": [true]}', "hash_ids must be a list of 128-bit"),
        ('{"hash_ids": [1], "timestamp": "now"}', "timestamp must be a finite number"),
        ('{"hash_ids": [1], "input_length": -1}', "input_length must be a non-negative 64-bit"),
        ('{"hash_ids": [1], "output_length": 1.5}', "output_length must be a non-negative"),
        # Each of these once escaped as RecursionError, OverflowError or a bare ValueError, or
        # passed (NaN, infinity, hash ids no key can hold).
        ("[" * 100_000 + "]" * 100_000, "not valid JSON \\(nested too deeply\\)"),
        ('{"hash_ids": [' + "7" * 5000 + "]}", "a number of too many digits"),
        ('{"hash_ids": [' + str(2**127) + "]}", "hash_ids must be a list of 128-bit"),
        ('{"hash_ids": [' + str(-(2**127) - 1) + "]}", "hash_ids must be a list of 128-bit"),
        ('{"hash_ids": [' + str(2**200) + "]}", "hash_ids must be a list of 128-bit"),
        ('{"hash_ids": [1], "timestamp": 1' + "0" * 400 + "}", "timestamp must be a finite"),
        ('{"hash_ids": [1], "timestamp": 1e400}', "timestamp must be a finite number, got inf"),
        ('{"hash_ids": [1], "timestamp": NaN}', "timestamp must be a finite number, got nan"),
        ('{"hash_ids": [1], "timestamp": -Infinity}', "timestamp must be a finite number"),
        ('{"hash_ids": [1], "input_length": ' + str(2**63) + "}", "input_length must be a non"),
    ],
    ids=short_id,
)
def test_bad_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=message) as info:
        read_trace(path)
    assert f"{path}:2" in str(info.value)


def test_extreme_but_valid_values_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "edge.jsonl"
    lo, hi = -(2**127), 2**127 - 1
    path.write_text(f'{{"hash_ids": [{lo}, {hi}], "timestamp": 1e300, "output_length": 0}}\n')
    assert read_trace(path) == [TraceRequest(1e300, 1024, 0, (lo, hi))]


def test_non_utf8_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"hash_ids": [1]}\n{"hash_ids": [2]}\n{"x": "caf\xe9", "hash_ids": [3]}\n')
    with pytest.raises(TraceError, match="not UTF-8") as info:
        read_trace(path)
    assert str(info.value).startswith(f"{path}:3: not UTF-8 (byte 11 of the line)")
    # the lines before it were read and are not lost with a limit
    assert len(read_trace(path, limit=2)) == 2


def test_missing_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "missing.jsonl")


def simulate_in_time(trace: Path | str, seconds: float = 20.0) -> int:
    """``kvtier simulate --trace`` on a thread that must end within ``seconds``."""
    from kvtier.cli import main

    codes: list[int] = []
    argv = ["simulate", "--trace", str(trace), "--no-progress", "--pool-blocks", "8"]
    thread = threading.Thread(target=lambda: codes.append(main(argv)), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "kvtier simulate hung"
    assert codes, "kvtier simulate raised"
    return codes[0]


def test_a_fifo_device_or_link_trace_is_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    link = tmp_path / "link.jsonl"
    link.symlink_to(bundled_trace_path())
    for path in (fifo, "/dev/zero", link):
        assert simulate_in_time(path) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvtier: error: cannot read trace {path}: not a regular file")
        assert err.count("\n") == 1


def test_a_huge_line_is_an_error_naming_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    with path.open("wb") as f:
        f.write(b'{"hash_ids": [1]}\n{"hash_ids": [1, ')
        f.truncate(2**30)  # a 1 GiB second line (sparse: no disk used)
    with pytest.raises(TraceError, match=rf"^{re.escape(str(path))}:2: a line longer than 16 MiB$"):
        read_trace(path)
    assert read_trace(path, limit=1) == [TraceRequest(0.0, 512, 0, (1,))]
    assert simulate_in_time(path) == 2
    assert f"{path}:2: a line longer than 16 MiB" in capsys.readouterr().err
