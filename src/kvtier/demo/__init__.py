"""``python -m kvtier.demo``: vLLM (CPU build) with kvtier on a multi-turn workload.

A small Llama-architecture model with seeded random weights is written locally (no download);
the workload is derived from the bundled trace (one trace block of 512 tokens becomes one block
of 32 tokens; requests that start with the same block form a session whose later turns re-send
the earlier ones as prefix). The same requests run once without kvtier and once with it (host
pool + fs tier in a local folder); the demo prints per-tier hit ratios, bytes moved and prefill
time, and writes them as JSON. vLLM is imported only when the demo runs.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path
from typing import Any

from kvtier.sim.trace import bundled_trace_path, read_trace

BLOCK_TOKENS = 32
TRACE_BLOCK_TOKENS = 512
MODEL_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# float32 KV of one 32-token block: layers x tokens x kv_heads x (K and V) x head_dim x 4 bytes.
BLOCK_BYTES = 4 * BLOCK_TOKENS * 2 * 2 * 64 * 4


def write_model(directory: Path, seed: int = 0) -> Path:
    """``config.json`` + ``model.safetensors`` with seeded N(0, s) weights (same in every run)."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    cfg = MODEL_CONFIG
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q_dim = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_dim = cfg["num_key_value_heads"] * cfg["head_dim"]

    def rnd(rows: int, cols: int, std: float) -> Any:
        return torch.randn(rows, cols, generator=gen) * std

    weights: dict[str, Any] = {"model.embed_tokens.weight": rnd(vocab, hidden, 1.0)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = torch.ones(hidden)
        weights[p + "post_attention_layernorm.weight"] = torch.ones(hidden)
        weights[p + "self_attn.q_proj.weight"] = rnd(q_dim, hidden, 0.1)
        weights[p + "self_attn.k_proj.weight"] = rnd(kv_dim, hidden, 0.1)
        weights[p + "self_attn.v_proj.weight"] = rnd(kv_dim, hidden, 0.1)
        weights[p + "self_attn.o_proj.weight"] = rnd(hidden, q_dim, 0.06)
        weights[p + "mlp.gate_proj.weight"] = rnd(inter, hidden, 0.06)
        weights[p + "mlp.up_proj.weight"] = rnd(inter, hidden, 0.06)
        weights[p + "mlp.down_proj.weight"] = rnd(hidden, inter, 0.04)
    weights["model.norm.weight"] = torch.ones(hidden)
    weights["lm_head.weight"] = rnd(vocab, hidden, 0.1)
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def build_workload(n_requests: int, max_blocks: int = 24, scan: int = 4000) -> list[list[int]]:
    """Token-id prompts: trace requests of multi-turn sessions, scaled to 32-token blocks."""
    trace = read_trace(bundled_trace_path(), limit=scan)
    sessions = Counter(r.hash_ids[0] for r in trace if r.hash_ids)
    vocab = int(MODEL_CONFIG["vocab_size"])
    prompts: list[list[int]] = []
    for index, request in enumerate(trace):
        if not request.hash_ids or sessions[request.hash_ids[0]] < 2:
            continue
        tokens: list[int] = []
        for h in request.hash_ids[:max_blocks]:
            rng = random.Random(h)
            tokens.extend(rng.randrange(3, vocab) for _ in range(BLOCK_TOKENS))
        tail = (request.input_length % TRACE_BLOCK_TOKENS) * BLOCK_TOKENS // TRACE_BLOCK_TOKENS
        rng = random.Random(1_000_003 * index)
        tokens.extend(rng.randrange(3, vocab) for _ in range(max(tail, 1)))
        prompts.append(tokens)
        if len(prompts) >= n_requests:
            break
    return prompts


def kvtier_config(workdir: Path, stats_path: Path) -> dict[str, Any]:
    """The embedded default: a 64 MiB host pool and an fs tier in ``workdir/fs``."""
    return {
        "pool": {"size": "64MiB"},
        "tiers": [{"kind": "fs", "path": str(workdir / "fs"), "capacity": "1GiB"}],
        "vllm": {"stats_path": str(stats_path)},
    }


def prepare_env() -> None:
    for key, value in {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }.items():
        os.environ.setdefault(key, value)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
