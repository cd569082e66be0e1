"""Which copy backend moves a rank's blocks: the one ``kvtier.registry.COPY_BACKENDS`` names for
the device type its KV tensors live on (``copy/<device>.py``, or one registered for another device).

The engine's per-layer KV tensors are taken as they are; ``cuda_layout`` recognises which of the
per-layer shapes engines use they have (the CUDA backend then checks their strides).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.copy.base import CopyBackend
from kvtier.pool import HostPool
from kvtier.registry import COPY_BACKENDS

BackendFactory = Callable[[Sequence[Any], HostPool, int, int, int, Any], CopyBackend]
"""``make_backend``'s signature: (KV tensors, pool, blocks per slot, rank, ranks, copy options)."""


def make_backend(
    kv_caches: Sequence[Any],
    pool: HostPool,
    blocks_per_slot: int,
    tp_rank: int,
    tp_size: int,
    copy_options: Any = None,
) -> CopyBackend:
    """The copy backend for the device the KV tensors live on, built with the tensors and the
    keywords ``pool``, ``blocks_per_slot``, ``tp_rank`` and ``tp_size``, plus ``layout``
    (``cuda_layout``) and ``options`` (``copy_options``) where its constructor names them (the CUDA
    backend does, the CPU backend does not). ``NotImplementedError`` for a device without one."""
    if not kv_caches:
        raise ValueError("register_kv_caches gave no KV tensors")
    device = kv_caches[0].device.type
    if device not in COPY_BACKENDS:
        known = ", ".join(repr(name) for name in COPY_BACKENDS)
        raise NotImplementedError(f"kvtier has no copy backend for {device!r} KV (only {known})")
    cls = COPY_BACKENDS.load(device, "copy backend")
    wanted = inspect.signature(cls).parameters
    extra: dict[str, Any] = {}
    if "layout" in wanted:
        extra["layout"] = cuda_layout(kv_caches)
    if "options" in wanted:
        extra["options"] = copy_options
    backend: CopyBackend = cls(
        kv_caches,
        pool=pool,
        blocks_per_slot=blocks_per_slot,
        tp_rank=tp_rank,
        tp_size=tp_size,
        **extra,
    )
    return backend


def cuda_layout(kv_caches: Sequence[Any]) -> Any:
    """Which layout an engine's per-layer CUDA tensors have (the backend checks their strides):
    vLLM 0.32's ``[num_blocks, kv_heads, block_size, K + V]`` views, in whichever
    ``KVCacheLayout`` order, and FlashInfer's older ``[num_blocks, 2, ...]`` are
    ``LAYER_BLOCKS_FIRST``; FlashAttention's older ``[2, num_blocks, ...]`` is
    ``LAYER_KV_FIRST``."""
    from kvtier.copy.cuda.plan import KVLayout

    shapes = {tuple(t.shape) for t in kv_caches}
    if len(shapes) != 1:
        raise ValueError(f"KV tensors of different shapes: {sorted(shapes)}")
    shape = next(iter(shapes))
    if len(shape) == 4:
        return KVLayout.LAYER_BLOCKS_FIRST
    if len(shape) == 5 and shape[0] == 2 and shape[1] != 2:
        return KVLayout.LAYER_KV_FIRST
    if len(shape) == 5 and shape[1] == 2 and shape[0] != 2:
        return KVLayout.LAYER_BLOCKS_FIRST
    raise ValueError(
        f"unrecognised per-layer KV shape {shape} (want [blocks, heads, tokens, K+V], "
        "[2, blocks, ...] or [blocks, 2, ...])"
    )
