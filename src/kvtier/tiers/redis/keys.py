"""Key naming of the ``redis`` tier.

Each block is one string value under ``<key_prefix>:<namespace hex>:<key hex>``: kvtier's 64-byte
payload header (``payload.py``, written and checked by the tier skeleton) followed by the bytes of
one pool slot. Keys carry no hash tag: in a cluster they spread over all slots. Only keys under
this prefix are ever written or deleted.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.keys import BlockKey, Namespace
from kvtier.tiers.payload import HEADER_BYTES


@dataclass(frozen=True, slots=True)
class KeySpace:
    """The Redis keys and values of one tier's namespace."""

    prefix: bytes
    """``<key_prefix>:<namespace hex>:``"""
    value_bytes: int
    """Length of a block's value: header and payload."""

    @classmethod
    def of(cls, key_prefix: str, namespace: Namespace, slot_bytes: int) -> KeySpace:
        return cls(f"{key_prefix}:{namespace.hex}:".encode(), HEADER_BYTES + slot_bytes)

    def redis_key(self, key: BlockKey) -> bytes:
        """The Redis key of ``key`` in this namespace."""
        return self.prefix + key.hex().encode()

    @property
    def probe_key(self) -> bytes:
        """The key the start-up probe reads and deletes (never a block's: not hex)."""
        return self.prefix + b"probe"
