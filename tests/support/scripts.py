"""Load a script of the repository (``scripts/``, ``benchmarks/``) as a module, for its tests."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load_script(relative: str) -> ModuleType:
    """The module of ``REPO / relative``, registered under its file name."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def benchmark_modules(*names: str) -> Iterator[list[ModuleType]]:
    """The ``benchmarks/`` modules ``names``, imported with that folder on ``sys.path`` (they
    import each other by name), which is left as it was when the block ends."""
    folder = str(REPO / "benchmarks")
    sys.path.insert(0, folder)
    try:
        yield [importlib.import_module(name) for name in names]
    finally:
        sys.path.remove(folder)
