#!/usr/bin/env python3
"""Hold the line on size and repetition in the package source.

Fails (exit 1) when a file is over ``--max-file-lines`` lines, a function (or method) over
``--max-function-lines`` lines (``def`` to its last line), or a run of ``--dup-lines`` or more
identical lines appears twice in the source. Lines compare stripped of indentation; a window of
lines counts only when every line in it has more than 3 characters, so blank lines, brackets and
``else:`` alone never make a match. Exit 2: bad arguments or an unreadable allow file.

A duplicated run whose likeness is a coincidence (two records' field lists) is kept by naming the
pair of files in ``--allow`` (one ``path path  reason`` per line, paths relative to the root,
``#`` comments); an entry that matches nothing is reported so the list cannot go stale.

Usage: python3 scripts/check_sizes.py [--root src/kvtier] [--allow FILE] [--top N]
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
DUP_LINES = 6
MIN_LINE_CHARS = 4
"""A line shorter than this (``)``, ``else:``, blank) never starts or extends a matching window."""


@dataclass(frozen=True, slots=True)
class Sized:
    lines: int
    where: str
    """``path`` or ``path:line:function``."""


@dataclass(frozen=True, slots=True)
class DupRun:
    """Lines ``first[0]..first[1]`` of one file equal ``second[0]..second[1]`` of another (or
    of the same file)."""

    first_path: str
    first: tuple[int, int]
    second_path: str
    second: tuple[int, int]
    text: str
    """The run's first line, stripped."""

    def __str__(self) -> str:
        a, b = self.first, self.second
        n = a[1] - a[0] + 1
        return (
            f"{self.first_path}:{a[0]}-{a[1]} == {self.second_path}:{b[0]}-{b[1]} "
            f"({n} lines: {self.text[:60]})"
        )


@dataclass(frozen=True, slots=True)
class Allowed:
    pair: frozenset[str]
    reason: str
    line: int


@dataclass(slots=True)
class Report:
    files: list[Sized]
    functions: list[Sized]
    dups: list[DupRun]
    allowed: list[DupRun]
    unused_allow: list[Allowed]


def source_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def function_sizes(path: Path, rel: str, text: str) -> list[Sized]:
    out: list[Sized] = []
    for node in ast.walk(ast.parse(text, filename=str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            end = node.end_lineno if node.end_lineno is not None else node.lineno
            out.append(Sized(end - node.lineno + 1, f"{rel}:{node.lineno}:{node.name}"))
    return out


def duplicate_runs(texts: dict[str, list[str]], window: int) -> list[DupRun]:
    """Every pair of places sharing ``window`` or more identical (stripped) lines, each maximal
    run reported once."""
    seen: dict[tuple[str, ...], list[tuple[str, int]]] = defaultdict(list)
    for rel, lines in texts.items():
        stripped = [line.strip() for line in lines]
        for i in range(len(stripped) - window + 1):
            chunk = tuple(stripped[i : i + window])
            if all(len(line) >= MIN_LINE_CHARS for line in chunk):
                seen[chunk].append((rel, i + 1))
    # Matching windows of one pair of places at a fixed offset form runs: group their starts.
    starts: dict[tuple[str, str, int], list[int]] = defaultdict(list)
    for places in seen.values():
        for j, (path_a, line_a) in enumerate(places):
            for path_b, line_b in places[j + 1 :]:
                starts[(path_a, path_b, line_b - line_a)].append(line_a)
    runs: list[DupRun] = []
    for (path_a, path_b, offset), lines_a in starts.items():
        lines_a.sort()
        begin = prev = lines_a[0]
        for line in [*lines_a[1:], None]:
            if line is not None and line == prev + 1:
                prev = line
                continue
            end = prev + window - 1
            text = texts[path_a][begin - 1].strip()
            runs.append(DupRun(path_a, (begin, end), path_b, (begin + offset, end + offset), text))
            if line is not None:
                begin = prev = line
    runs.sort(key=lambda r: (r.first_path, r.first, r.second_path, r.second))
    return runs


def read_allow(path: Path) -> list[Allowed]:
    out: list[Allowed] = []
    for number, raw in enumerate(path.read_text().splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split(maxsplit=2)
        if len(parts) < 3:
            raise ValueError(f"{path}:{number}: want 'path path reason', got {raw.strip()!r}")
        out.append(Allowed(frozenset(parts[:2]), parts[2], number))
    return out


def check(root: Path, allow: list[Allowed], window: int = DUP_LINES) -> Report:
    files: list[Sized] = []
    functions: list[Sized] = []
    texts: dict[str, list[str]] = {}
    for path in source_files(root):
        rel = path.relative_to(root).as_posix()
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        texts[rel] = lines
        files.append(Sized(len(lines), rel))
        functions.extend(function_sizes(path, rel, text))
    files.sort(key=lambda s: (-s.lines, s.where))
    functions.sort(key=lambda s: (-s.lines, s.where))
    dups: list[DupRun] = []
    allowed: list[DupRun] = []
    used: set[int] = set()
    for run in duplicate_runs(texts, window):
        entry = next(
            (a for a in allow if a.pair == frozenset((run.first_path, run.second_path))), None
        )
        if entry is None:
            dups.append(run)
        else:
            allowed.append(run)
            used.add(entry.line)
    unused = [a for a in allow if a.line not in used]
    return Report(files, functions, dups, allowed, unused)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Fail on files, functions or repeated runs of lines over the limits."
    )
    parser.add_argument("--root", type=Path, default=Path("src/kvtier"), help="source folder")
    parser.add_argument("--max-file-lines", type=int, default=MAX_FILE_LINES)
    parser.add_argument("--max-function-lines", type=int, default=MAX_FUNCTION_LINES)
    parser.add_argument("--dup-lines", type=int, default=DUP_LINES, help="shortest repeated run")
    parser.add_argument("--allow", type=Path, default=None, help="file pairs kept alike")
    parser.add_argument("--top", type=int, default=5, help="list this many largest (0: none)")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"--root {args.root}: not a folder")
    if args.dup_lines < 2:
        parser.error("--dup-lines must be at least 2")
    try:
        allow = read_allow(args.allow) if args.allow is not None else []
    except (OSError, ValueError) as exc:
        print(f"check_sizes: {exc}", file=sys.stderr)
        return 2

    report = check(args.root, allow, args.dup_lines)
    big_files = [s for s in report.files if s.lines > args.max_file_lines]
    big_functions = [s for s in report.functions if s.lines > args.max_function_lines]
    if args.top:
        print(f"largest files in {args.root}:")
        for s in report.files[: args.top]:
            print(f"  {s.lines:5d}  {s.where}")
        print("largest functions:")
        for s in report.functions[: args.top]:
            print(f"  {s.lines:5d}  {s.where}")
    for s in big_files:
        print(f"FILE over {args.max_file_lines} lines: {s.where} ({s.lines})")
    for s in big_functions:
        print(f"FUNCTION over {args.max_function_lines} lines: {s.where} ({s.lines})")
    for run in report.dups:
        print(f"REPEATED run of {args.dup_lines}+ lines: {run}")
    for run in report.allowed:
        print(f"kept (allowed pair): {run}")
    for entry in report.unused_allow:
        print(f"ALLOW entry matches nothing: {args.allow}:{entry.line}")
    failed = bool(big_files or big_functions or report.dups or report.unused_allow)
    print(
        f"{'FAIL' if failed else 'ok'}: {len(big_files)} files over {args.max_file_lines} lines, "
        f"{len(big_functions)} functions over {args.max_function_lines}, "
        f"{len(report.dups)} repeated runs, {len(report.allowed)} kept"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
