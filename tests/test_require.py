"""``KVTIER_REQUIRE``: without it a missing capability skips its tests; naming the capability
turns those skips into failures. Each case runs real test files of this suite in a child pytest
with the capability taken away (redis-server and cc hidden from PATH, vLLM made unimportable)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import require

ROOT = Path(__file__).resolve().parents[1]
REDIS_TEST = "tests/tiers/redis/test_redis_managers.py::test_engine_goes_on_without_a_dead_redis"
CC_TEST = (
    "tests/copy/cuda/test_cuda_executor_cache.py::test_a_fresh_cache_dir_is_private_and_reused"
)
VLLM_TESTS = "tests/integrations/vllm/test_vllm_scheduler.py"
EXIT_TESTS_FAILED, EXIT_INTERRUPTED, EXIT_USAGE, EXIT_NO_TESTS = 1, 2, 4, 5


def run_pytest(
    tmp_path: Path, *args: str, requires: str | None, path: str = "", pythonpath: str = ""
) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != require.ENV}
    if requires is not None:
        env[require.ENV] = requires
    env["PATH"] = path or str(tmp_path / "empty-bin")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in [pythonpath, env.get("PYTHONPATH")] if p)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


def test_a_missing_redis_server_skips_without_the_switch(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, REDIS_TEST, requires=None)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped" in done.stdout and "redis-server not installed" in done.stdout


def test_a_missing_redis_server_fails_when_redis_is_required(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, REDIS_TEST, requires="vllm, redis")
    assert done.returncode == EXIT_TESTS_FAILED, done.stdout + done.stderr
    # The fixture that starts the server fails: an error at the test's setup.
    assert "1 error" in done.stdout and "skipped" not in done.stdout
    assert "redis-server not installed (Debian" in done.stdout
    assert "KVTIER_REQUIRE requires redis" in done.stdout


def test_requiring_another_capability_still_skips(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, REDIS_TEST, requires="vllm")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped" in done.stdout


@require.unless("redis", None if shutil.which("redis-server") else "redis-server not installed")
def test_with_redis_server_on_path_the_required_test_runs(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, REDIS_TEST, requires="redis", path=os.environ["PATH"])
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 passed" in done.stdout


def test_a_marked_file_fails_each_test_when_required(tmp_path: Path) -> None:
    """``require.unless`` (a ``pytestmark``): with no C compiler on PATH."""
    skipped = run_pytest(tmp_path, CC_TEST, requires=None)
    assert skipped.returncode == 0 and "needs a C compiler" in skipped.stdout, skipped.stdout
    failed = run_pytest(tmp_path, CC_TEST, requires="cc")
    assert failed.returncode == EXIT_TESTS_FAILED, failed.stdout + failed.stderr
    assert "KVTIER_REQUIRE requires cc" in failed.stdout


def test_an_unimportable_module_fails_collection_when_required(tmp_path: Path) -> None:
    """``require.importorskip`` at module level: vLLM shadowed by a module that fails to import."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "vllm.py").write_text("raise ImportError('vllm hidden by the test')\n")
    args = (VLLM_TESTS,)
    skipped = run_pytest(tmp_path, *args, requires=None, pythonpath=str(shadow))
    # The whole file is skipped, so no test was collected.
    assert skipped.returncode == EXIT_NO_TESTS, skipped.stdout + skipped.stderr
    assert f"SKIPPED [1] {VLLM_TESTS}:" in skipped.stdout
    assert "vllm is not importable: vllm hidden by the test" in skipped.stdout
    failed = run_pytest(tmp_path, *args, requires="vllm", pythonpath=str(shadow))
    assert failed.returncode == EXIT_INTERRUPTED, failed.stdout + failed.stderr
    assert f"ERROR collecting {VLLM_TESTS}" in failed.stdout
    assert "KVTIER_REQUIRE requires vllm" in failed.stdout
    assert "skipped" not in failed.stdout


def test_an_unknown_capability_stops_the_run(tmp_path: Path) -> None:
    done = run_pytest(tmp_path, REDIS_TEST, requires="redis,reddis")
    assert done.returncode == EXIT_USAGE, done.stdout + done.stderr
    assert "KVTIER_REQUIRE: unknown capability reddis" in done.stderr
    assert "known: cc, extras, gpu, redis, root, vllm" in done.stderr


def test_missing_refuses_a_capability_it_does_not_know() -> None:
    with pytest.raises(ValueError, match="'reddis'"):
        require.missing("reddis", "typo")
    with pytest.raises(ValueError, match="'reddis'"):
        require.unless("reddis", None)
