"""``kvtier stats FILE``: whatever the file is (a FIFO, a device, JSON nested deep, numbers beyond
a float, escape sequences in names), one ``kvtier: error:`` line and exit 2, or a clean report."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from kvtier.cli import main


def stats_in_time(path: Path | str, seconds: float = 10.0) -> int:
    """``kvtier stats path`` on a thread that must end within ``seconds``."""
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(main(["stats", str(path)])), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "kvtier stats hung"
    assert codes, "kvtier stats raised"
    return codes[0]


def one_error_line(capsys: pytest.CaptureFixture[str], words: str) -> None:
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: ") and err.count("\n") == 1, err[:500]
    assert words in err, err
    assert "Traceback" not in err


SNAPSHOT = {"cache": {"lookups": 3, "lookup_blocks": 4, "hit_blocks": 2}, "tiers": {}}


def test_a_fifo_is_refused_without_blocking(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fifo = tmp_path / "stats.json"
    os.mkfifo(fifo)
    assert stats_in_time(fifo) == 2
    one_error_line(capsys, "not a regular file (a FIFO)")


@pytest.mark.parametrize("target", ["/dev/zero", "link"])
def test_a_device_or_a_link_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str
) -> None:
    if target == "link":
        real = tmp_path / "real.json"
        real.write_text(json.dumps(SNAPSHOT))
        (tmp_path / "link").symlink_to(real)
        target = str(tmp_path / "link")
    assert stats_in_time(target) == 2
    one_error_line(capsys, "not a regular file")


def test_a_huge_file_is_refused_before_it_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "big.json"
    with path.open("wb") as f:
        f.truncate(1 << 40)  # sparse: 1 TiB of zeros that take no disk
    assert stats_in_time(path) == 2
    one_error_line(capsys, "larger than")


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"cache": {"lookups": Infinity}}', "Infinity is not a number"),
        ('{"cache": {"lookups": -Infinity}}', "-Infinity is not a number"),
        ('{"cache": {"lookups": NaN}}', "NaN is not a number"),
        ('{"cache": {"lookups": 1e400}}', "beyond a float"),
        ('{"cache": {"lookups": ' + "9" * 5000 + "}}", "not a JSON stats snapshot"),
        ("\udcff", "not a JSON stats snapshot"),
    ],
    ids=["deep", "Infinity", "-Infinity", "NaN", "1e400", "digits", "not-utf8"],
)
def test_bad_json_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, words: str
) -> None:
    path = tmp_path / "stats.json"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    assert stats_in_time(path) == 2
    one_error_line(capsys, words)


@pytest.mark.parametrize(
    ("rate", "line"),
    [
        (12345.6, "costs     a tier read must beat a request's prefill, 12,345 tokens/s"),
        (None, None),  # nothing measured yet
        ("fast", None),
    ],
)
def test_the_prefill_rate_the_cost_rules_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], rate: object, line: str | None
) -> None:
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({**SNAPSHOT, "prefill_tokens_per_s": rate}))
    assert stats_in_time(path) == 0
    out = capsys.readouterr().out
    if line is None:
        assert "costs" not in out
    else:
        assert line in out


def test_each_tiers_read_rate_beside_the_prefill_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "stats.json"
    reads = {"fs": 17600.4, "redis": 0, "nvme": "fast"}  # unmeasured and odd values: left out
    path.write_text(
        json.dumps({**SNAPSHOT, "prefill_tokens_per_s": 48962, "read_tokens_per_s": reads})
    )
    assert stats_in_time(path) == 0
    out = capsys.readouterr().out
    assert "prefill, 48,962 tokens/s; fs reads 17,600 tokens/s\n" in out


def test_out_of_range_counts_and_hostile_names_print_safely(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    snapshot = {
        "cache": {"lookup_blocks": 1, "hit_blocks": 10**30, "lookups": -(10**30)},
        "tiers": {"\x1b[31mred\x1b[0m": {"lookups": 2, "read_bytes": 2**70}},
        "connector": {"hit_tokens": [[[1]]], "\x1b]0;title\x07": 1},
    }
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(snapshot))
    assert stats_in_time(path) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out
    assert "'\\x1b[31mred\\x1b[0m'" in out
    assert "lookups   0 (1 blocks): 0 hit" in out
