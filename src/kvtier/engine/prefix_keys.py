"""Key chains of recent prompts: a request whose prompt extends an earlier request's (the next
turn of a conversation, a shared system prompt) hashes only the blocks after their common prefix.

A key depends only on the chain root and the tokens up to its block's end (``kvtier.keys``), so
where two prompts with the same first key (the same root and first block) have equal tokens, their
keys are equal: the earlier request's keys are reused up to the first token that differs, which is
found by comparing the tokens, never guessed. The keys are exactly ``chain_keys``'s.

Hashing was most of a new request's lookup (0.48 ms for an 8k-token prompt on a 2-core AMD EPYC
VM, Python 3.11, and again at each turn of a conversation for all its earlier turns' blocks); the
comparison is one pass in C. A prompt is remembered as its ``token_bytes`` and compared as bytes:
``token_bytes`` packs a list of ints at 6.6 ns a token (``struct``), where comparing two token
lists took 14 ns a token (fresh int objects: 72 us for 5,000 tokens), and the new blocks hash
from the same bytes (when the conversion went through numpy, 30-45 ns a token, the prompts were
compared as lists and only the new tokens converted). One entry per first key (the latest
request's), oldest dropped beyond ``PREFIX_TOKENS`` tokens held.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvtier.keys import TOKEN_BYTES, BlockKey, Namespace, chain_keys_of_bytes, token_bytes

PREFIX_TOKENS = 1 << 20
"""Tokens of remembered prompts: 170 prompts of 6k tokens, more than an engine has conversations
in flight; 8 bytes a token (8 MiB), plus the keys."""


class PrefixKeys:
    """Keys of a request's full blocks, reusing a remembered prompt's; see the module docstring."""

    def __init__(self, namespace: Namespace, max_tokens: int = PREFIX_TOKENS) -> None:
        self.namespace = namespace
        self.max_tokens = max_tokens
        self._prompts: OrderedDict[BlockKey, tuple[bytes, list[BlockKey]]] = OrderedDict()
        """First key -> the latest such prompt's tokens (its full blocks, ``token_bytes``) and
        keys."""
        self._held = 0
        """Tokens in ``_prompts``."""
        self.reused_blocks = 0
        """Keys taken from a remembered prompt instead of hashed (for tests and reports)."""

    def keys(self, tokens: Sequence[int], root: BlockKey | None) -> list[BlockKey]:
        """``chain_keys(namespace, tokens, root)``; the prompt is remembered (a copy: the caller
        may change ``tokens`` afterwards). The returned list is the caller's to extend (only the
        remembered tokens' keys are ever reused)."""
        bt = self.namespace.block_tokens
        n = len(tokens) // bt * bt  # a trailing partial block has no key
        if not n:
            return []
        data = token_bytes(tokens if len(tokens) == n else tokens[:n])
        block = bt * TOKEN_BYTES
        first = chain_keys_of_bytes(self.namespace, data[:block], root)[0]
        entry = self._prompts.pop(first, None)
        reuse = 0
        if entry is not None:
            old_data, old_keys = entry
            self._held -= len(old_data) // TOKEN_BYTES
            reuse = min(_same_bytes(old_data, data) // block, len(old_keys))
        if reuse:
            keys = old_keys[:reuse]  # a copy: the earlier request's list is its own
            self.reused_blocks += reuse
        else:
            keys, reuse = [first], 1
        if reuse * block < len(data):
            keys += chain_keys_of_bytes(self.namespace, data[reuse * block :], keys[-1])
        self._remember(first, data, keys)
        return keys

    def _remember(self, first: BlockKey, data: bytes, keys: list[BlockKey]) -> None:
        prompts = self._prompts
        prompts[first] = (data, keys)
        self._held += len(data) // TOKEN_BYTES
        while self._held > self.max_tokens and prompts:
            old_data, _ = prompts.popitem(last=False)[1]
            self._held -= len(old_data) // TOKEN_BYTES

    def __len__(self) -> int:
        return len(self._prompts)


def _same_bytes(a: bytes, b: bytes) -> int:
    """Length in bytes of the common prefix of two ``token_bytes`` strings, in whole tokens."""
    n = min(len(a), len(b))
    # The common case, a conversation's next turn: one memcmp.
    if b.startswith(a) if len(a) == n else a.startswith(b):
        return n
    x = np.frombuffer(a, dtype="<i8", count=n // TOKEN_BYTES)
    y = np.frombuffer(b, dtype="<i8", count=n // TOKEN_BYTES)
    return int(np.flatnonzero(x != y)[0]) * TOKEN_BYTES
