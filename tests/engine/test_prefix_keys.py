from __future__ import annotations

import random

import pytest

from kvtier.engine.prefix_keys import PrefixKeys
from kvtier.keys import Namespace, chain_keys, chain_root

NS = Namespace(model="m", dtype="bf16", block_tokens=4)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1 << 31) for _ in range(n)]


def test_a_prompt_that_extends_an_earlier_one_hashes_only_its_new_blocks():
    prefixes = PrefixKeys(NS)
    turn1 = tokens(40, 1)
    turn2 = turn1 + tokens(22, 2)  # 15 full blocks, 2 tokens of a 16th
    assert prefixes.keys(turn1, None) == chain_keys(NS, turn1)
    assert prefixes.reused_blocks == 0
    assert prefixes.keys(turn2, None) == chain_keys(NS, turn2)
    assert prefixes.reused_blocks == 10
    assert prefixes.keys(turn1[:24], None) == chain_keys(NS, turn1[:24])  # a shorter one
    assert prefixes.reused_blocks == 16


@pytest.mark.parametrize("at", [0, 1, 3, 4, 17, 39])
def test_a_prompt_that_differs_reuses_only_the_blocks_before_the_first_different_token(at):
    prefixes = PrefixKeys(NS)
    first = tokens(40, 1)
    prefixes.keys(first, None)
    second = list(first)
    second[at] += 1
    assert prefixes.keys(second, None) == chain_keys(NS, second)
    assert prefixes.reused_blocks == at // 4


def test_roots_do_not_share_keys():
    prefixes = PrefixKeys(NS)
    prompt = tokens(32, 1)
    salted = chain_root(NS, salt="tenant-a")
    prefixes.keys(prompt, None)
    assert prefixes.keys(prompt, salted) == chain_keys(NS, prompt, salted)
    assert prefixes.reused_blocks == 0
    assert prefixes.keys(prompt + tokens(8, 2), salted) == chain_keys(
        NS, prompt + tokens(8, 2), salted
    )
    assert prefixes.reused_blocks == 8


def test_keys_the_caller_appends_are_never_reused():
    # The planner extends a request's list as its tokens arrive; only the remembered prompt's
    # blocks are checked against the next prompt.
    prefixes = PrefixKeys(NS)
    prompt = tokens(16, 1)
    keys = prefixes.keys(prompt, None)
    keys.extend([b"\0" * 16] * 3)
    longer = prompt + tokens(12, 2)
    assert prefixes.keys(longer, None) == chain_keys(NS, longer)
    assert prefixes.reused_blocks == 4


def test_short_prompts_and_the_bound():
    prefixes = PrefixKeys(NS, max_tokens=40)
    assert prefixes.keys(tokens(3, 1), None) == []
    assert len(prefixes) == 0
    a, b = tokens(24, 1), tokens(24, 2)
    prefixes.keys(a, None)
    prefixes.keys(b, None)  # 48 tokens held: the oldest prompt goes
    assert len(prefixes) == 1
    assert prefixes.keys(a + tokens(4, 3), None) == chain_keys(NS, a + tokens(4, 3))
    assert prefixes.reused_blocks == 0
    assert prefixes.keys(b, None) == chain_keys(NS, b)  # dropped in turn: a is the newest
    assert prefixes.reused_blocks == 0


def test_a_next_turn_converts_its_prompt_once_and_hashes_only_its_new_blocks(monkeypatch):
    # The prompt is compared as bytes (``token_bytes`` packs a list faster than two lists
    # compare) and the new blocks hash from the same bytes.
    from kvtier.engine import prefix_keys

    converted: list[int] = []
    hashed: list[int] = []
    real, real_hash = prefix_keys.token_bytes, prefix_keys.chain_keys_of_bytes

    def counting(tokens):
        converted.append(len(tokens))
        return real(tokens)

    def hashing(namespace, data, start=None):
        keys = real_hash(namespace, data, start)
        hashed.append(len(keys))
        return keys

    monkeypatch.setattr(prefix_keys, "token_bytes", counting)
    monkeypatch.setattr(prefix_keys, "chain_keys_of_bytes", hashing)
    prefixes = PrefixKeys(NS)
    turn1 = tokens(400, 1)
    turn2 = turn1 + tokens(42, 2)
    prefixes.keys(turn1, None)
    converted.clear()
    hashed.clear()
    assert prefixes.keys(turn2, None) == chain_keys(NS, turn2)
    assert converted == [440]  # its full blocks, once
    assert hashed == [1, 10]  # the first block, then the 10 blocks after the 100 reused


def test_other_sequences_and_int_types_key_as_lists():
    import numpy as np

    prefixes = PrefixKeys(NS)
    prompt = tokens(40, 1)
    prefixes.keys(prompt, None)
    as_array = np.asarray(prompt + tokens(8, 2), dtype=np.int64)
    assert prefixes.keys(as_array, None) == chain_keys(NS, list(as_array))
    assert prefixes.reused_blocks == 10
    assert prefixes.keys(tuple(prompt), None) == chain_keys(NS, prompt)
    assert prefixes.reused_blocks == 20


def test_a_remembered_prompt_is_a_copy_the_caller_may_change():
    prefixes = PrefixKeys(NS)
    lent = tokens(40, 2)
    prefixes.keys(lent, None)
    lent[5] += 1  # the caller's list changes after the call: what was remembered does not
    longer = tokens(40, 2) + tokens(4, 3)
    assert prefixes.keys(longer, None) == chain_keys(NS, longer)
    assert prefixes.reused_blocks == 10
