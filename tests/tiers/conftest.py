from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.drivers import run_job as _run_job

from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import JobResult, Tier, TierJob
from kvtier.tiers.fs.tier import FsTier, Options
from kvtier.tiers.payload import HEADER_BYTES

SLOT_BYTES = 4000
"""Not a multiple of the pool's 256-byte slot alignment, on purpose."""
NUM_SLOTS = 64
FILE_BYTES = HEADER_BYTES + SLOT_BYTES
"""One fs block file."""
MakeTier = Callable[..., FsTier]


@pytest.fixture
def pool(make_pool: Callable[..., HostPool]) -> HostPool:
    return make_pool(NUM_SLOTS, SLOT_BYTES)


@pytest.fixture
def run_job() -> Callable[[Tier, TierJob], JobResult]:
    return _run_job


@pytest.fixture
def fs_store_dir(tmp_path: Path) -> Path:
    return tmp_path / "kv"


@pytest.fixture
def built_tiers() -> Iterator[list[Tier]]:
    """The tiers a test made through a factory fixture: closed after the test."""
    tiers: list[Tier] = []
    yield tiers
    for tier in tiers:
        tier.close()


@pytest.fixture
def make_fs(
    fs_store_dir: Path, pool: HostPool, namespace: Namespace, built_tiers: list[Tier]
) -> MakeTier:
    def make(blocks: float = 100, path: Path | None = None, **options: object) -> FsTier:
        opts = Options(
            path=str(path or fs_store_dir),
            capacity=int(blocks * FILE_BYTES),
            **options,  # type: ignore[arg-type]
        )
        tier = FsTier("disk", namespace, pool, opts)
        built_tiers.append(tier)
        return tier

    return make
