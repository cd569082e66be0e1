"""Every file kvtier opens by name goes through ``kvtier.safe_files`` (regular files only, never
blocking, bounded, private atomic writes). This walks the package's code for the calls that open
a file by name and fails on any outside that module that is not in the allow-list below, each
entry with the reason it may open files itself."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import kvtier

PACKAGE = Path(kvtier.__file__).parent
SAFE_MODULE = "safe_files.py"
PATH_METHODS = frozenset({"open", "read_text", "read_bytes", "write_text", "write_bytes"})

FS_TIER = (
    "the fs tier's block files: reached through directory descriptors with O_NOFOLLOW, lstat "
    "then O_NONBLOCK and fstat, O_EXCL temp names (docs/reliability.md, hostile-file rules)"
)
POOL = (
    "the host pool's shm files: directory descriptors, O_TMPFILE, O_NOFOLLOW | O_NONBLOCK then "
    "fstat, and the stale sweep's owner and lock checks (docs/reliability.md)"
)
PACKAGE_DATA = "a file of the installed package itself (importlib.resources), not a user's path"
ALLOWED: dict[tuple[str, str, str], str] = {
    ("tiers/fs/files.py", "open_root", "os.open"): FS_TIER,
    ("tiers/fs/files.py", "BlockFiles._open_regular", "os.open"): FS_TIER,
    ("tiers/fs/files.py", "BlockFiles._shard", "os.open"): FS_TIER,
    ("tiers/fs/files.py", "BlockFiles.write", "os.open"): FS_TIER,
    ("tiers/fs/files.py", "BlockFiles.scan", "os.open"): FS_TIER,
    ("tiers/fs/files.py", "BlockFiles._open_shard", "os.open"): FS_TIER,
    ("tiers/fs/files.py", "make_dirs", "os.open"): FS_TIER,
    ("pool.py", "HostPool.attach", "os.open"): POOL,
    ("pool.py", "_open_dir", "os.open"): POOL,
    ("pool.py", "_new_region", "os.open"): POOL,
    ("pool.py", "cleanup_stale_pools", "os.open"): POOL,
    ("pool.py", "_remove_if_stale", "os.open"): POOL,
    ("shared_pool/segment.py", "_attach", "os.open"): (
        "a shared pool's shm file: O_NOFOLLOW | O_NONBLOCK, then fstat: a regular file of this "
        "user (docs/reliability.md)"
    ),
    ("copy/cuda/executor.py", "_open_private", "os.open"): (
        "the built copy executor: O_NOFOLLOW | O_NONBLOCK, then fstat: a regular file of this "
        "user, not group/world-writable (docs/reliability.md)"
    ),
    ("copy/cuda/executor.py", "library_name", ".read_bytes"): PACKAGE_DATA,
    ("config.py", "bundled_config_mapping", ".read_text"): PACKAGE_DATA,
    ("registry.py", "declared", ".read_text"): PACKAGE_DATA,
    ("copy/cuda/runtime.py", "_loaded_library", "open"): "/proc/self/maps, a kernel file",
    ("sim/replay.py", "machine_description", "open"): "/proc/cpuinfo, a kernel file",
    ("cli.py", "main", "os.open"): "/dev/null, by its fixed name, over a stdout closed early",
    ("engine/planner.py", "Planner.after_alloc", ".open"): "JobLedger.open: a copy job",
    ("engine/planner.py", "Planner._store_order", ".open"): "JobLedger.open: a copy job",
    ("engine/hybrid.py", "HybridPlanner._store_order", ".open"): "JobLedger.open: a copy job",
    ("sim/sweep.py", "write_json", ".write_text"): (
        "an output file the user named (--sweep-json), written where asked like --sweep-png"
    ),
    ("demo/__init__.py", "write_model", ".write_text"): "the demo's model, in its own directory",
    ("demo/__main__.py", "main", ".write_text"): "the demo's results file (--json or its workdir)",
}


def callee(call: ast.Call) -> str | None:
    """``open``, ``os.open`` or ``.<method>`` for a call that opens a file by name, else None."""
    func = call.func
    if isinstance(func, ast.Name) and func.id == "open":
        return "open"
    if isinstance(func, ast.Attribute) and func.attr in PATH_METHODS:
        if func.attr == "open" and isinstance(func.value, ast.Name) and func.value.id == "os":
            return "os.open"
        return "." + func.attr
    return None


class OpenCalls(ast.NodeVisitor):
    """(enclosing function's qualified name, callee, line) of every such call in a module."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: list[tuple[str, str, int]] = []

    def _scoped(self, node: ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_ClassDef = visit_FunctionDef = visit_AsyncFunctionDef = _scoped

    def visit_Call(self, node: ast.Call) -> None:
        name = callee(node)
        if name is not None:
            self.found.append((".".join(self.scope) or "<module>", name, node.lineno))
        self.generic_visit(node)


def open_calls() -> Iterator[tuple[str, str, str, int]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative == SAFE_MODULE:
            continue
        visitor = OpenCalls()
        visitor.visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
        for function, name, line in visitor.found:
            yield relative, function, name, line


def test_every_file_opened_by_name_goes_through_safe_files() -> None:
    calls = list(open_calls())
    stray = [
        f"src/kvtier/{module}:{line} {function}: {name}(...)"
        for module, function, name, line in calls
        if (module, function, name) not in ALLOWED
    ]
    assert not stray, (
        "open files by name through kvtier.safe_files (or add an entry with its reason to "
        "ALLOWED):\n" + "\n".join(stray)
    )
    # Every entry still names a call: a stale entry would allow a new call there unseen.
    seen = {(module, function, name) for module, function, name, _ in calls}
    assert not set(ALLOWED) - seen, sorted(set(ALLOWED) - seen)
    print(f"\n{len(calls)} calls open a file by name outside safe_files, all allowed")


def test_the_walk_finds_every_kind_of_call() -> None:
    source = """
import os
from pathlib import Path

def f(p: Path) -> None:
    open(p)
    os.open(p, 0)
    p.open()
    p.read_text()
    p.read_bytes()
    p.write_text("")
    p.write_bytes(b"")

class C:
    def m(self) -> None:
        Path("x").read_text()
"""
    visitor = OpenCalls()
    visitor.visit(ast.parse(source))
    assert [(f, n) for f, n, _ in visitor.found] == [
        ("f", "open"),
        ("f", "os.open"),
        ("f", ".open"),
        ("f", ".read_text"),
        ("f", ".read_bytes"),
        ("f", ".write_text"),
        ("f", ".write_bytes"),
        ("C.m", ".read_text"),
    ]
