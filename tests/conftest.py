"""Hooks and fixtures for every test folder: ``KVTIER_REQUIRE`` checked at start and applied to
marked tests; host pools and namespaces."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from support import require

from kvtier.keys import Namespace
from kvtier.pool import HostPool


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{require.MARK}(capability, reason): skip (or fail if required) when missing"
    )
    require.required()  # an unknown name stops the run here


def pytest_report_header() -> str:
    names = ", ".join(sorted(require.required())) or "none"
    return f"{require.ENV}: {names}"


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers(require.MARK):
        capability, reason = mark.args
        if reason is not None:
            require.missing(capability, reason)


@pytest.fixture
def make_pool() -> Iterator[Callable[..., HostPool]]:
    """Host pools of any size, closed after the test."""
    pools: list[HostPool] = []

    def make(slots: int, slot_bytes: int = 64) -> HostPool:
        pool = HostPool.create(slots, slot_bytes)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


@pytest.fixture
def ns() -> Namespace:
    """Blocks of 4 tokens: short prompts span several blocks."""
    return Namespace(model="test-model", dtype="float16", block_tokens=4)


@pytest.fixture
def namespace() -> Namespace:
    return Namespace(model="test-model", dtype="float16", block_tokens=16)


@pytest.fixture
def other_namespace() -> Namespace:
    """Another tenant of the same model: none of ``namespace``'s blocks may be seen from it."""
    return Namespace(model="test-model", dtype="float16", block_tokens=16, tenant="other")
