from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kvtier.errors import ConfigError
from kvtier.keys import (
    KEY_BYTES,
    Namespace,
    chain_keys,
    chain_root,
    keys_from_hashes,
    token_bytes,
)

BASE = Namespace(model="llama", dtype="bfloat16", block_tokens=4, layout="nhd", tp_size=2)
TOKENS = list(range(17))


def test_chain_keys_cover_full_blocks_and_depend_on_prefix():
    keys = chain_keys(BASE, TOKENS)
    assert len(keys) == 4 and all(len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 4
    other = chain_keys(BASE, [99, *TOKENS[1:]])
    assert all(a != b for a, b in zip(keys, other, strict=True))  # first token changes all
    assert chain_keys(BASE, TOKENS[:8]) == keys[:2]
    assert chain_keys(BASE, TOKENS[8:16], start_key=keys[1]) == keys[2:]


@pytest.mark.parametrize(
    "change",
    [
        {"model": "other"},
        {"dtype": "float16"},
        {"block_tokens": 8},
        {"layout": "hnd"},
        {"tp_size": 4},
        {"tp_rank": 1},
        {"extra": "fp8-kv"},
        {"tenant": "acme"},
    ],
)
def test_every_namespace_field_separates_keys(change):
    other = dataclasses.replace(BASE, **change)
    tokens = list(range(16))
    assert set(chain_keys(BASE, tokens)).isdisjoint(chain_keys(other, tokens))
    assert set(keys_from_hashes(BASE, [1, 2, b"x" * 32])).isdisjoint(
        keys_from_hashes(other, [1, 2, b"x" * 32])
    )
    assert (other.tenant != BASE.tenant) or other.fingerprint != BASE.fingerprint


def test_keys_are_stable_across_processes_and_hash_seeds():
    code = (
        "from kvtier.keys import Namespace, chain_keys, keys_from_hashes; "
        "ns = Namespace(model='llama', dtype='bfloat16', block_tokens=4, layout='nhd', tp_size=2); "
        "print(*(k.hex() for k in chain_keys(ns, list(range(17)))), "
        "*(k.hex() for k in keys_from_hashes(ns, [7, b'h'])))"
    )
    expected = [k.hex() for k in chain_keys(BASE, TOKENS)] + [
        k.hex() for k in keys_from_hashes(BASE, [7, b"h"])
    ]
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
        )
        assert out.stdout.split() == expected


def test_key_format_is_frozen():
    # Blocks persist on disk and in Redis across versions: a change here must bump FORMAT_VERSION.
    ns = Namespace(model="m", dtype="d", block_tokens=2)
    assert [k.hex() for k in chain_keys(ns, [1, 2, -3, 2**40, 7])] == [
        "f3566d16f0313044f913de7765998d37",
        "ae0e5e8495e19466af820010869da642",
    ]
    assert chain_keys(ns, [1, 2])[0].hex() == chain_keys(ns, [1, 2, 3])[0].hex()
    assert ns.hex == Namespace(model="m", dtype="d", block_tokens=2).hex
    assert len(ns.hex) == 32 and all(c in "0123456789abcdef" for c in ns.hex)
    assert ns.hex == "f1af810819dcb070aa9904b75f83fb94"
    assert ns.fingerprint.startswith("14fe8de3c17873a985a5aebc5886cfb4")


def test_hash_keys_are_frozen():
    # vLLM-style content hashes (ints, signed, up to 128 bits, or bytes) mixed with the namespace.
    ns = Namespace(model="m", dtype="d", block_tokens=2)
    assert [k.hex() for k in keys_from_hashes(ns, [7, -1, 2**127 - 1, b"h" * 32])] == [
        "2be10ca08fb36ba42abe740363f22c91",
        "cee3779093b268230ca0d8060a300855",
        "bbb9553546efbf3e4f4bdee1453c32da",
        "fa8fa4292fb1cd743279fc55e6a4f75a",
    ]


