"""Block keys and block bytes for tests: bytes that depend only on the key, so any read can be
checked, and a poison value for slots a read must overwrite."""

from __future__ import annotations

import hashlib

from kvtier.keys import BlockKey, Namespace, chain_keys
from kvtier.pool import HostPool

POISON = 0xA5


def keys_for(ns: Namespace, n_blocks: int, seed: int = 0) -> list[BlockKey]:
    """The chained keys of one prompt of ``n_blocks`` blocks; another ``seed``, another prompt."""
    base = seed * 100_000
    return chain_keys(ns, list(range(base, base + n_blocks * ns.block_tokens)))


def make_key(i: int, salt: str = "") -> BlockKey:
    return hashlib.blake2b(f"{salt}:{i}".encode(), digest_size=16).digest()


def make_keys(n: int, salt: str = "") -> list[BlockKey]:
    return [make_key(i, salt) for i in range(n)]


def payload_for(key: BlockKey, size: int) -> bytes:
    """Pseudo-random bytes that depend only on the key, so any read can be checked.

    Unlike ``kvtier.sim.replay.payload_for`` (the key repeated, cheap enough for a replay of
    millions of blocks), two keys sharing a prefix get unrelated bytes here, so a block read
    under the wrong key shows."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.blake2b(key + counter.to_bytes(8, "little"), digest_size=64).digest()
        counter += 1
    return bytes(out[:size])


def fill(pool: HostPool, slot: int, key: BlockKey) -> bytes:
    data = payload_for(key, pool.slot_bytes)
    pool.view(slot)[:] = data
    return data


def poison(pool: HostPool, slot: int) -> None:
    pool.view(slot)[:] = bytes([POISON]) * pool.slot_bytes
