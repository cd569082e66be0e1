"""Which compiled executor gets loaded: only a file nobody else could have written (issue 15,
finding 15). Each case runs ``load_library()`` in a fresh process, with a planted library whose
constructor leaves a marker file when it is loaded. Needs a C compiler, no GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import require

from kvtier.copy.cuda import executor as cuda_executor

NOBODY = 65534
PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    const char *marker = getenv("KVTIER_TEST_MARKER");
    if (marker) { FILE *f = fopen(marker, "w"); if (f) { fputs("loaded", f); fclose(f); } }
}
"""

pytestmark = require.unless(
    "cc", None if shutil.which("cc") or shutil.which("gcc") else "needs a C compiler"
)


@pytest.fixture
def planted(tmp_path: Path) -> Path:
    source = tmp_path / "planted.c"
    source.write_text(PLANTED_C)
    library = tmp_path / "planted.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True, timeout=60
    )
    return library


def load_in_child(cache: Path, marker: Path) -> subprocess.CompletedProcess[str]:
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from kvtier.copy.cuda import executor as cuda_executor\n"
        "lib = cuda_executor.load_library()\n"
        "print('loaded', bool(lib.kvx_create))\n"
    )
    env = {**os.environ, "KVTIER_CACHE_DIR": str(cache), "KVTIER_TEST_MARKER": str(marker)}
    env.pop("CC", None)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def assert_built_not_planted(out: subprocess.CompletedProcess[str], marker: Path) -> None:
    assert not marker.exists(), "the planted library was loaded"
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "loaded True"  # the real executor, built here


def test_a_fresh_cache_dir_is_private_and_reused(tmp_path: Path) -> None:
    cache = tmp_path / "a" / "cache"
    marker = tmp_path / "marker"
    assert_built_not_planted(load_in_child(cache, marker), marker)
    assert (cache.stat().st_mode & 0o777) == 0o700
    built = cache / cuda_executor.library_name()
    first = built.stat()
    assert (first.st_mode & 0o022) == 0
    out = load_in_child(cache, marker)
    assert_built_not_planted(out, marker)
    again = built.stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # not rebuilt
    assert "not loaded" not in out.stderr and "not used" not in out.stderr


def test_a_world_writable_cache_dir_is_not_used(tmp_path: Path, planted: Path) -> None:
    """Before: whatever cuda_executor-*.so sat there was loaded (its code ran)."""
    cache = tmp_path / "shared"
    cache.mkdir()
    cache.chmod(0o777)
    shutil.copy(planted, cache / cuda_executor.library_name())
    marker = tmp_path / "marker"
    out = load_in_child(cache, marker)
    assert_built_not_planted(out, marker)
    assert f"copy executor cache {cache} not used: writable by group or others" in out.stderr
    assert (cache / cuda_executor.library_name()).read_bytes() == planted.read_bytes()  # untouched


def test_a_cache_dir_of_another_user_is_not_used(tmp_path: Path, planted: Path) -> None:
    cache = tmp_path / "theirs"
    cache.mkdir(mode=0o700)
    shutil.copy(planted, cache / cuda_executor.library_name())
    os.chown(cache, NOBODY, NOBODY)
    marker = tmp_path / "marker"
    out = load_in_child(cache, marker)
    assert_built_not_planted(out, marker)
    assert f"owned by uid {NOBODY}" in out.stderr


@pytest.mark.parametrize("how", ["world-writable", "foreign-owner", "symlink"])
def test_an_untrusted_cached_file_is_rebuilt_not_loaded(
    tmp_path: Path, planted: Path, how: str
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    target = cache / cuda_executor.library_name()
    if how == "symlink":
        target.symlink_to(planted)
    else:
        shutil.copy(planted, target)
        target.chmod(0o666 if how == "world-writable" else 0o755)
        if how == "foreign-owner":
            os.chown(target, NOBODY, NOBODY)
    marker = tmp_path / "marker"
    out = load_in_child(cache, marker)
    assert_built_not_planted(out, marker)
    assert f"copy executor {target} not loaded" in out.stderr
    st = os.lstat(target)  # replaced by a private build (a symlink is replaced, not followed)
    assert st.st_uid == os.geteuid() and (st.st_mode & 0o022) == 0 and not target.is_symlink()
    assert target.read_bytes() != planted.read_bytes()
    assert planted.exists()
