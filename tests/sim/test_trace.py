"""Reading Mooncake-format traces."""

from __future__ import annotations

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


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "a JSON object per line"),
        ('{"input_length": 5}', "hash_ids must be a list of integers"),
        ('{"hash_ids": [1, "2"]}', "hash_ids must be a list of integers"),
        ('{"hash_ids": [true]}', "hash_ids must be a list of integers"),
        ('{"hash_ids": [1], "timestamp": "now"}', "timestamp must be a number"),
        ('{"hash_ids": [1], "input_length": -1}', "input_length must be a non-negative integer"),
        ('{"hash_ids": [1], "output_length": 1.5}', "output_length must be a non-negative"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=message) as info:
        read_trace(path)
    assert f"{path}:2" in str(info.value)


def test_missing_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "missing.jsonl")
