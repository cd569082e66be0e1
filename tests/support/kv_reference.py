"""Reference KV data in numpy for the copy tests: engine tensors of each layout holding the same
logical blocks, and the bytes one engine block must have in a slot."""

from __future__ import annotations

import numpy as np

from kvtier.copy.cuda.plan import KVLayout

LAYERS = 3
BLOCK_TOKENS = 4
HEADS = 2
HEAD_DIM = 8


def logical_blocks(rng: np.random.Generator, num_blocks: int) -> np.ndarray:
    """``[num_blocks, layers, 2, tokens, heads, dim]`` random 16-bit words (bf16 stand-ins)."""
    shape = (num_blocks, LAYERS, 2, BLOCK_TOKENS, HEADS, HEAD_DIM)
    return rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)


def engine_arrays(logical: np.ndarray, layout: KVLayout) -> list[np.ndarray]:
    """Engine tensors of ``layout`` holding ``logical`` (fresh contiguous arrays)."""
    if layout is KVLayout.BLOCK_COMPACT:
        return [logical.copy()]
    if layout is KVLayout.LAYER_KV_FIRST:
        return [
            np.ascontiguousarray(logical[:, layer].transpose(1, 0, 2, 3, 4))
            for layer in range(logical.shape[1])
        ]
    return [np.ascontiguousarray(logical[:, layer]) for layer in range(logical.shape[1])]


def to_logical(arrays: list[np.ndarray], layout: KVLayout) -> np.ndarray:
    """Inverse of ``engine_arrays``."""
    if layout is KVLayout.BLOCK_COMPACT:
        return arrays[0]
    if layout is KVLayout.LAYER_KV_FIRST:
        return np.stack([a.transpose(1, 0, 2, 3, 4) for a in arrays], axis=1)
    return np.stack(arrays, axis=1)


def block_bytes(logical: np.ndarray, block: int) -> bytes:
    """What engine block ``block`` looks like in a slot: ``[layers, 2, tokens, heads, dim]``."""
    return logical[block].tobytes()
