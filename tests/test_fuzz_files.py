"""Fuzzing the files kvtier reads and writes by name: stats snapshots (``kvtier stats``, the file
``vllm.stats_path`` names) and the recorder's trace lines (``vllm.trace_path``).

The promises under test: a stats file, whatever it holds or is (random bytes, JSON with
``Infinity``, ``1e400``, giant integers, deep nesting, escape sequences in names; a FIFO, a
device, a link, a directory), is a report or one ``StatsFileError`` line (exit 2 from the CLI);
``TraceRecorder.record`` never raises whatever the request's fields hold, and every line it
writes is one ``kvtier simulate`` reads. Hypothesis runs derandomized; the counts are printed at
the end of the module.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import socket
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from support.fuzzing import counts_line, fuzz_settings, print_line

from kvtier.cli import main
from kvtier.recorder import TraceRecorder
from kvtier.sim.trace import read_trace
from kvtier.stats_report import StatsFileError, format_snapshot, read_snapshot

TRIED: Counter[str] = Counter()
WORK = Path(tempfile.mkdtemp(prefix="kvtier-fuzz-files-"))
N_STATS = 600
N_STATS_CLI = 150
N_RECORDS = 400


@pytest.fixture(scope="module", autouse=True)
def report_counts(request: pytest.FixtureRequest) -> Iterator[None]:
    """Prints the inputs tried, also under ``pytest -q``."""
    yield
    print_line(request, counts_line("file fuzz inputs tried", TRIED))


# -- stats files ---------------------------------------------------------------------------------

NASTY_NUMBER_TEXT = [
    "Infinity",
    "-Infinity",
    "NaN",
    "1e400",
    "-1e400",
    "1e-400",
    "9" * 5000,
    "-" + "9" * 30,
    "18446744073709551616",
    "0.5",
    "-0",
    "1E999999999",
]
NAMES = st.one_of(
    st.sampled_from(["cache", "tiers", "connector", "fs", "lookups", "hit_blocks", "pool_used"]),
    st.text(max_size=20),
    st.sampled_from(["\x1b[2J", "\x1b]0;x\x07", "\r", "a\nb", "\u202e", "x" * 300]),
)
LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(NAMES, inner, max_size=5),
    max_leaves=12,
)
SNAPSHOTS = st.fixed_dictionaries(
    {"cache": st.dictionaries(NAMES, VALUES, max_size=8)},
    optional={
        "tiers": st.dictionaries(NAMES, VALUES, max_size=4),
        "connector": st.dictionaries(NAMES, VALUES, max_size=4),
        "pool_slots": VALUES,
    },
)


@st.composite
def stats_texts(draw: st.DrawFn) -> bytes:
    """Snapshots and near-snapshots: a valid one, one with a nasty number spliced in, one cut
    short or nested deep, or random bytes."""
    kind = draw(st.sampled_from(["valid", "spliced", "cut", "deep", "bytes"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    text = json.dumps(draw(SNAPSHOTS))
    if kind == "spliced":
        number = draw(st.sampled_from(NASTY_NUMBER_TEXT))
        text = text.replace(": 0", ": " + number, 1) if ": 0" in text else text[:-1] + ', "x": '
        text += "" if text.endswith("}") else number + "}"
    elif kind == "cut":
        text = text[: draw(st.integers(0, len(text)))]
    elif kind == "deep":
        depth = draw(st.sampled_from([10, 1000, 100_000]))
        text = '{"cache": {}, "x": ' + "[" * depth + "]" * depth + "}"
    return text.encode("utf-8", "surrogatepass")


def write(name: str, content: bytes) -> Path:
    path = WORK / name
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    path.write_bytes(content)
    return path


def test_stats_files_read_and_format() -> None:
    @fuzz_settings(N_STATS)
    @given(stats_texts())
    def run(content: bytes) -> None:
        TRIED["stats file"] += 1
        path = write("stats.json", content)
        try:
            report = format_snapshot(read_snapshot(path))
        except StatsFileError as exc:
            assert "\n" not in str(exc) and str(exc).startswith(str(path))
            return
        assert report.isprintable() or all(line.isprintable() for line in report.split("\n"))

    run()


def run_stats_cli(path: Path | str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["stats", str(path)])
    return code, out.getvalue(), err.getvalue()


def test_stats_files_through_the_cli() -> None:
    @fuzz_settings(N_STATS_CLI)
    @given(stats_texts())
    def run(content: bytes) -> None:
        TRIED["kvtier stats"] += 1
        code, out, err = run_stats_cli(write("cli-stats.json", content))
        if code == 0:
            assert err == "" and "\x1b" not in out
        else:
            assert code == 2 and err.startswith("kvtier: error: ") and err.count("\n") == 1, err

    run()


def test_stats_paths_that_are_not_regular_files() -> None:
    """Each kind of non-file, through the CLI: one line, exit 2, at once."""
    place = Path(tempfile.mkdtemp(prefix="kvtier-fuzz-kinds-"))
    os.mkfifo(place / "fifo")
    (place / "dir").mkdir()
    (place / "link").symlink_to(write("real.json", b'{"cache": {}}'))
    (place / "dangling").symlink_to(place / "nowhere")
    (place / "zero").symlink_to("/dev/zero")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(place / "sock"))
    try:
        kinds = ["fifo", "dir", "link", "dangling", "zero", "sock"]
        for name in kinds:
            TRIED["stats path kinds"] += 1
            code, _, err = run_stats_cli(place / name)
            assert code == 2 and err.count("\n") == 1, (name, err)
            assert "not a regular file" in err, (name, err)
        for device in ("/dev/zero", "/dev/null", "/dev/urandom"):
            TRIED["stats path kinds"] += 1
            code, _, err = run_stats_cli(device)
            assert code == 2 and "not a regular file (a character device)" in err
    finally:
        sock.close()


# -- the recorder's records ------------------------------------------------------------------------

FIELD_VALUES: st.SearchStrategy[object] = st.one_of(
    st.sampled_from(
        [None, True, False, math.nan, math.inf, -math.inf, 0.5, -1, 2**63, 10**400, "", "12", []]
    ),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(),
    st.text(max_size=5),
)
REQUEST_IDS: st.SearchStrategy[object] = st.one_of(
    st.text(max_size=10), st.integers(), st.none(), st.lists(st.integers())
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[Any, list[bytes]]:
    fields: dict[str, Any] = {}
    for name, values in (
        ("request_id", REQUEST_IDS),
        ("num_prompt_tokens", FIELD_VALUES),
        ("max_tokens", FIELD_VALUES),
    ):
        if draw(st.booleans()) or name == "request_id":
            fields[name] = draw(values)
    keys = draw(st.lists(st.binary(min_size=16, max_size=16), max_size=6))
    return SimpleNamespace(**fields), keys


def test_records_never_raise_and_replay() -> None:
    trace = WORK / "recorded.jsonl"
    recorder = TraceRecorder(trace, 4)

    @fuzz_settings(N_RECORDS)
    @given(requests())
    def run(request: tuple[Any, list[bytes]]) -> None:
        TRIED["recorder records"] += 1
        before = recorder.recorded
        recorder.record(*request)  # never raises
        recorder.forget(getattr(request[0], "request_id", ""))
        assert recorder.recorded - before in (0, 1)

    try:
        run()
    finally:
        recorder.close()
    lines = read_trace(trace)  # every line written replays
    assert len(lines) == recorder.recorded > 0
    assert all(r.input_length >= 0 and r.output_length >= 0 for r in lines)
