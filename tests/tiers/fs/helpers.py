"""Helpers shared by the fs tier's test files (the ``make_fs`` fixture is in conftest)."""

from __future__ import annotations

from pathlib import Path

from kvtier.tiers.fs.tier import FsTier
from tiers.conftest import FILE_BYTES, MakeTier

__all__ = ["FILE_BYTES", "MakeTier", "block_file", "block_files", "disk_bytes"]


def block_file(tier: FsTier, key: bytes) -> Path:
    return Path(tier.root) / key.hex()[:2] / f"{key.hex()}.kvb"


def block_files(tier: FsTier) -> list[Path]:
    """Regular block files under the namespace directory (links and FIFOs not followed)."""
    return sorted(p for p in Path(tier.root).glob("*/*.kvb") if p.is_file() and not p.is_symlink())


def disk_bytes(tier: FsTier) -> int:
    return sum(p.stat().st_size for p in block_files(tier))
