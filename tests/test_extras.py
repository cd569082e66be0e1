"""kvtier's optional extras: the table behind every install hint matches pyproject.toml, and a
built-in part whose extra is missing says how to install it into the running Python (kvtier is
on no package index, so ``pip install 'kvtier[redis]'`` would fail)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from kvtier.extras import EXTRAS, install_hint

ROOT = Path(__file__).resolve().parents[1]


def test_the_extras_table_is_pyprojects() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    declared = pyproject["project"]["optional-dependencies"]
    assert {name: tuple(declared[name]) for name in EXTRAS} == EXTRAS
    assert set(declared) - set(EXTRAS) == {"dev"}


def test_the_hint_names_this_python_and_the_packages() -> None:
    hint = install_hint("redis")
    assert hint.startswith(f"{sys.executable} -m pip install 'redis>=5' 'hiredis>=2' ")
    assert "pip install '.[redis]'" in hint and "kvtier[redis]" not in hint


def test_a_redis_tier_without_the_redis_client_names_the_install(tmp_path: Path) -> None:
    """Before: ``its dependency is not installed (No module named 'redis.exceptions'...)`` and
    nothing on how to install it."""
    config = tmp_path / "c.yaml"
    config.write_text("tiers: [{kind: redis, url: 'redis://127.0.0.1:6379/0'}]\n")
    # The redis client made unimportable, as where the extra was never installed.
    code = "import sys; sys.modules['redis'] = None; from kvtier.cli import main; sys.exit(main())"
    proc = subprocess.run(
        [sys.executable, "-c", code, "check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "invalid config tiers[0].kind='redis': its dependency is not installed" in proc.stderr
    assert f"install it: {sys.executable} -m pip install 'redis>=5' 'hiredis>=2'" in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
