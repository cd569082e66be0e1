"""Sources of modules that fail at import in every way a module can, for the tests of the plugin
boundary: ``write_package`` lays them out as one package on a path the test puts on
``sys.path``."""

from __future__ import annotations

from pathlib import Path

SOURCES = {
    "raises": "raise RuntimeError('broken at import')\n",
    "getattr_raises": "def __getattr__(name):\n    raise RuntimeError('no attributes today')\n",
    "exits": "import sys\nsys.exit(7)\n",
    "exits_quietly": "raise SystemExit\n",
    "recursion": "def f():\n    return f()\nf()\n",
    "syntax": "def (:\n",
    "bad_str": (
        "class Odd(Exception):\n    def __str__(self):\n        raise ValueError('no text')\n"
        "raise Odd()\n"
    ),
    "long_error": "raise RuntimeError('x' * 1_000_000)\n",
}


def write_package(directory: Path) -> None:
    """Write the modules of ``SOURCES`` into ``directory``, a package (it is created)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "__init__.py").write_text("")
    for name, source in SOURCES.items():
        (directory / f"{name}.py").write_text(source)
