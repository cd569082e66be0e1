"""Numbers an engine passes in a ``RequestHint``: whatever they are (NaN, infinite, fractional,
negative, huge, of another type), the hint holds a count or "not known" and the policy never
raises."""

from __future__ import annotations

import math
from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.blocks import keys_for

from kvtier.cache.manager import TieredCache
from kvtier.keys import Namespace
from kvtier.policies import HintedPolicy
from kvtier.policies.hints import MAX_COUNT, RequestHint
from kvtier.pool import HostPool

ODD_VALUES: list[Any] = [
    math.nan,
    math.inf,
    -math.inf,
    2.5,
    -3,
    -0.5,
    10**400,
    "12",
    b"7",
    [3],
    Decimal("NaN"),
    Decimal("2.5"),
    Fraction(7, 2),
    complex(1, 1),
    True,
    object(),
]


def store(cache: TieredCache, keys: list[bytes]) -> None:
    reservation = cache.prepare_store(keys)
    cache.complete_store(reservation.keys)


@pytest.mark.parametrize("value", ODD_VALUES, ids=repr)
def test_hint_request_with_odd_numbers_never_raises(
    ns: Namespace, make_pool: Callable[..., HostPool], value: Any
) -> None:
    """Before: NaN, infinite or fractional ``output_tokens`` gave ``AttributeError: 'float'
    object has no attribute 'bit_length'``; NaN or fractional ``hit_blocks`` a ``TypeError``;
    a negative one a ``ValueError`` from the hint itself."""
    pool = make_pool(16, 64)
    cache = TieredCache(pool, HintedPolicy(16))
    keys = keys_for(ns, 4)
    store(cache, keys)
    cache.hint_request(keys, RequestHint(value, value))
    cache.hint_request(keys, RequestHint(1, value))
    cache.hint_request(keys, RequestHint(value, 9))
    store(cache, keys_for(ns, 16, seed=1))  # evictions rank the hinted blocks
    cache.check_invariants()


@pytest.mark.parametrize(
    ("given_value", "hit_blocks", "output_tokens"),
    [
        (3, 3, 3),
        (2.9, 2, 2),  # a fraction of a block or token was not cached or generated: round down
        (-2, 0, None),  # below zero is no count
        (math.nan, 0, None),
        (math.inf, 0, None),
        (10**30, MAX_COUNT, MAX_COUNT),
        (1e30, MAX_COUNT, MAX_COUNT),
        ("5", 0, None),  # a number is a number, not its text
        (True, 1, 1),
        (Fraction(9, 2), 4, 4),
    ],
)
def test_hint_values_become_counts_or_not_known(
    given_value: Any, hit_blocks: int, output_tokens: int | None
) -> None:
    hint = RequestHint(given_value, given_value)
    assert (hint.hit_blocks, hint.output_tokens) == (hit_blocks, output_tokens)
    assert type(hint.hit_blocks) is int
    assert RequestHint(0, None).output_tokens is None


@settings(max_examples=300, derandomize=True, deadline=None)
@given(
    hit=st.one_of(st.integers(), st.floats(), st.none(), st.text(max_size=3), st.booleans()),
    output=st.one_of(st.integers(), st.floats(), st.none(), st.fractions(), st.decimals()),
    n_keys=st.integers(0, 6),
)
def test_fuzz_hint_values_reach_the_policy_without_error(
    hit: Any, output: Any, n_keys: int
) -> None:
    policy = HintedPolicy(8)
    keys = [i.to_bytes(16, "little") for i in range(n_keys)]
    for key in keys[: n_keys // 2]:
        policy.insert(key)
    hint = RequestHint(hit, output)
    assert type(hint.hit_blocks) is int and 0 <= hint.hit_blocks <= MAX_COUNT
    assert hint.output_tokens is None or (
        type(hint.output_tokens) is int and 0 <= hint.output_tokens <= MAX_COUNT
    )
    policy.on_request(keys, hint)
    for key in keys[n_keys // 2 :]:
        policy.insert(key)
    assert len(policy.evict(n_keys, ())) == n_keys
