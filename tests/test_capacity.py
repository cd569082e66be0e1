"""``kvtier check-config`` warns when the pool or an fs tier asks for more than the free space."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from kvtier.capacity import DiskUsage, capacity_warnings
from kvtier.cli import main
from kvtier.config import load_config


def test_pool_and_fs_tier_beyond_free_space_are_named(tmp_path: Path) -> None:
    free_shm = shutil.disk_usage("/dev/shm").free
    free_tmp = shutil.disk_usage(tmp_path).free
    config = load_config(
        {
            "pool": {"size": free_shm + (1 << 30), "shm_dir": "/dev/shm"},
            "tiers": [
                {
                    "kind": "fs",
                    "name": "big",
                    "path": str(tmp_path / "a" / "b"),
                    "capacity": "1000TiB",
                },
                {"kind": "fs", "name": "small", "path": str(tmp_path / "c"), "capacity": "1MiB"},
            ],
        }
    )
    warnings = capacity_warnings(config)
    assert len(warnings) == 2, warnings
    assert (
        warnings[0].startswith("pool.size ") and "exceeds the free space of /dev/shm" in warnings[0]
    )
    assert warnings[1].startswith("tiers[0].capacity (big) 1000.0 TiB exceeds the free space of")
    # The tier's directory does not exist yet: its nearest existing parent was measured.
    assert str(tmp_path) in warnings[1] and free_tmp > 0


def test_config_that_fits_has_no_warning_and_an_unreadable_disk_is_said(tmp_path: Path) -> None:
    config = load_config(
        {
            "pool": {"size": "1MiB"},
            "tiers": [{"kind": "fs", "path": str(tmp_path), "capacity": "1MiB"}],
        }
    )
    assert capacity_warnings(config) == []

    def broken(path: str) -> DiskUsage:
        raise PermissionError(13, "Permission denied")

    warnings = capacity_warnings(config, usage=broken)
    assert warnings == [
        "pool.size: cannot tell the free space of /dev/shm (Permission denied)",
        f"tiers[0].capacity (fs): cannot tell the free space of {tmp_path} (Permission denied)",
    ]


def test_check_config_prints_the_warnings(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "pool": {"size": "1MiB"},
                "block": {"bytes": "1MiB"},  # one block: no warning that simulate refuses it
                "tiers": [{"kind": "fs", "path": str(tmp_path), "capacity": "1000TiB"}],
            }
        )
    )
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "valid" in out
    assert "warning: tiers[0].capacity (fs) 1000.0 TiB exceeds the free space of" in out
    assert "warning: pool.size" not in out


@pytest.mark.parametrize("field", ["pool.shm_dir", "tiers[0].path"])
def test_a_path_component_too_long_is_a_config_error_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str
) -> None:
    long = str(tmp_path / ("x" * 300) / "y")
    raw: dict[str, object] = {"pool": {"shm_dir": long if field == "pool.shm_dir" else "/dev/shm"}}
    if field == "tiers[0].path":
        raw["tiers"] = [{"kind": "fs", "path": long, "capacity": "1MiB"}]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["check-config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # not "valid" first
    assert err.startswith(f"kvtier: error: invalid config {field}=") and err.count("\n") == 1
    assert "File name too long" in err and "Traceback" not in err


def test_check_config_simulate_does_not_weigh_the_pool_against_shm(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Before: the bundled simulate config's 250 GiB pool was reported as exceeding /dev/shm,
    though ``kvtier simulate`` allocates none of ``pool.size`` (``--payload-bytes`` per block)."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"pool": {"size": "1000TiB", "shm_dir": str(tmp_path)}}))
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warning: pool.size 1000.0 TiB exceeds the free space of" in out
    assert "kvtier simulate does not: check-config --simulate" in out

    assert main(["check-config", "--simulate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "warning" not in out and "exceeds" not in out
    assert f"simulate: a pool of {1000 * 1024**4 // (64 << 20)} blocks of 64MiB" in out


def test_check_config_simulate_agrees_with_simulate_on_a_pool_under_one_block(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("pool: {size: 1000}\n")
    assert main(["check-config", "--simulate", str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "pool.size=1000: at least one block of 64.0 MiB" in err
    assert main(["simulate", "--config", str(path), "--limit", "1", "--no-progress"]) == 2
    assert "pool.size=1000: at least one block of 64.0 MiB" in capsys.readouterr().err


UNDER_ONE_SLOT = (
    "invalid config pool.size=10: at least 256 bytes (one block's slot: a block takes a multiple "
    "of 256 bytes, so a smaller pool holds none)"
)


@pytest.mark.parametrize("simulate", [False, True])
def test_check_config_and_simulate_both_refuse_a_pool_under_one_slot(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, simulate: bool
) -> None:
    """Before: plain ``check-config`` said ``valid`` for ``pool.size: 10``; simulate refused it."""
    path = tmp_path / "c.yaml"
    path.write_text("pool: {size: 10}\n")
    flags = ["--simulate"] if simulate else []
    assert main(["check-config", *flags, str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"kvtier: error: {UNDER_ONE_SLOT}\n"
    assert main(["simulate", "--config", str(path), "--limit", "1", "--no-progress"]) == 2
    assert capsys.readouterr().err == f"kvtier: error: {UNDER_ONE_SLOT}\n"


def test_plain_check_config_warns_of_a_pool_under_one_block_of_block_bytes(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """An engine sizes its blocks from the model, so the plain check does not refuse a pool
    under one block of ``block.bytes``; it says that simulate will (and it does)."""
    path = tmp_path / "c.yaml"
    path.write_text(f"pool: {{size: 1KiB, shm_dir: {tmp_path}}}\nblock: {{bytes: 2KiB}}\n")
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: valid"
    warnings = [line for line in out if line.startswith("warning")]
    assert warnings == [
        "warning: pool.size 1KiB holds no block of block.bytes (2KiB): kvtier simulate and "
        "check-config --simulate refuse it; an engine's blocks are its model's size (vLLM: "
        "block_size x vllm.blocks_per_slot tokens), and it refuses a pool under one block at start"
    ]
    assert main(["simulate", "--config", str(path), "--limit", "1", "--no-progress"]) == 2
    assert "pool.size=1024: at least one block of 2.0 KiB" in capsys.readouterr().err

    path.write_text(f"pool: {{size: 2KiB, shm_dir: {tmp_path}}}\nblock: {{bytes: 2KiB}}\n")
    assert main(["check-config", str(path)]) == 0
    assert "warning" not in capsys.readouterr().out  # one block: no warning


def test_the_bundled_simulate_config_checks_clean_for_simulate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvtier.sim.trace import bundled_trace_path

    bundled = bundled_trace_path().parent / "simulate.yaml"
    assert main(["check-config", "--simulate", str(bundled)]) == 0
    out = capsys.readouterr().out
    assert "simulate: a pool of 4000 blocks of 64MiB" in out and "warning" not in out
