"""The configs a user copies: ``examples/*.yaml`` and the examples of docs/configuration.md pass
``kvtier check-config``, and the error messages that document shows are the ones kvtier gives."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.cli import main
from kvtier.config import load_config
from kvtier.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
CONFIGURATION_MD = ROOT / "docs" / "configuration.md"
FREE_SPACE = re.compile(r"warning: \S+( \(\S+\))? [\d.]+ \w+ exceeds the free space of ")
"""The one warning an example may get: a size the machine running the test has no room for."""

EXPECTED_TIERS = {
    "pool-only.yaml": [],
    "pool-fs.yaml": ["tier nvme: fs, write through"],
    "pool-fs-redis.yaml": ["tier nvme: fs, write through", "tier shared: redis, write on_evict"],
}


def test_every_example_is_listed() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == sorted(EXPECTED_TIERS)
    listing = (EXAMPLES / "README.md").read_text()
    assert all(f"[{name}]({name})" in listing for name in EXPECTED_TIERS)


@pytest.mark.parametrize("name", sorted(EXPECTED_TIERS))
def test_an_example_passes_check_config(capsys: pytest.CaptureFixture[str], name: str) -> None:
    assert main(["check-config", str(EXAMPLES / name)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{EXAMPLES / name}: valid"
    assert [line for line in out if line.startswith("tier ")] == EXPECTED_TIERS[name]
    warnings = [line for line in out if line.startswith(("warning", " "))]
    assert all(FREE_SPACE.match(w) for w in warnings if w.startswith("warning")), out
    assert out[1] == "model (from the engine), tenant default" and out[2].startswith("pool 16GiB")


def test_the_examples_readme_turns_a_file_into_vllms_transfer_config() -> None:
    text = (EXAMPLES / "README.md").read_text()
    match = re.search(r"\n    python -c '(.*?)' examples/pool-fs\.yaml\n", text, re.S)
    assert match, "the python -c command is not in examples/README.md"
    code = match.group(1).replace("\n      ", " ")
    proc = subprocess.run(
        [sys.executable, "-c", code, "examples/pool-fs.yaml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    transfer = json.loads(proc.stdout)
    assert transfer["kv_connector"] == "KVTierConnector"
    assert transfer["kv_connector_module_path"] == "kvtier.integrations.vllm"
    extra = transfer["kv_connector_extra_config"]
    assert extra == yaml.safe_load((EXAMPLES / "pool-fs.yaml").read_text())
    assert load_config(extra).tiers[0].name == "nvme"


def _configuration_example() -> str:
    match = re.search(r"## Example\n\n```yaml\n(.*?)```", CONFIGURATION_MD.read_text(), re.S)
    assert match, "docs/configuration.md has no '## Example' YAML block"
    return match.group(1)


def test_the_full_example_of_the_configuration_doc_passes_check_config(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(_configuration_example())
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "tier nvme: fs, write through\n  path /mnt/nvme/kvtier, capacity 2TB (1.8 TiB)," in out
    assert "tier redis: redis, write on_evict\n  url redis://cache.internal:6379/0," in out


def _documented_errors() -> list[str]:
    text = CONFIGURATION_MD.read_text()
    match = re.search(r"for example\n\n((?:    invalid config .*\n)+)", text)
    assert match, "docs/configuration.md shows no example errors"
    return [line.strip() for line in match.group(1).splitlines()]


DOCUMENTED_ERRORS: list[dict[str, Any]] = [
    {"tiers": [{"kind": "memory"}, {"kind": "fs", "path": "/tmp/kv", "capacity": "lots"}]},
    {"pool": {"sise": "1GiB"}},
    {"tiers": [{"kind": "fs", "path": "/x", "capacty": "1GB"}]},
]
"""The configs whose errors docs/configuration.md quotes, in its order."""


def test_the_configuration_docs_error_examples_are_the_real_messages() -> None:
    """Before: the doc showed ``pool.sise='1GiB': ...; known: allow_pageable, shm_dir, size``,
    while kvtier hides an unknown key's value and knows three more pool keys."""
    real = []
    for raw in DOCUMENTED_ERRORS:
        with pytest.raises(ConfigError) as info:
            load_config(raw)
        real.append(str(info.value))
    assert _documented_errors() == real, "update docs/configuration.md's example errors"


def _rows(report: str) -> dict[str, tuple[int, float]]:
    """``tier -> (hit blocks, hit ratio)`` of a simulate report's table."""
    rows = re.findall(r"^(pool|fs|all) +(\d+) +([\d.]+)", report, re.M)
    return {name: (int(hits), float(ratio)) for name, hits, ratio in rows}


def test_the_readmes_disk_tier_example_shows_disk_hits(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Before: ``--tier fs:/tmp/kvtier-fs:4GiB`` held 64 blocks and showed an fs hit ratio of
    0.0000, with no output in the README."""
    text = (ROOT / "README.md").read_text()
    match = re.search(
        r"\n    (kvtier simulate --pool-blocks \d+ --tier fs:/tmp/kvtier-fs:\S+)\n\n```\n(.*?)```",
        text,
        re.S,
    )
    assert match, "README: the disk tier example and its output"
    command, shown = match.group(1), match.group(2)
    rows = _rows(shown)
    assert rows["fs"][1] > 0.1 and rows["all"][0] == rows["pool"][0] + rows["fs"][0], shown

    # The same command, on the first 800 requests, into a directory of the test's own.
    args = command.replace("/tmp/kvtier-fs", str(tmp_path / "fs")).split()[1:]
    assert main([*args, "--limit", "800", "--no-progress"]) == 0
    out = capsys.readouterr().out
    tiers = next(line for line in shown.splitlines() if line.startswith("tiers"))
    assert tiers in out.splitlines()
    assert _rows(out)["fs"][1] > 0.02, out
