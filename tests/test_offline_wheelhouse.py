"""``scripts/vllm_offline_wheelhouse.py``: what it keeps, and parts that join back byte-exact."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest
from support.scripts import load_script


@pytest.fixture(scope="module")
def wh() -> ModuleType:
    return load_script("scripts/vllm_offline_wheelhouse.py")


def test_names_normalise_and_both_installed_formats_read(wh: ModuleType, tmp_path: Path) -> None:
    assert wh.normalize("Foo_Bar.baz") == "foo-bar-baz"
    freeze = tmp_path / "freeze.txt"
    freeze.write_text("# comment\nPyYAML==6.0.3\nnumba @ file:///x\n-e git+https://x\ntorch\n")
    assert wh.read_installed(freeze) == {"pyyaml", "numba", "torch"}
    assert "torch" in wh.read_installed(wh.DEFAULT_INSTALLED)


@pytest.mark.parametrize(
    ("filename", "fits"),
    [
        ("xgrammar-0.2.8-cp312-cp312-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl", True),
        ("vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl", True),
        ("interegular-0.3.3-py37-none-any.whl", True),
        ("six-1.17.0-py2.py3-none-any.whl", True),
        ("xgrammar-0.2.8-cp311-cp311-manylinux_2_28_x86_64.whl", False),
        ("pkg-1.0-cp313-abi3-manylinux_2_28_x86_64.whl", False),
        ("pkg-1.0-cp312-cp312-manylinux_2_28_aarch64.whl", False),
        ("pkg-1.0-cp312-cp312-macosx_11_0_arm64.whl", False),
        ("pkg-1.0.tar.gz", False),
    ],
)
def test_wheels_for_cpython_312_on_manylinux_x86_64(
    wh: ModuleType, filename: str, fits: bool
) -> None:
    assert wh._wheel_fits(filename, "3.12") is fits


def test_parts_join_back_byte_exact_and_a_bad_part_is_caught(
    wh: ModuleType, tmp_path: Path
) -> None:
    source = tmp_path / "wheelhouse.tar"
    data = os.urandom(2_500_000)
    source.write_bytes(data)
    parts = wh.split_file(source, tmp_path / "parts", 1_000_000)
    assert [p.stat().st_size for p in parts] == [1_000_000, 1_000_000, 500_000]
    joined = tmp_path / "joined.tar"
    wh.join_parts(tmp_path / "parts", joined)
    assert joined.read_bytes() == data

    parts[1].unlink()
    with pytest.raises(SystemExit, match="missing"):
        wh.join_parts(tmp_path / "parts", joined)
    broken = bytearray(data[1_000_000:2_000_000])
    broken[10] ^= 0xFF
    parts[1].write_bytes(bytes(broken))
    with pytest.raises(SystemExit, match="SHA-256 mismatch"):
        wh.join_parts(tmp_path / "parts", joined)
    (tmp_path / "parts" / wh.SUMS_NAME).unlink()
    with pytest.raises(SystemExit, match="SHA256SUMS"):
        wh.join_parts(tmp_path / "parts", joined)
