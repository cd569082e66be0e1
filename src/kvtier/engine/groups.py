"""KV cache groups of hybrid models: what each kind of group needs to resume at a block boundary.

An engine with a hybrid KV cache manager (vLLM's) keeps one block table per group of layers that
share an attention kind. kvtier stores each group's blocks under keys of their own
(``keys.group_keys`` with the group's ``tag``), in slots of the same size, and a request resumes
at the longest boundary where every group has what it needs there:

* ``FULL`` (full attention): every block before the boundary;
* ``WINDOW`` (sliding-window attention of ``window`` tokens): the blocks inside the window of the
  next token, the last ``window_blocks`` blocks before the boundary. Only those are stored, at
  the boundaries a later request can resume from (``window_tail``), not the whole history.
* ``STATE`` (Mamba, linear attention, in an engine that keeps a state per block boundary: vLLM's
  ``mamba_cache_mode`` ``all``): the state page of the block that ends at the boundary, a window
  of one block. Stored at the same boundaries as a window group's.

A group kvtier cannot serve exactly (``OTHER``: any other attention kind, or a state group the
engine keeps otherwise) makes the model unserved (``servable``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum


class GroupKind(Enum):
    FULL = "full"
    WINDOW = "window"
    STATE = "state"
    """Recurrent state (Mamba, linear attention) kept per block boundary: block ``b`` holds the
    state after the tokens of blocks ``0..b``."""
    OTHER = "other"
    """An attention kind kvtier does not know (chunked local, cross, ...): not stored."""


@dataclass(frozen=True, slots=True)
class CacheGroup:
    """One KV cache group, as the engine adapter describes it."""

    index: int
    """The engine's group number (the position of its block table)."""
    kind: GroupKind
    layers: tuple[str, ...]
    page_bytes: int
    """Bytes of one layer's page of one engine block."""
    block_tokens: int
    """Tokens per engine block of this group."""
    window: int = 0
    """Sliding window in tokens (``WINDOW``); 0 otherwise."""

    @property
    def tag(self) -> str:
        """Kind and geometry, for the group's keys: two groups never share a tag."""
        names = hashlib.blake2b("\0".join(self.layers).encode(), digest_size=8).hexdigest()
        return (
            f"{self.kind.value}:{self.index}:layers={len(self.layers)}:{names}:"
            f"page={self.page_bytes}:block={self.block_tokens}:window={self.window}"
        )


def servable(groups: Iterable[CacheGroup]) -> str | None:
    """Why kvtier cannot serve a model with these groups exactly (None: it can)."""
    groups = list(groups)
    if not any(g.kind is GroupKind.FULL for g in groups):
        return "no full-attention group"
    for g in groups:
        if g.kind is GroupKind.OTHER:
            return f"group {g.index} is {g.kind.value} (layers {', '.join(g.layers[:2])}...)"
    return None


def tail_blocks(group: CacheGroup, block_tokens: int) -> int:
    """kvtier blocks of ``group`` a resume at a boundary needs before it, for a group that needs
    only the last ones: a window's (``window_blocks``), or one for a state group."""
    if group.kind is GroupKind.STATE:
        return 1
    return window_blocks(group.window, block_tokens)


def held_tokens(group: CacheGroup) -> int:
    """Tokens before the next one whose blocks the engine still holds for a running request of
    a window or state group: a window's ``window - 1``; a state group's last computed token."""
    if group.kind is GroupKind.STATE:
        return 1
    return group.window - 1


def window_blocks(window: int, block_tokens: int) -> int:
    """kvtier blocks a sliding window of ``window`` tokens needs before a boundary: the next
    token attends to the ``window - 1`` tokens before it."""
    return max(1, -(-(window - 1) // block_tokens))


def auto_boundary_blocks(need: int) -> int:
    """The spacing of the boundaries stored for a window group when the config leaves it to
    kvtier: four windows, at least 16 blocks (a longer spacing stores less of the window group
    and loses up to that many blocks of a prefix that is shared only in part)."""
    return max(16, 4 * need)


def window_tail(
    offered: int, full: int, need: int, every: int, whole_prompt: bool = True
) -> list[int]:
    """The window (or state) blocks to store when a request's stored prefix grows from
    ``offered`` to ``full`` blocks: the ``need`` blocks before each boundary a later request can
    resume from. Those are the new end, the block before it where the request's tokens end at
    ``full`` (``whole_prompt``: a prompt of whole blocks is looked up one block short of its
    end), and every ``every``-th block in between. Sorted, no repeats."""
    ends = {full} | set(range((offered // every + 1) * every, full, every))
    if whole_prompt:
        ends.add(full - 1)
    out: set[int] = set()
    for end in ends:
        if end > offered or end == full:
            out.update(range(max(0, end - need), max(0, end)))
    return sorted(b for b in out if b < full)
