"""The layer order of docs/architecture.md is a contract: every module of kvtier sits in one layer
of the table there, and no module imports (at its top or inside a function) from a layer above its
own. Read with ``ast`` from the sources, nothing imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kvtier"


def documented_layers() -> list[list[str]]:
    """The rows of the layer table in docs/architecture.md, top first: the names of the top-level
    modules and packages of ``kvtier`` in each (the backticked names of the second column)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    return [re.findall(r"`([\w.]+?)(?:/|\.py)?`", row.split("|")[2]) for row in rows]


def unit_of(module: str) -> str:
    """The top-level module or package of ``kvtier`` a dotted module name is in."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported kvtier module) for every import in the file, relative ones resolved."""
    found: list[tuple[int, str]] = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names] if base == "kvtier" else [base]
            found += [(node.lineno, name) for name in names]
    return [(line, name) for line, name in found if name.split(".")[0] == "kvtier"]


def modules() -> list[tuple[Path, str]]:
    out = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        out.append((path, ".".join(parts).removesuffix(".__init__")))
    return out


LAYERS = documented_layers()
LAYER_OF = {name: i for i, row in enumerate(LAYERS) for name in row}


def test_the_documented_table_has_the_layers_and_names_each_once() -> None:
    names = [name for row in LAYERS for name in row]
    assert len(LAYERS) >= 8, LAYERS
    assert len(names) == len(set(names)), names
    assert {"integrations", "engine", "cache", "config", "tiers", "copy", "pool"} <= set(names)


def test_every_module_and_package_of_kvtier_is_in_a_layer() -> None:
    units = {unit_of(module) for _, module in modules() if module != "kvtier"}
    units |= {p.name for p in SRC.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert units - set(LAYER_OF) == set(), "add them to the layer table of docs/architecture.md"
    assert set(LAYER_OF) - units == set(), "the layer table names modules that do not exist"


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = []
    for path, module in modules():
        if module == "kvtier":
            continue
        own = LAYER_OF[unit_of(module)]
        for line, target in imports(path, module):
            if target == "kvtier":
                continue
            if LAYER_OF[unit_of(target)] < own:
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    assert upward == [], "\n".join(upward)


@pytest.mark.parametrize(
    ("source", "module", "expected"),
    [
        ("from kvtier.cache.manager import TieredCache\n", "kvtier.tiers.fs.tier", "cache"),
        ("from kvtier import cli\n", "kvtier.engine.planner", "cli"),
        ("import kvtier.integrations.vllm\n", "kvtier.config", "integrations"),
        ("def f():\n    from kvtier.engine import copier\n", "kvtier.copy.cpu", "engine"),
        ("from ...engine import copier\n", "kvtier.copy.cuda.backend", "engine"),
    ],
)
def test_an_upward_import_is_seen(tmp_path: Path, source: str, module: str, expected: str) -> None:
    """The check itself: each form of import (absolute, ``from kvtier import``, a plain
    ``import``, one inside a function, a relative one) is found and named by its unit."""
    path = tmp_path / "m.py"
    path.write_text(source)
    (found,) = imports(path, module)
    assert unit_of(found[1]) == expected
    assert LAYER_OF[expected] < LAYER_OF[unit_of(module)]
