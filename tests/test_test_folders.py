"""The test folders mirror ``src/kvtier`` (tests/README.md): every folder names a package, every
package with a module has a folder, and no root test file is named after a package or a module
that lives in one. Checked on the repository, and on small made-up trees to show each rule
catches what it is for."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CROSS_CUTTING = frozenset({"support", "plugin_examples", "chaos", "e2e"})
"""Test folders that mirror no package (tests/README.md says what each holds)."""
SCRIPT_FOLDERS = ("scripts", "benchmarks")
"""Where the repository's own scripts are; a root test may be named after one of them."""


def packages(src: Path) -> set[str]:
    """The packages under ``src`` as paths relative to it (``tiers/fs``)."""
    return {p.parent.relative_to(src).as_posix() for p in src.rglob("*/__init__.py")}


def folders_with_tests(tests: Path) -> set[str]:
    """The folders under ``tests`` that hold Python files, relative to it, cross-cutting ones and
    everything below them left out."""
    found = set()
    for path in tests.rglob("*.py"):
        parts = path.parent.relative_to(tests).parts
        if parts and parts[0] not in CROSS_CUTTING:
            found.add("/".join(parts))
    return found


def stray_folders(tests: Path, src: Path) -> list[str]:
    """Test folders with no package of the same path in ``src``."""
    return sorted(folders_with_tests(tests) - packages(src))


def untested_packages(tests: Path, src: Path) -> list[str]:
    """Packages holding a module besides ``__init__.py`` that have no test folder."""
    with_modules = {
        pkg
        for pkg in packages(src)
        if any(path.name != "__init__.py" for path in (src / pkg).glob("*.py"))
    }
    return sorted(with_modules - folders_with_tests(tests))


def _named_after(name: str, owners: set[str]) -> bool:
    return any(name == owner or name.startswith(owner + "_") for owner in owners)


def misplaced_root_tests(tests: Path, src: Path, repo: Path) -> list[str]:
    """Root test files named after a package or a module inside one (``test_manager.py`` while
    ``manager.py`` is in ``cache/``), unless the name is also that of a top-level module or of one
    of the repository's scripts: ``test_keys.py`` is for ``keys.py``, not ``tiers/redis/keys.py``.
    """
    in_packages = set()
    for pkg in packages(src):
        in_packages.update(pkg.split("/"))
        in_packages.update(p.stem for p in (src / pkg).glob("*.py") if not p.stem.startswith("__"))
    own = {p.stem for p in src.glob("*.py")}
    for folder in SCRIPT_FOLDERS:
        own.update(p.stem for p in (repo / folder).glob("*") if p.is_file())
    return sorted(
        path.name
        for path in tests.glob("test_*.py")
        if _named_after(path.stem[5:], in_packages) and not _named_after(path.stem[5:], own)
    )


def test_every_test_folder_names_a_package() -> None:
    assert stray_folders(ROOT / "tests", ROOT / "src" / "kvtier") == []


def test_every_package_with_a_module_has_a_test_folder() -> None:
    assert untested_packages(ROOT / "tests", ROOT / "src" / "kvtier") == []


def test_no_root_test_belongs_to_a_package() -> None:
    assert misplaced_root_tests(ROOT / "tests", ROOT / "src" / "kvtier", ROOT) == []


def _tree(root: Path, *files: str) -> None:
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A made-up repository: a top-level module, a package with a module, a package without one,
    a script, and tests that follow the rule."""
    _tree(
        tmp_path,
        "src/kvtier/__init__.py",
        "src/kvtier/keys.py",
        "src/kvtier/cache/__init__.py",
        "src/kvtier/cache/manager.py",
        "src/kvtier/cache/keys.py",
        "src/kvtier/data/__init__.py",
        "scripts/cache_check.py",
        "tests/test_keys.py",
        "tests/test_cache_check.py",
        "tests/cache/test_manager.py",
        "tests/support/helpers.py",
        "tests/e2e/vllm/test_run.py",
    )
    return tmp_path


def test_a_tree_that_follows_the_rule_passes(repo: Path) -> None:
    src = repo / "src" / "kvtier"
    assert stray_folders(repo / "tests", src) == []
    assert untested_packages(repo / "tests", src) == []
    assert misplaced_root_tests(repo / "tests", src, repo) == []


def test_a_folder_without_a_package_is_reported(repo: Path) -> None:
    _tree(repo, "tests/core/test_pool.py", "tests/cache/fs/test_files.py")
    assert stray_folders(repo / "tests", repo / "src" / "kvtier") == ["cache/fs", "core"]


def test_a_package_without_a_folder_is_reported(repo: Path) -> None:
    _tree(repo, "src/kvtier/tiers/__init__.py", "src/kvtier/tiers/memory.py")
    assert untested_packages(repo / "tests", repo / "src" / "kvtier") == ["tiers"]


@pytest.mark.parametrize("name", ["test_manager.py", "test_manager_faults.py", "test_cache.py"])
def test_a_root_test_of_a_package_is_reported(repo: Path, name: str) -> None:
    _tree(repo, f"tests/{name}")
    assert misplaced_root_tests(repo / "tests", repo / "src" / "kvtier", repo) == [name]
