"""vLLM's KV cache groups as kvtier's ``CacheGroup`` records (hybrid models).

vLLM's hybrid KV cache manager gives each kind of layer (full attention, sliding window, Mamba)
one or more groups of equal size, each with its own block table; the groups' pages are the same
size, and the groups share one pool of block ids (a block id belongs to one group at a time).
Block id 0 is vLLM's null block: a sliding-window group's table holds it where a position left
the window, a Mamba group's everywhere but where it keeps a state.

Mamba groups (``MambaSpec``: Mamba-1/2, linear attention, short convolutions, gated delta nets)
are served in ``mamba_cache_mode`` ``all`` only, the mode vLLM picks with prefix caching for
models that support it (0.25.1 and 0.32 alike): block ``b`` of the group's table holds the state
after the tokens of blocks ``0..b`` (written by the step that computes the block's last token;
the block of the last computed token holds the running state), a running request keeps only
the block of its last computed token (``get_num_skipped_tokens`` is ``num_computed - 1``: the
blocks before it are freed, listed in no scheduler output), and a request resumed at a boundary
of ``n`` blocks gets the null block at positions ``0..n-2`` and a fresh block at ``n - 1``
(``allocate_external_computed_blocks``), which the kernels read as the initial state. In
``align`` mode the states move between blocks, in ``none`` mode one block holds the running
state; with speculative blocks the positions shift: such groups are ``OTHER`` (not served).

A Mamba layer's KV cache, as vLLM 0.25.1 hands it to connectors, is a list of state views (conv
and SSM state), each ``[num_blocks, ...]`` with a block stride of one page, into one buffer;
``state_pages`` gives the copy backends that buffer as whole pages (``[num_blocks, 1, 1,
page_bytes]`` bytes, padding included). vLLM 0.32 hands over such a byte view already
(``[num_blocks, 1, 1, state bytes]``, block stride one page).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.engine.groups import CacheGroup, GroupKind

log = logging.getLogger(__name__)

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
        mode = getattr(spec, "mamba_cache_mode", None)
        speculative = int(getattr(spec, "num_speculative_blocks", 0) or 0)
        if mode == "all" and not speculative:
            return GroupKind.STATE
        log.warning(
            "a Mamba group in mamba_cache_mode %r with %d speculative blocks: kvtier serves "
            "'all' without speculative blocks only",
            mode,
            speculative,
        )
        return GroupKind.OTHER
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


def state_pages(states: Sequence[Any], page_bytes: int) -> Any:
    """A Mamba layer's state views (``[num_blocks, ...]`` each, block stride one page, into one
    buffer) as that buffer's whole pages: a ``[num_blocks, 1, 1, page_bytes]`` byte tensor over
    the same memory (the layout kvtier's CPU and CUDA backends copy page by page). ``ValueError``
    where the views are not pages of one buffer."""
    import torch

    first = states[0]
    num_blocks = int(first.shape[0])
    storage = first.untyped_storage()
    base = min(int(t.storage_offset()) * t.element_size() for t in states)
    for t in states:
        offset = int(t.storage_offset()) * t.element_size() - base
        span = offset + _extent_bytes(t)
        if (
            t.untyped_storage().data_ptr() != storage.data_ptr()
            or int(t.shape[0]) != num_blocks
            or int(t.stride(0)) * t.element_size() != page_bytes
            or span > page_bytes
        ):
            raise ValueError(
                f"Mamba state views {[tuple(x.shape) for x in states]} are not pages of "
                f"{page_bytes} bytes in one buffer"
            )
    if base + num_blocks * page_bytes > storage.nbytes():
        raise ValueError(f"{num_blocks} pages of {page_bytes} bytes overrun the state buffer")
    out = torch.empty(0, dtype=torch.uint8, device=first.device)
    return out.set_(storage, base, (num_blocks, 1, 1, page_bytes), (page_bytes,) * 3 + (1,))


def _extent_bytes(t: Any) -> int:
    """Bytes from a view's first element of one block to just past its last."""
    last = sum(
        (size - 1) * stride for size, stride in zip(t.shape[1:], t.stride()[1:], strict=True)
    )
    return int((last + 1) * t.element_size())


def group_tensors(
    groups: Sequence[CacheGroup], kv_caches: Mapping[str, Any]
) -> dict[int, list[Any]]:
    """Each group's layers' KV tensors, in layer order, for the copy backends: attention layers
    as vLLM hands them over, Mamba layers as their whole pages (``state_pages`` of 0.25.1's
    state views; ``whole_pages`` of 0.32's page views). A group kvtier never copies (not
    ``STATE``) whose states are not pages is left out rather than failing the engine's start."""
    out: dict[int, list[Any]] = {}
    for g in groups:
        tensors = [kv_caches[name] for name in g.layers]
        try:
            if isinstance(tensors[0], list | tuple):
                tensors = [state_pages(list(t), g.page_bytes) for t in tensors]
            elif g.kind is GroupKind.STATE:
                tensors = [whole_pages(t, g.page_bytes) for t in tensors]
        except ValueError:
            if g.kind is GroupKind.STATE:
                raise
            log.warning("KV cache group %d (%s) gets no copy backend", g.index, g.kind.value)
            continue
        out[g.index] = tensors
    return out


def whole_pages(view: Any, page_bytes: int) -> Any:
    """vLLM 0.32's ``[B, 1, 1, state bytes]`` view of a Mamba layer's pages, widened to the
    padded page (the bytes up to the next block's page are this layer's padding): contiguous
    where the layer's pages are, as the CPU backend wants."""
    shape, stride = tuple(view.shape), tuple(view.stride())
    if len(shape) != 4 or shape[1:3] != (1, 1) or view.element_size() != 1:
        raise ValueError(f"a Mamba page view of shape {shape} is not [B, 1, 1, bytes]")
    end = int(view.storage_offset()) + (shape[0] - 1) * stride[0] + page_bytes
    if shape[3] >= page_bytes or stride[0] < page_bytes or end > view.untyped_storage().nbytes():
        return view
    return view.as_strided((shape[0], 1, 1, page_bytes), (stride[0],) * 3 + (1,))
