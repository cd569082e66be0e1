"""scripts/install_vllm_cpu.sh's choice of where torch comes from, run for real with a Python
whose ``pip install`` only records its arguments (nothing is installed or downloaded)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "install_vllm_cpu.sh"


def run(tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    log = tmp_path / "pip-args"
    fake = tmp_path / "python"
    # `-m pip install ...` is recorded and "succeeds"; everything else is the real Python.
    fake.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1 $2 $3" == "-m pip install" ]]; then shift 3; echo "$*" >> '
        f'"{log}"; exit 0; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    fake.chmod(0o755)
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        env={**os.environ, "PYTHON": str(fake), "TORCH_VERSION": "9.9.9", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, log.read_text().splitlines() if log.exists() else []


def test_without_a_local_wheel_torch_comes_from_pytorchs_cpu_index(tmp_path: Path) -> None:
    proc, calls = run(tmp_path, WHEEL_DIR=str(tmp_path / "none"), TORCH_INDEX_URL="file:///idx")
    assert calls == [
        "--disable-pip-version-check --no-input --no-warn-conflicts "
        "--extra-index-url file:///idx torch==9.9.9+cpu"
    ]
    # Nothing was installed: the script's own check after the step catches it.
    assert proc.returncode == 1
    assert "torch==9.9.9+cpu from file:///idx" in proc.stderr
    assert "wanted 9.9.9" in proc.stderr


def test_a_local_cpu_wheel_wins_and_no_index_means_a_clear_stop(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "torch-9.9.9+cpu-cp311-cp311-linux_x86_64.whl").write_bytes(b"")
    _, calls = run(tmp_path, WHEEL_DIR=str(wheels))
    assert calls and calls[0].endswith(f"--find-links {wheels} torch==9.9.9")
    (tmp_path / "pip-args").unlink()
    proc, calls = run(tmp_path, WHEEL_DIR=str(tmp_path / "none"), TORCH_INDEX_URL="")
    assert calls == [] and proc.returncode == 1
    assert "TORCH_INDEX_URL is empty" in proc.stderr
