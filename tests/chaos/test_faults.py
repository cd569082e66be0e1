"""The chaos soak's fault injector (``faults.py``) against the races it meets: the tier keeps
writing while faults are injected."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from chaos.faults import FileFault, inject_file_fault


def test_a_shard_the_tier_makes_again_mid_fault_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tier may create a shard directory again between the injector's rename and its
    symlink (a write landing there): the fault is then not injected, and nothing raises."""
    root = tmp_path / "fs"
    for shard, name in (("aa", "1.kvb"), ("bb", "2.kvb")):
        (root / shard).mkdir(parents=True)
        (root / shard / name).write_bytes(b"x" * 64)
    rename = Path.rename

    def rename_then_tier_writes(self: Path, target: Any) -> Any:
        moved = rename(self, target)
        self.mkdir()  # the tier's next write to this shard
        return moved

    monkeypatch.setattr(Path, "rename", rename_then_tier_writes)
    wanted = [root / "aa" / "1.kvb"]
    assert not inject_file_fault(
        root, FileFault.SHARD_SYMLINK, random.Random(0), tmp_path / "outside", wanted
    )
    assert (root / "aa").is_dir() and not (root / "aa").is_symlink()
