"""Tiny hybrid models for the end-to-end tests: written locally, nothing is downloaded.

:func:`write_tiny_gemma2` writes a Gemma-2-shaped model (sliding-window layers interleaved with
full-attention layers, as in Gemma 2 and 3) with seeded random weights drawn from a CPU
``torch.Generator``: projections N(0, 1/fan_in), embeddings N(0, 0.02^2), norms N(0, 0.1^2).
:func:`write_tiny_nemotron_h` writes a Nemotron-H-shaped model (Mamba-2 layers with attention
and MLP layers between them) the same way; its norms (which multiply, unlike Gemma's ``1 + w``)
are 1 + N(0, 0.1^2). vLLM's CPU build runs no Mamba model; the GPU tests use it.
With these, the greedy output depends on tokens far outside the window (through the
full-attention layers) and differs from prompt to prompt; ``transformers``' own initialisation
and vLLM's dummy weights give the same token for every prompt. No tokenizer: token-id prompts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GEMMA2_WINDOW = 64
"""The sliding window of the tiny Gemma-2, in tokens (two of the CPU build's 32-token blocks)."""

TINY_GEMMA2: dict[str, Any] = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "sliding_window": GEMMA2_WINDOW,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 4096,
    "query_pre_attn_scalar": 32,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "torch_dtype": "float32",
}
"""Layers 0 and 2 slide, 1 and 3 attend to everything (Gemma 2 alternates, starting with a
sliding layer). ``layer_types`` is written out: vLLM's Gemma-2 reads each layer's kind from it,
and older ``transformers`` releases have no such field to fill in (written, it reaches vLLM from
``config.json`` whatever the release)."""


def write_tiny_gemma2(model_dir: str | Path, *, seed: int = 0, **overrides: Any) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of a tiny Gemma-2 (see the module
    docstring); ``overrides`` change config fields (e.g. ``sliding_window``)."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    path = Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    config = {**TINY_GEMMA2, **overrides}
    if "layer_types" not in overrides:  # alternating, for any number of layers
        kinds = ("sliding_attention", "full_attention")
        config["layer_types"] = [kinds[i % 2] for i in range(int(config["num_hidden_layers"]))]
    model = Gemma2ForCausalLM(Gemma2Config(**config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            draw = torch.randn(param.shape, generator=generator)
            if "embed" in name:
                param.copy_(draw * 0.02)
            elif param.dim() == 2:
                param.copy_(draw / param.shape[1] ** 0.5)
            else:
                param.copy_(draw * 0.1)
    model.save_pretrained(str(path), safe_serialization=True)
    # save_pretrained writes its own config.json; keep exactly the fields above.
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    return path


TINY_NEMOTRON_H: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 6,
    "hybrid_override_pattern": "M*M-M*",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "mamba_num_heads": 8,
    "mamba_head_dim": 32,
    "ssm_state_size": 64,
    "n_groups": 1,
    "conv_kernel": 4,
    "chunk_size": 128,
    "expand": 2,
    "mamba_hidden_act": "silu",
    "mlp_hidden_act": "relu2",
    "use_conv_bias": True,
    "use_bias": False,
    "mlp_bias": False,
    "attention_bias": False,
    "residual_in_fp32": False,
    "layer_norm_epsilon": 1e-5,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""Three Mamba-2 layers, two attention layers and one MLP layer. A Mamba-2 state is 3 x (256 +
128) conv values (bfloat16) and 8 x 32 x 64 SSM values (float32): 67,840 bytes, which vLLM's
``mamba_cache_mode`` ``all`` rounds up to a 256-token attention block (2 heads of 64, bfloat16:
512 bytes a token; a multiple of the 128-token chunk)."""
NEMOTRON_H_BLOCK = 256
"""The attention block vLLM picks for it on a GPU in bfloat16 (see ``TINY_NEMOTRON_H``); the
CPU build, in float32 with its own kernel alignment, picks another."""


def write_tiny_nemotron_h(model_dir: str | Path, *, seed: int = 0) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of a tiny Nemotron-H (see the module
    docstring) through ``transformers``' ``NemotronHForCausalLM`` (vLLM maps its parameter names:
    ``backbone`` or ``model``, ``embeddings``, ``A_log``)."""
    import torch
    from transformers import NemotronHConfig, NemotronHForCausalLM

    path = Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    model = NemotronHForCausalLM(NemotronHConfig(**TINY_NEMOTRON_H))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            draw = torch.randn(param.shape, generator=generator)
            if "embed" in name:
                param.copy_(draw * 0.02)
            elif name.endswith("norm.weight") or name.endswith("norm_f.weight"):
                param.copy_(1 + draw * 0.1)
            elif param.dim() >= 2:
                param.copy_(draw / (param[0].numel()) ** 0.5)
            else:
                param.copy_(draw * 0.1)
    model.to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    (path / "config.json").write_text(json.dumps(TINY_NEMOTRON_H, indent=2, sort_keys=True))
    return path
