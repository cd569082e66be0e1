"""``scripts/check_sizes.py``: the limits CI holds on file and function length and repeated runs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from support.scripts import REPO, load_script

BODY = [f"value_{i} = compute_{i}(argument_{i})" for i in range(8)]


@pytest.fixture(scope="module")
def cs() -> ModuleType:
    return load_script("scripts/check_sizes.py")


def write(root: Path, rel: str, lines: list[str]) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def run(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / "check_sizes.py"), "--root", str(root), *args],
        capture_output=True,
        text=True,
        check=False,
    )


def test_a_clean_tree_passes(tmp_path: Path) -> None:
    write(tmp_path, "a.py", ["def f():", *[f"    {line}" for line in BODY[:5]]])
    write(tmp_path, "pkg/b.py", ["x = 1", "", *["()"] * 6])
    write(tmp_path, "pkg/c.py", ["y = 2", "", *["()"] * 6])  # alike, but short lines
    result = run(tmp_path)
    assert result.returncode == 0, result.stdout
    assert "ok: 0 files over 600 lines, 0 functions over 80, 0 repeated runs" in result.stdout


def test_files_and_functions_over_the_limits_fail(tmp_path: Path) -> None:
    write(tmp_path, "big.py", [f"v{i} = {i}" for i in range(12)])
    write(tmp_path, "sub/f.py", ["x = 0", "async def long():", *["    await step()"] * 4])
    result = run(tmp_path, "--max-file-lines", "10", "--max-function-lines", "4", "--top", "0")
    assert result.returncode == 1
    assert "FILE over 10 lines: big.py (12)" in result.stdout
    assert "FUNCTION over 4 lines: sub/f.py:2:long (5)" in result.stdout
    assert "largest" not in result.stdout
    # exactly at the limits passes
    assert run(tmp_path, "--max-file-lines", "12", "--max-function-lines", "5").returncode == 0


def test_a_repeated_run_is_reported_once_with_both_ranges(cs: ModuleType, tmp_path: Path) -> None:
    write(tmp_path, "one.py", ["import os", *BODY[:7]])
    write(tmp_path, "two.py", ["import sys", "def g():", *[f"    {line}" for line in BODY[:7]]])
    write(tmp_path, "three.py", BODY[:5])  # 5 alike lines: under the limit
    report = cs.check(tmp_path, [])
    assert [str(r) for r in report.dups] == [
        "one.py:2-8 == two.py:3-9 (7 lines: value_0 = compute_0(argument_0))"
    ]
    result = run(tmp_path)
    assert result.returncode == 1
    assert "1 repeated runs" in result.stdout
    assert run(tmp_path, "--dup-lines", "8").returncode == 0


def test_a_repeat_within_one_file_counts(cs: ModuleType, tmp_path: Path) -> None:
    write(tmp_path, "self.py", [*BODY[:6], "other = 1", *BODY[:6]])
    (run_,) = cs.check(tmp_path, []).dups
    assert (run_.first_path, run_.first, run_.second_path, run_.second) == (
        "self.py",
        (1, 6),
        "self.py",
        (8, 13),
    )


def test_an_allowed_pair_is_kept_and_a_stale_entry_fails(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write(src, "rec/a.py", BODY[:6])
    write(src, "rec/b.py", BODY[:6])
    allow = tmp_path / "allow.txt"
    allow.write_text("# pairs\nrec/b.py rec/a.py  two records' field lists\n")
    result = run(src, "--allow", str(allow))
    assert result.returncode == 0, result.stdout
    assert "kept (allowed pair): rec/a.py:1-6 == rec/b.py:1-6" in result.stdout
    allow.write_text("rec/a.py rec/b.py  fields\nrec/a.py gone.py  once alike\n")
    result = run(src, "--allow", str(allow))
    assert result.returncode == 1
    assert f"ALLOW entry matches nothing: {allow}:2" in result.stdout


def test_bad_arguments_and_allow_files_exit_2(tmp_path: Path) -> None:
    write(tmp_path, "a.py", ["x = 1"])
    allow = tmp_path / "allow.txt"
    allow.write_text("a.py b.py\n")  # no reason
    result = run(tmp_path, "--allow", str(allow))
    assert result.returncode == 2
    assert f"{allow}:1: want 'path path reason'" in result.stderr
    assert run(tmp_path, "--allow", str(tmp_path / "missing.txt")).returncode == 2
    assert run(tmp_path / "nowhere").returncode == 2
    assert run(tmp_path, "--dup-lines", "1").returncode == 2