@pytest.mark.parametrize(
    ("adapter", "salt", "root"),
    [
        ("sql", None, "f52a56f5c299c2c1ce377a1a99d58e9a"),
        (None, "s3cret", "04fb932a43c8257f6cc01b622cf86b06"),
        ("sql", "s3cret", "3b0c8f929d4bca72509150ba019dc287"),
        ("", None, "84d4805edc0c37b31cf73aa58f3792e0"),  # an unnamed adapter is still one
    ],
)
def test_request_roots_are_frozen(adapter: str | None, salt: str | None, root: str) -> None:
    # The values the vLLM connector derived before chain_root existed (LoRA name, cache salt):
    # blocks stored under them stay reachable.
    ns = Namespace(model="m", dtype="d", block_tokens=2)
    start = chain_root(ns, adapter, salt)
    assert start is not None and start.hex() == root
    plain = chain_keys(ns, [1, 2, -3, 2**40, 7])
    assert set(chain_keys(ns, [1, 2, -3, 2**40, 7], start)).isdisjoint(plain)


def test_request_root_chains_are_frozen() -> None:
    ns = Namespace(model="m", dtype="d", block_tokens=2)
    tokens = [1, 2, -3, 2**40, 7]
    assert [k.hex() for k in chain_keys(ns, tokens, chain_root(ns, "sql"))] == [
        "104a8fa8357bd675fae97086363bacfa",
        "96200fb87cfa552d4fd6d4bc0ddf45af",
    ]
    assert [k.hex() for k in chain_keys(ns, tokens, chain_root(ns, salt="s3cret"))] == [
        "b6d5e2e2474dd4f26af359cfd9c1997c",
        "000c8f30499b8239ffe2d3e6aba3f99f",
    ]
    # Neither an adapter nor a salt: the namespace is the root, keys as without a request root.
    assert chain_root(ns) is None and chain_root(ns, None, "") is None
    tenant = Namespace(model="m", dtype="d", block_tokens=2, tenant="acme")
    assert chain_root(tenant, "sql") != chain_root(ns, "sql")


def test_bad_namespace_values_name_the_field():
    with pytest.raises(ConfigError, match=r"namespace\.block_tokens"):
        Namespace(model="m", dtype="d", block_tokens=0)
    with pytest.raises(ConfigError, match=r"namespace\.tp_rank"):
        Namespace(model="m", dtype="d", block_tokens=1, tp_size=2, tp_rank=2)
    with pytest.raises(ConfigError, match=r"namespace\.model"):
        Namespace(model="", dtype="d", block_tokens=1)


def test_group_keys_are_frozen_and_never_alias() -> None:
    from kvtier.keys import group_keys

    ns = Namespace(model="m", dtype="float16", block_tokens=2)
    chain = chain_keys(ns, [1, 2, -3, 2**40, 7])
    window = group_keys(chain, "window:0:w=64")
    full = group_keys(chain, "full:1")
    assert [k.hex() for k in window] == [k.hex() for k in group_keys(chain, "window:0:w=64")]
    assert len({*chain, *window, *full}) == 3 * len(chain)
    assert group_keys(chain[:1], "full:1") == full[:1]
    assert [k.hex() for k in full] == FROZEN_GROUP_KEYS


FROZEN_GROUP_KEYS = ["6555257b2b2e5f4d0674a4dda07436b6", "23a2963e45039d3fc2b81bda7f682bba"]
"""Blocks of hybrid models stored by this release must be found by the next one."""


def test_a_generation_roots_a_new_chain_that_no_salt_can_spell():
    """After a cache reset (``generation``) no earlier key is reached again; a user's cache salt,
    free text, cannot name another generation's root."""
    assert chain_root(BASE) is None
    roots = {
        chain_root(BASE, generation=1),
        chain_root(BASE, generation=2),
        chain_root(BASE, salt="s", generation=1),
        chain_root(BASE, salt="s"),
        chain_root(BASE, salt="\0gen=1"),
        chain_root(BASE, adapter="gen=1\0lora="),
        chain_root(BASE, salt="x", generation=1),
        chain_root(BASE, salt="x\0gen=1"),
    }
    assert None not in roots and len(roots) == 8


def test_token_bytes_of_a_list_are_numpys_int64_bytes_whatever_the_items() -> None:
    def numpy_bytes(tokens: Any) -> bytes:
        return np.asarray(tokens, dtype="<i8").tobytes()

    cases: list[Any] = [[], [0], [-5, 2**63 - 1, -(2**63)], [np.int64(7), 3, True], [1.5, 2]]
    cases.append(list(range(5000)))
    for tokens in cases:  # a list goes through struct, a float list through numpy
        assert token_bytes(tokens) == numpy_bytes(tokens)
    assert token_bytes((1, 2)) == numpy_bytes([1, 2])
    with pytest.raises(OverflowError):
        token_bytes([2**63])
