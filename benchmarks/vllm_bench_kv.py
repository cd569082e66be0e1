"""vLLM's KV cache for a hybrid benchmark model: what its hybrid KV cache manager makes of the
layers, so the benchmark sizes the GPU KV cache in the blocks vLLM allocates.

vLLM (0.25.1 and 0.32 alike) puts a hybrid model's layers of one kind (full attention, sliding
window, Mamba) into groups of ``group_layers`` layers each, the smallest count of any kind
(``_get_kv_cache_groups_uniform_page_size``); every layer's page of one block has the same size
(Mamba pages are padded up to the attention page), and the groups share one pool of blocks:
``kv_cache_memory_bytes`` = blocks x ``group_layers`` x page. With prefix caching on, a Mamba-2
model runs in ``mamba_cache_mode`` ``all`` (one state page per block at each block boundary) and
its attention block grows until one attention page holds a Mamba state: the smallest multiple of
the Mamba chunk size (128 for Nemotron-H) whose attention page is at least the state
(``HasInnerState`` config update in ``vllm/platforms/interface.py``; 1,152 tokens for Nemotron-H-8B,
as the H100 log says).

At start vLLM checks that the pool holds one request of ``max_model_len`` at the peak it may
reserve for it (``max_memory_usage_bytes`` of each group's spec): a full-attention group a block
per ``block_tokens`` tokens; a sliding-window group ``cdiv(min(window - 1 +
max_num_batched_tokens, max_model_len), block) + 1`` blocks (what one prefill chunk holds); a
Mamba group in ``all`` mode a block per ``block_tokens`` tokens (a state at every boundary of the
chunk). ``request_blocks`` is that figure.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVPool:
    """vLLM's KV block pool for a hybrid model (see the module docstring)."""

    block_tokens: int
    group_layers: int
    """Layers per KV cache group: one page of each per block."""
    page_bytes: int
    """One layer's page of one block (a Mamba state padded to the attention page)."""
    full_groups: int
    window_groups: int = 0
    window: int = 0
    state_groups: int = 0
    """Mamba groups, in ``mamba_cache_mode`` ``all``."""

    @property
    def block_bytes(self) -> int:
        """GPU bytes of one pool block: a page of each of a group's layers."""
        return self.group_layers * self.page_bytes

    @property
    def groups(self) -> int:
        return self.full_groups + self.window_groups + self.state_groups

    @property
    def full_attention_bytes_per_token(self) -> int:
        """What a model of the same size with full attention in every layer that keeps a cache
        (each group's layers, Mamba ones too, at the attention page) stores per token."""
        return self.groups * self.block_bytes // self.block_tokens

    def request_blocks(self, tokens: int, max_batched_tokens: int) -> int:
        """Blocks vLLM's start-up check reserves for one request of ``tokens`` tokens (its peak:
        a prefill of up to ``max_batched_tokens`` tokens in one step)."""
        per_group = cdiv(tokens, self.block_tokens)
        window = 0
        if self.window_groups:
            held = min(self.window - 1 + max_batched_tokens, tokens)
            window = cdiv(held, self.block_tokens) + 1
        return (
            per_group * self.full_groups
            + window * self.window_groups
            + per_group * self.state_groups
        )

    def request_bytes(self, tokens: int, max_batched_tokens: int) -> int:
        return self.request_blocks(tokens, max_batched_tokens) * self.block_bytes

    def round_tokens(self, tokens: int) -> int:
        """``tokens`` rounded up to whole blocks."""
        return cdiv(tokens, self.block_tokens) * self.block_tokens


def attention_page_per_token(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """One attention layer's K and V bytes per token."""
    return 2 * int(config["num_key_value_heads"]) * int(config["head_dim"]) * dtype_bytes


def gemma3_pool(config: dict[str, Any]) -> KVPool:
    """Gemma 3's text model: every ``sliding_window_pattern``-th layer full attention, the others
    a sliding window; vLLM's CUDA block of 16 tokens."""
    layers = int(config["num_hidden_layers"])
    full = layers // int(config["sliding_window_pattern"])
    sliding = layers - full
    group = min(full, sliding)
    block = 16
    return KVPool(
        block_tokens=block,
        group_layers=group,
        page_bytes=block * attention_page_per_token(config),
        full_groups=cdiv(full, group),
        window_groups=cdiv(sliding, group),
        window=int(config["sliding_window"]),
    )


def mamba2_state_bytes(config: dict[str, Any]) -> int:
    """A Mamba-2 layer's state: the conv state ((kernel - 1) x (inner + 2 x groups x state),
    bfloat16) and the SSM state (heads x head_dim x state, float32: vLLM's default
    ``mamba_ssm_cache_dtype`` for Nemotron-H)."""
    inner = int(config["mamba_num_heads"]) * int(config["mamba_head_dim"])
    conv_dim = inner + 2 * int(config["n_groups"]) * int(config["ssm_state_size"])
    conv = (int(config["conv_kernel"]) - 1) * conv_dim * 2
    ssm = inner * int(config["ssm_state_size"]) * 4
    return conv + ssm


def nemotron_h_pool(config: dict[str, Any]) -> KVPool:
    """Nemotron-H: ``*`` layers attend, ``M`` layers are Mamba-2 (``-``: MLP, no cache); the
    attention block is the smallest multiple of the Mamba chunk size whose page holds a state."""
    pattern = str(config["hybrid_override_pattern"])
    attention, mamba = pattern.count("*"), pattern.count("M")
    group = min(attention, mamba)
    per_token = attention_page_per_token(config)
    chunk = int(config["chunk_size"])
    block = chunk * cdiv(cdiv(mamba2_state_bytes(config), per_token), chunk)
    return KVPool(
        block_tokens=block,
        group_layers=group,
        page_bytes=block * per_token,
        full_groups=cdiv(attention, group),
        state_groups=cdiv(mamba, group),
    )
