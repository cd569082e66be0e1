from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import JobResult, Tier, TierJob

from .helpers import run_job as _run_job

SLOT_BYTES = 4000
"""Not a multiple of the pool's 256-byte slot alignment, on purpose."""
NUM_SLOTS = 64


@pytest.fixture
def pool() -> Iterator[HostPool]:
    pool = HostPool.create(NUM_SLOTS, SLOT_BYTES)
    yield pool
    pool.close()


@pytest.fixture
def namespace() -> Namespace:
    return Namespace(model="test-model", dtype="float16", block_tokens=16)


@pytest.fixture
def other_namespace() -> Namespace:
    return Namespace(model="test-model", dtype="float16", block_tokens=16, tenant="other")


@pytest.fixture
def run_job() -> Callable[[Tier, TierJob], JobResult]:
    return _run_job
