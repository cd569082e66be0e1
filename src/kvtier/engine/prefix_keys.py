"""Key chains of recent prompts: a request whose prompt extends an earlier request's (the next
turn of a conversation, a shared system prompt) hashes only the blocks after their common prefix.

A key depends only on the chain root and the tokens up to its block's end (``kvtier.keys``), so
where two prompts with the same first key (the same root and first block) have equal tokens, their
keys are equal: the earlier request's keys are reused up to the first token that differs, which is
found by comparing the tokens, never guessed. The keys are exactly ``chain_keys``'s.

Hashing was most of a new request's lookup (0.48 ms for an 8k-token prompt on a 2-core AMD EPYC
VM, Python 3.11, and again at each turn of a conversation for all its earlier turns' blocks); the
comparison is one pass in C. The remembered prompts are token lists, compared as lists: turning a
whole prompt into bytes to compare it (``token_bytes``, 30-45 ns a token) cost more than hashing
its new blocks, and only the tokens after the common prefix are converted now. One entry per
first key (the latest request's), oldest dropped beyond ``PREFIX_TOKENS`` tokens held.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from kvtier.keys import BlockKey, Namespace, chain_keys_of_bytes, token_bytes

PREFIX_TOKENS = 1 << 20
"""Tokens of remembered prompts: 170 prompts of 6k tokens, more than an engine has conversations
in flight. A list holds 8 bytes a token and its int objects (32 bytes each, shared with the
engine's request while it lives): at most 40 MiB, plus the keys."""


class PrefixKeys:
    """Keys of a request's full blocks, reusing a remembered prompt's; see the module docstring."""

    def __init__(self, namespace: Namespace, max_tokens: int = PREFIX_TOKENS) -> None:
        self.namespace = namespace
        self.max_tokens = max_tokens
        self._prompts: OrderedDict[BlockKey, tuple[list[int], list[BlockKey]]] = OrderedDict()
        """First key -> the latest such prompt's tokens (its full blocks) and keys."""
        self._held = 0
        """Tokens in ``_prompts``."""
        self.reused_blocks = 0
        """Keys taken from a remembered prompt instead of hashed (for tests and reports)."""

    def keys(
        self, tokens: Sequence[int], root: BlockKey | None, owned: bool = False
    ) -> list[BlockKey]:
        """``chain_keys(namespace, tokens, root)``; the prompt is remembered. The returned list
        is the caller's to extend (only the remembered tokens' keys are ever reused). ``owned``:
        ``tokens`` is a list the caller hands over and never changes, remembered without a copy."""
        bt = self.namespace.block_tokens
        n = len(tokens) // bt * bt  # a trailing partial block has no key
        if not n:
            return []
        # A list of its own (a slice copies; another sequence, e.g. an array, becomes one).
        if owned and type(tokens) is list and len(tokens) == n:
            prompt = tokens
        else:
            prompt = tokens[:n] if isinstance(tokens, list) else list(tokens[:n])
        first = chain_keys_of_bytes(self.namespace, token_bytes(prompt[:bt]), root)[0]
        entry = self._prompts.pop(first, None)
        reuse = 0
        if entry is not None:
            old_prompt, old_keys = entry
            self._held -= len(old_prompt)
            reuse = min(_same_tokens(old_prompt, prompt) // bt, len(old_keys))
        if reuse:
            keys = old_keys[:reuse]  # a copy: the earlier request's list is its own
            self.reused_blocks += reuse
        else:
            keys, reuse = [first], 1
        if reuse * bt < n:
            data = token_bytes(prompt[reuse * bt :])
            keys += chain_keys_of_bytes(self.namespace, data, keys[-1])
        self._remember(first, prompt, keys)
        return keys

    def _remember(self, first: BlockKey, prompt: list[int], keys: list[BlockKey]) -> None:
        prompts = self._prompts
        prompts[first] = (prompt, keys)
        self._held += len(prompt)
        while self._held > self.max_tokens and prompts:
            old_prompt, _ = prompts.popitem(last=False)[1]
            self._held -= len(old_prompt)

    def __len__(self) -> int:
        return len(self._prompts)


def _same_tokens(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of the token lists ``a`` and ``b`` (tokens equal as their
    ``token_bytes`` are: the same int64 values)."""
    n = min(len(a), len(b))
    # The common case, a conversation's next turn: one pass in C (slicing the longer list only).
    if (a == b[:n]) if len(a) == n else (a[:n] == b):
        return n
    x = np.asarray(a[:n], dtype="<i8")
    y = np.asarray(b[:n], dtype="<i8")
    return int(np.flatnonzero(x != y)[0])
