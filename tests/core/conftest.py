from __future__ import annotations

import pytest

from kvtier.keys import Namespace, chain_keys


@pytest.fixture
def ns() -> Namespace:
    return Namespace(model="test-model", dtype="float16", block_tokens=4)


def keys_for(ns: Namespace, n_blocks: int, seed: int = 0) -> list[bytes]:
    base = seed * 100_000
    return chain_keys(ns, list(range(base, base + n_blocks * ns.block_tokens)))
