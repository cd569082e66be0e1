from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.keys import Namespace, chain_keys
from kvtier.pool import HostPool


@pytest.fixture
def ns() -> Namespace:
    return Namespace(model="test-model", dtype="float16", block_tokens=4)


@pytest.fixture
def make_pool() -> Iterator[object]:
    pools: list[HostPool] = []

    def make(slots: int, slot_bytes: int = 64) -> HostPool:
        pool = HostPool.create(slots, slot_bytes)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def keys_for(ns: Namespace, n_blocks: int, seed: int = 0) -> list[bytes]:
    base = seed * 100_000
    return chain_keys(ns, list(range(base, base + n_blocks * ns.block_tokens)))
