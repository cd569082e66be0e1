"""docs/vllm.md's install path for a vLLM environment: kvtier is on no package index, so a wheel
is built from the checkout (``python3 -m pip wheel --no-deps . -w dist``) and installed with the
environment's Python. Here the environment is a fresh virtual environment that sees this
machine's packages (numpy, PyYAML, redis, vLLM where installed), as vLLM's own would; nothing is
downloaded (``--no-build-isolation``, ``--no-index``)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import require

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.timeout(240)


def run(*args: str | Path, cwd: Path) -> str:
    proc = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_the_wheel_installs_into_an_environment_and_runs(tmp_path: Path) -> None:
    # A copy of what the wheel is built from: building in the checkout would leave build/
    # behind in a tree others use.
    source = tmp_path / "src-copy"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info"))
    dist = tmp_path / "dist"
    # The documented command, offline: the build backend comes from this machine.
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", ".",
        "-w", dist, cwd=source)  # fmt: skip
    wheels = list(dist.glob("kvtier-*-py3-none-any.whl"))
    assert len(wheels) == 1, list(dist.iterdir())

    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--system-site-packages", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
        f"{wheels[0]}[redis]", cwd=tmp_path)  # fmt: skip

    # Run from elsewhere: the installed copy is imported, not this checkout.
    where = run(python, "-c", "import kvtier; print(kvtier.__file__)", cwd=tmp_path)
    assert where.startswith(str(venv)), where
    assert run(venv / "bin" / "kvtier", "--version", cwd=tmp_path).strip() == "kvtier 0.1.0"
    out = run(venv / "bin" / "kvtier", "check-config", ROOT / "examples" / "pool-fs-redis.yaml",
              cwd=tmp_path)  # fmt: skip
    assert "tier shared: redis, write on_evict" in out
    # The bundled data travels in the wheel: simulate's default config and trace.
    out = run(venv / "bin" / "kvtier", "simulate", "--limit", "20", "--no-progress", cwd=tmp_path)
    assert "trace       synthetic_trace.jsonl: 20 requests" in out
    if require.vllm_missing() is None:
        connector = "from kvtier.integrations.vllm import KVTierConnector; print(KVTierConnector)"
        assert "kvtier.integrations.vllm" in run(python, "-c", connector, cwd=tmp_path)
