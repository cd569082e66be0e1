"""vLLM's KV cache groups as kvtier's ``CacheGroup`` records (hybrid models).

vLLM's hybrid KV cache manager gives each kind of layer (full attention, sliding window, Mamba)
one or more groups of equal size, each with its own block table; the groups' pages are the same
size, and the groups share one pool of block ids (a block id belongs to one group at a time).
Block id 0 is vLLM's null block: a sliding-window group's table holds it where a position left
the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.engine.groups import CacheGroup, GroupKind

NULL_BLOCK = 0
"""The id of vLLM's null block (``BlockPool.null_block``: the first block, never handed out)."""

_FULL_SPECS = frozenset({"FullAttentionSpec", "MLAAttentionSpec"})
_WINDOW_SPECS = frozenset({"SlidingWindowSpec"})


def _kind(group: Any) -> GroupKind:
    spec = group.kv_cache_spec
    name = type(spec).__name__
    if getattr(group, "enable_kv_transfer", True) is False:
        return GroupKind.OTHER  # an engine-side replica rebuilt from another group
    if name in _WINDOW_SPECS:
        return GroupKind.WINDOW
    if "Mamba" in name:
        return GroupKind.STATE
    if name in _FULL_SPECS and not getattr(spec, "sliding_window", None):
        return GroupKind.FULL
    return GroupKind.OTHER


def describe(kv_cache_config: Any) -> list[CacheGroup]:
    """The model's KV cache groups in vLLM's order (their index is the block table's)."""
    out: list[CacheGroup] = []
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or ()):
        spec = group.kv_cache_spec
        kind = _kind(group)
        out.append(
            CacheGroup(
                index=index,
                kind=kind,
                layers=tuple(group.layer_names),
                page_bytes=int(spec.page_size_bytes),
                block_tokens=int(getattr(spec, "block_size", 0) or 0),
                window=int(spec.sliding_window) if kind is GroupKind.WINDOW else 0,
            )
        )
    return out


def uniform(groups: Sequence[CacheGroup]) -> str | None:
    """Why the groups' blocks cannot share kvtier's slots and block boundaries (None: they can):
    kvtier needs one block size and one page size across the groups it stores."""
    sizes = {g.block_tokens for g in groups}
    pages = {g.page_bytes for g in groups}
    if len(sizes) > 1:
        return f"groups of different block sizes {sorted(sizes)}"
    if len(pages) > 1:
        return f"groups of different page sizes {sorted(pages)}"
    return None


def tag(groups: Sequence[CacheGroup]) -> str:
    """The groups, for the namespace (empty for one group: a single-group model keeps the
    namespace it always had)."""
    if len(groups) <= 1:
        return ""
    return "groups=" + ",".join(g.tag for g in groups)
