"""The engine side of ``benchmarks/vllm_gpu_bench.py``: model, request sequence, each
configuration's engine arguments, the connector's timer and the disk guard.

Imports vLLM only inside the functions that start or drive an engine.
"""

from __future__ import annotations

import cProfile
import gc
import hashlib
import importlib
import importlib.util
import json
import math
import os
import pstats
import random
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import config_variants as variants
import vllm_grid_report as gr
from vllm_bench_kv import KVPool, gemma3_pool, nemotron_h_pool

from kvtier.demo import FIRST_TOKEN, MODELS, ModelSize, Workload, build_workload, write_model
from kvtier.engine.load_mode import LoadMode
from kvtier.integrations.vllm.settings import default_load_mode

CONFIGS = ("none", "native", "native_fs", "kvtier", "kvtier_fs")
FS_CONFIGS = frozenset({"native_fs", "kvtier_fs"})
"""The bases with an fs tier; a variant of one (``config_variants``) has it too."""
LLAMA_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
GEMMA3_12B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 3840,
    "intermediate_size": 15360,
    "num_hidden_layers": 48,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "vocab_size": 262208,
    "sliding_window": 1024,
    "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "hidden_activation": "gelu_pytorch_tanh",
    "attn_logit_softcapping": None,
    "final_logit_softcapping": None,
    "torch_dtype": "bfloat16",
    "bos_token_id": 2,
    "eos_token_id": 1,
}
"""Gemma-3-12B's text model: 5 sliding-window layers (1024 tokens) to each full-attention one."""
NEMOTRON_H_ATTENTION = (7, 18, 29, 40)
NEMOTRON_H_8B: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "hidden_size": 4096,
    "intermediate_size": 21504,
    "num_hidden_layers": 52,
    "hybrid_override_pattern": "".join(
        "*" if i in NEMOTRON_H_ATTENTION else "M-"[i % 2] for i in range(52)
    ),
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mamba_num_heads": 128,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
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
    "vocab_size": 131072,
    "max_position_embeddings": 16384,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
"""Nemotron-H-8B's shape (an SSM hybrid): 52 layers, Mamba-2 and MLP layers with 4 attention
layers among them."""
HYBRID_MODELS: dict[str, tuple[str, dict[str, Any], KVPool]] = {
    "gemma3": (
        "Gemma-3-12B text architecture (sliding window 1024, 5:1), dummy weights, bf16",
        GEMMA3_12B,
        gemma3_pool(GEMMA3_12B),
    ),
    "nemotronh": (
        "Nemotron-H-8B architecture (Mamba-2 hybrid, 4 attention layers), dummy weights, bf16",
        NEMOTRON_H_8B,
        nemotron_h_pool(NEMOTRON_H_8B),
    ),
}
"""``--model`` choices of hybrid models: (name, config.json, vLLM's KV block pool for it:
``vllm_bench_kv``)."""


@dataclass(frozen=True, slots=True)
class RunDefaults:
    """``--concurrency``, ``--requests`` and ``--host-gib`` when the command line leaves them."""

    concurrency: int = 16
    requests: int = 160
    host_gib: float = 8.0


RUN_DEFAULTS: dict[str, RunDefaults] = {
    "gemma3": RunDefaults(concurrency=4, requests=160, host_gib=12.0),
    "nemotronh": RunDefaults(concurrency=4, requests=40, host_gib=8.0),
}
"""Per model (others: ``RunDefaults()``). Gemma-3-12B: at 16 conversations in flight and 8 GiB
(H100, vLLM 0.25.1, 2026-11-27) no pool held a conversation between its turns (kvtier 119,792
evictions, no configuration any cached token); ``vllm_bench_hits`` predicts kvtier's pool holds
them from 4 GiB at 4 in flight and native offloading (every block of all six groups) from 10 GiB,
at 8 in flight from 16 GiB: 4 and 12 GiB. Nemotron-H-8B: its engine start (Mamba kernels' warm-up
88 s on the H100) and 160 requests ran past 170 s; 40 requests at 4 in flight (12 conversations,
25 requests that resume a previous turn) fit about 150 s, both pools holding every conversation."""
HYBRID_KV_REQUESTS = 2.5
"""A hybrid model's GPU KV cache by default: this many of the workload's longest requests at the
peak vLLM reserves for one (its start-up check), about what ``--gpu-kv-gib 2`` is for
Llama-3.1-8B (2.47 of its longest requests, 6,612 tokens at 128 KiB each)."""
VLLM_BATCHED_TOKENS = 16384
"""vLLM's ``max_num_batched_tokens`` for ``LLM`` on a GPU of 70 GiB or more (0.25.1, 0.32): the
longest prefill chunk, which a sliding-window group holds whole."""
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "on_new_request",
    "take_events",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "get_external_cache_hit_sources",
    "has_pending_block_frees",
)
"""The scheduler-side connector methods vLLM's scheduler calls (0.25.1 to 0.32), the same for
kvtier's connector and vLLM's OffloadingConnector; the ones a connector lacks are skipped."""


@dataclass(slots=True)
class ModelSpec:
    name: str
    path: Path
    vocab: int
    kv_bytes_per_token: int
    """KV bytes a token adds (a hybrid model: its full-attention layers' only)."""
    gpu: bool
    pool: KVPool | None = None
    """A hybrid model's KV block pool as vLLM's hybrid KV cache manager builds it (None: one
    full-attention group, ``kv_bytes_per_token`` per token)."""

    @property
    def block_tokens(self) -> int:
        """vLLM's block size: its default on CUDA, 32 on CPU (its attention needs it); a hybrid
        model's is its pool's (1,152 tokens for Nemotron-H-8B)."""
        if self.pool is not None:
            return self.pool.block_tokens
        return 16 if self.gpu else 32


def make_model(kind: str, workdir: Path) -> ModelSpec:
    path = workdir / f"model-{kind}"
    path.mkdir(parents=True, exist_ok=True)
    if kind == "llama8b":
        (path / "config.json").write_text(json.dumps(LLAMA_8B, indent=1))
        c = LLAMA_8B
        per_token = c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * c["head_dim"] * 2
        return ModelSpec(
            "Llama-3.1-8B architecture, dummy weights, bf16", path, 128256, per_token, True
        )
    if kind in HYBRID_MODELS:
        name, config, pool = HYBRID_MODELS[kind]
        (path / "config.json").write_text(json.dumps(config, indent=1))
        per_token = pool.full_groups * pool.block_bytes // pool.block_tokens
        return ModelSpec(name, path, int(config["vocab_size"]), per_token, True, pool)
    size: ModelSize = MODELS["tiny"]
    write_model(path, size)
    per_token = size.num_hidden_layers * 2 * size.num_key_value_heads * size.head_dim * 4
    return ModelSpec("tiny Llama, float32 (CPU smoke run)", path, size.vocab_size, per_token, False)


# -- the request sequence -----------------------------------------------------------------------


def widen(tokens: tuple[int, ...], factor: int, vocab: int) -> list[int]:
    """Each token becomes ``factor`` tokens derived from it: equal prefixes stay equal."""
    span = vocab - FIRST_TOKEN
    out: list[int] = []
    for t in tokens:
        out.extend(FIRST_TOKEN + (t * 7919 + k * 104729) % span for k in range(factor))
    return out


@dataclass(slots=True)
class Conversation:
    """A conversation's turns not sent yet, each a (turn number, prompt)."""

    index: int
    turns: deque[tuple[int, list[int]]] = field(default_factory=deque)

    def next_request(self) -> tuple[str, list[int]]:
        """The next turn's submission id (``c<conversation>.t<turn>``, the same in every
        configuration) and prompt."""
        turn, prompt = self.turns.popleft()
        return f"c{self.index}.t{turn}", prompt


@dataclass(frozen=True, slots=True)
class Prompts:
    """The workload's prompts, widened, grouped by conversation in the order they start."""

    by_conversation: list[tuple[int, list[tuple[int, list[int]]]]]
    dropped: int
    """Conversations left out because a prompt of theirs does not fit ``max_prompt``."""

    def conversations(self) -> list[Conversation]:
        """Fresh conversations to send (each run consumes its own)."""
        return [Conversation(i, deque(turns)) for i, turns in self.by_conversation]

    def all(self) -> list[list[int]]:
        return [p for _i, turns in self.by_conversation for _t, p in turns]


def conversations(workload: Workload, factor: int, vocab: int, max_prompt: int) -> Prompts:
    by_session: dict[int, list[tuple[int, list[int]]]] = {}
    for turn in workload.turns:
        prompt = widen(turn.tokens, factor, vocab)
        by_session.setdefault(turn.session, []).append((turn.turn, prompt))
    kept = [
        (session, turns)
        for session, turns in by_session.items()
        if all(len(p) <= max_prompt for _t, p in turns)
    ]
    return Prompts(kept, len(by_session) - len(kept))


def workload_digest(settings: dict[str, Any], prompts: Iterable[list[int]]) -> str:
    """Equal digests: the same request sequence sent to the same engine settings."""
    h = hashlib.blake2b(json.dumps(settings, sort_keys=True).encode(), digest_size=8)
    for prompt in prompts:
        h.update(len(prompt).to_bytes(4, "little"))
        h.update(b"".join(t.to_bytes(4, "little") for t in prompt))
    return h.hexdigest()


def reusable_tokens(prompts: list[list[int]], block: int) -> int:
    """Prompt tokens in full blocks that an earlier prompt (in this order) already had: what an
    unbounded cache could serve."""
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    reusable = 0
    for prompt in prompts:
        parent = -1
        for b in range(len(prompt) // block):
            key = (parent, tuple(prompt[b * block : (b + 1) * block]))
            if key in ids:
                reusable += block
            parent = ids.setdefault(key, len(ids))
    return reusable


@dataclass(frozen=True, slots=True)
class Settings:
    """What every point shares (from the command line)."""

    turns: int
    context_blocks: int
    widen: int
    max_tokens: int
    max_model_len: int
    gpu_kv_gib: float | None
    workdir: Path
    gpu_kv_requests: float | None = None


def engine_max_len(settings: Settings, model: ModelSpec, longest: int) -> int:
    """The engine's ``max_model_len``: ``--max-model-len``; a hybrid model's is lowered to the
    workload's longest request in whole blocks (vLLM checks at start that the GPU KV cache holds
    one request of ``max_model_len``, which at 16,384 tokens takes more than the pool the
    benchmark means to give it: Nemotron-H-8B 1.85 GiB, Gemma-3-12B 6 GiB)."""
    if model.pool is None:
        return settings.max_model_len
    return min(settings.max_model_len, model.pool.round_tokens(longest + settings.max_tokens))


def kv_bytes(settings: Settings, model: ModelSpec, concurrency: int, longest: int) -> int:
    """``--gpu-kv-gib``; else ``--gpu-kv-requests`` longest requests, by default ``concurrency``
    of them (a hybrid model: ``HYBRID_KV_REQUESTS``, each at the peak vLLM reserves for one, in
    whole blocks). A hybrid model's size must hold one request of the engine's ``max_model_len``
    (``ValueError`` otherwise: vLLM would refuse to start)."""
    gib = int(settings.gpu_kv_gib * (1 << 30)) if settings.gpu_kv_gib else None
    pool = model.pool
    if pool is None:
        if gib is not None:
            return gib
        requests = settings.gpu_kv_requests or concurrency
        return int(requests * (longest + settings.max_tokens) * model.kv_bytes_per_token)
    max_len = engine_max_len(settings, model, longest)
    need = pool.request_blocks(max_len, VLLM_BATCHED_TOKENS)
    if gib is not None:
        if gib < need * pool.block_bytes:
            raise ValueError(
                f"--gpu-kv-gib {settings.gpu_kv_gib:g} holds {gib // pool.block_bytes} blocks of "
                f"{pool.block_bytes / (1 << 20):g} MiB; vLLM needs {need} for one request of "
                f"{max_len} tokens ({need * pool.block_bytes / (1 << 30):.3f} GiB)"
            )
        return gib
    requests = settings.gpu_kv_requests or HYBRID_KV_REQUESTS
    blocks = max(need, math.ceil(requests * need))
    return blocks * pool.block_bytes


def build_point(
    settings: Settings, model: ModelSpec, concurrency: int, requests: int
) -> tuple[Prompts, dict[str, Any]]:
    """The request sequence at ``concurrency`` and the JSON's summary of it (``digest``: equal
    for an equal sequence and equal engine settings)."""
    workload = build_workload(
        requests, concurrency, settings.turns, settings.context_blocks, vocab=model.vocab
    )
    prompts = conversations(
        workload, settings.widen, model.vocab, settings.max_model_len - settings.max_tokens
    )
    lengths = sorted(len(p) for p in prompts.all())
    if not lengths:
        raise ValueError(f"no conversation fits --max-model-len {settings.max_model_len}")
    gpu_kv = kv_bytes(settings, model, concurrency, lengths[-1])
    max_len = engine_max_len(settings, model, lengths[-1])
    engine = {
        "model": model.name,
        "concurrency": concurrency,
        "max_tokens": settings.max_tokens,
        "gpu_kv_bytes": gpu_kv,
        "max_model_len": max_len,
    }
    summary = {
        "requests": len(lengths),
        "conversations": len(prompts.by_conversation),
        "dropped_conversations": prompts.dropped,
        "concurrency": concurrency,
        "turns": settings.turns,
        "context_blocks": settings.context_blocks,
        "widen": settings.widen,
        "prompt_tokens": sum(lengths),
        "prompt_tokens_p50": lengths[len(lengths) // 2],
        "prompt_tokens_max": lengths[-1],
        "reusable_prompt_tokens": reusable_tokens(prompts.all(), model.block_tokens),
        "max_tokens": settings.max_tokens,
        "gpu_kv_gib": round(gpu_kv / (1 << 30), 3),
        "gpu_kv_bytes": gpu_kv,
        "max_model_len": max_len,
        "digest": workload_digest(engine, prompts.all()),
    }
    if model.pool is not None:
        summary["block_tokens"] = model.pool.block_tokens
        summary["gpu_kv_blocks"] = gpu_kv // model.pool.block_bytes
        summary["request_peak_blocks"] = model.pool.request_blocks(max_len, VLLM_BATCHED_TOKENS)
    return prompts, summary


# -- engine arguments ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One configuration's engine: what ``engine_kwargs`` needs."""

    config: str
    """A label: a base of ``CONFIGS``, with kvtier settings (or ``beside.`` ones, the bench's)
    after ``+`` for a variant."""
    concurrency: int
    host_gib: float
    fs_gib: float
    kv_bytes: int
    max_model_len: int
    workdir: Path

    @property
    def variant(self) -> variants.ConfigSpec:
        """The label parsed: its base and the kvtier keys it sets (none for a base)."""
        return variants.parse_config(self.config, CONFIGS)

    @property
    def base(self) -> str:
        """The base configuration: it decides the engine, the fs tier and the disk rules (a
        label that does not parse fails here, before an engine starts)."""
        return self.variant.kind

    @property
    def has_fs(self) -> bool:
        return self.base in FS_CONFIGS

    @property
    def kvtier_fs_dir(self) -> Path:
        return self.workdir / "fs"

    @property
    def native_fs_dir(self) -> Path:
        return self.workdir / "native_fs"

    @property
    def beside_dir(self) -> Path:
        """Where a writer beside the engine (``beside.write_mbps``) puts its files."""
        return self.workdir / "beside"

    @property
    def stats_path(self) -> Path:
        return self.workdir / f"stats-{variants.file_label(self.config)}.json"


def fs_dirs(workdir: Path) -> tuple[Path, Path]:
    return workdir / "fs", workdir / "native_fs"


def clear_fs(workdir: Path) -> None:
    """Delete the fs tiers' directories (kvtier's and vLLM's) under ``workdir``."""
    for path in fs_dirs(workdir):
        shutil.rmtree(path, ignore_errors=True)


ASYNC_LOADS_ENV = "KVTIER_BENCH_ASYNC_LOADS"
"""``1``: the kvtier configurations load through vLLM's asynchronous path (``vllm.async_loads``);
``0``: synchronously; ``auto``: per request (``vllm.async_loads: auto``); unset: kvtier's
default (``auto`` for the pool alone, synchronous with the fs tier). Give a run that sets it its
own ``--json``."""


def async_loads(tiered: bool) -> bool | str:
    """``vllm.async_loads`` of a kvtier configuration (``tiered``: with a secondary tier), as
    the row records it."""
    value = os.environ.get(ASYNC_LOADS_ENV)
    if value is None:
        mode = default_load_mode(tiered)
        return mode.value if mode is LoadMode.AUTO else mode is LoadMode.ASYNC
    return "auto" if value == "auto" else value == "1"


EVICTION_ENV = "KVTIER_BENCH_EVICTION"
"""An eviction policy name for the kvtier configurations (default: kvtier's default); give such
a run its own ``--json``."""


def eviction() -> str | None:
    return os.environ.get(EVICTION_ENV) or None


def kvtier_extra(spec: RunSpec) -> dict[str, Any]:
    """kvtier's connector config for ``spec``: its base's, then a variant's keys set on it."""
    tiers = []
    if spec.base == "kvtier_fs":
        spec.kvtier_fs_dir.mkdir(parents=True, exist_ok=True)
        capacity = f"{spec.fs_gib:g}GiB"
        tiers.append({"kind": "fs", "path": str(spec.kvtier_fs_dir), "capacity": capacity})
    extra: dict[str, Any] = {
        "pool": {"size": f"{spec.host_gib:g}GiB"},
        "tiers": tiers,
        "vllm": {"stats_path": str(spec.stats_path), "async_loads": async_loads(bool(tiers))},
    }
    if (policy := eviction()) is not None:
        extra["eviction"] = policy
    return variants.apply_overrides(extra, spec.variant.overrides)


def fs_tier_type() -> str:
    """The type vLLM's tiering registers its fs tier under (``fs`` in 0.32); RuntimeError, saying
    why, when this vLLM has no multi-tier offloading or no fs tier in it."""
    import vllm

    version = getattr(vllm, "__version__", "?")
    try:
        factory = importlib.import_module("vllm.v1.kv_offload.tiering.factory")
    except ImportError as exc:
        raise RuntimeError(
            f"vLLM {version} has no multi-tier offloading (vllm.v1.kv_offload.tiering, "
            f"TieringOffloadingSpec), which native_fs needs: {exc}"
        ) from None
    registry = getattr(getattr(factory, "SecondaryTierFactory", None), "_registry", None)
    if not isinstance(registry, dict):
        raise RuntimeError(f"vLLM {version}'s tiering has no SecondaryTierFactory registry")
    if "fs" in registry:
        return "fs"
    for name, loader in registry.items():
        try:
            if loader().__name__ == "FileSystemTierManager":
                return str(name)
        except Exception:  # a tier whose dependencies are missing is not the fs tier
            continue
    raise RuntimeError(
        f"vLLM {version}'s TieringOffloadingSpec has no fs secondary tier "
        f"(registered: {', '.join(map(str, registry))})"
    )


def native_fs_transfer_config(host_gib: float, root: Path, tier_type: str) -> dict[str, Any]:
    """vLLM's OffloadingConnector with a CPU tier of ``host_gib`` and its fs tier in ``root``."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "TieringOffloadingSpec",
            # Only read by a vLLM whose spec factory has not registered the name.
            "spec_module_path": "vllm.v1.kv_offload.tiering.spec",
            "cpu_bytes_to_use": int(host_gib * (1 << 30)),
            "secondary_tiers": [{"type": tier_type, "root_dir": str(root)}],
        },
    }


def engine_kwargs(spec: RunSpec, model: ModelSpec) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": str(model.path),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16" if model.gpu else "float32",
        "kv_cache_memory_bytes": spec.kv_bytes,
        "max_model_len": spec.max_model_len,
        "max_num_seqs": max(spec.concurrency, 8),
        "enable_prefix_caching": True,
        "enforce_eager": not model.gpu,
        "seed": 0,
    }
    if not model.gpu:
        kwargs["block_size"] = model.block_tokens
    if spec.base == "native":
        kwargs["kv_offloading_size"] = spec.host_gib
        kwargs["kv_offloading_backend"] = "native"
    elif spec.base == "native_fs":
        tier_type = fs_tier_type()
        root = spec.native_fs_dir / "tier"
        root.mkdir(parents=True, exist_ok=True)
        kwargs["kv_transfer_config"] = native_fs_transfer_config(spec.host_gib, root, tier_type)
    elif spec.base.startswith(variants.KVTIER_PREFIX):
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": kvtier_extra(spec),
        }
    return kwargs


# -- what runs alongside ------------------------------------------------------------------------


PROFILE_ENV = "KVTIER_BENCH_PROFILE"
"""``DIR`` or ``DIR,MS``: profile (cProfile) the connector's hooks in every engine step that
takes at least ``MS`` milliseconds in them (default 1), merged, written as
``DIR/<config>-<concurrency>x<host GiB>.prof``. The profiler slows the hooks: such a run's
timings are not a row to compare."""


def profile_setting() -> tuple[Path, float] | None:
    """``PROFILE_ENV``'s directory and threshold in seconds, if set."""
    text = os.environ.get(PROFILE_ENV, "")
    if not text:
        return None
    where, _, ms = text.partition(",")
    try:
        threshold = float(ms or 1.0)
    except ValueError:
        raise ValueError(f"{PROFILE_ENV}={text!r}: expected DIR or DIR,MS") from None
    return Path(where), threshold / 1e3


def save_slow_profile(timer: HookTimer, where: Path, name: str) -> None:
    """Write ``timer``'s merged profile of its slow steps, if it has one, as ``where/name``."""
    if timer.slow_profile is not None:
        where.mkdir(parents=True, exist_ok=True)
        timer.slow_profile.dump_stats(where / name)


class HookTimer:
    """Wraps the scheduler-side connector's methods and keeps each engine step's seconds in them,
    wall (``steps``) and the thread's CPU (``cpu_steps``); a step ends with
    ``build_connector_meta``. A hook called from inside another (a base class's default
    delegating to a wrapped method) counts once, in the outer call. Where a slow step's time
    goes: per step, each hook's wall seconds (``hook_steps``) and the garbage collector's pauses
    that began inside a hook (``gc_steps``; the connector's allocations can set them off, and a
    full collection walks every object made since vLLM froze its startup heap). With
    ``profile_s``, the hooks of each step are profiled and the steps that took at least that
    long are merged into ``slow_profile``."""

    def __init__(
        self,
        connector: Any,
        enabled: bool = False,
        profile_s: float | None = None,
        after_step: Callable[[], None] | None = None,
    ) -> None:
        self.after_step = after_step
        """Called at each step's end, outside the timed hooks (``CostSampler``)."""
        self.steps: list[float] = []
        self.cpu_steps: list[float] = []
        self.gc_steps: list[float] = []
        self.hook_steps: list[dict[str, float]] = []
        self._current = self._current_cpu = self._current_gc = 0.0
        self._current_hooks: dict[str, float] = {}
        self._gc_started: float | None = None
        self._depth = 0
        self.enabled = enabled
        self.profile_s = profile_s
        self._profile: cProfile.Profile | None = None
        self.slow_profile: pstats.Stats | None = None
        self.profiled_steps = 0
        for name in SCHEDULER_HOOKS:
            method = getattr(connector, name, None)
            if callable(method):
                setattr(connector, name, self._wrap(name, method))
        gc.callbacks.append(self._on_gc)

    def close(self) -> None:
        """Stop watching the garbage collector (the hooks stay wrapped)."""
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter() if self._depth > 0 else None
        elif self._gc_started is not None:
            self._current_gc += time.perf_counter() - self._gc_started
            self._gc_started = None

    def _wrap(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth += 1
            profile = None
            if self._depth == 1 and self.profile_s is not None and self.enabled:
                profile = self._profile = self._profile or cProfile.Profile()
                profile.enable()
            started, started_cpu = time.perf_counter(), time.thread_time()
            try:
                return method(*args, **kwargs)
            finally:
                if profile is not None:
                    profile.disable()
                self._depth -= 1
                if self._depth == 0:
                    took = time.perf_counter() - started
                    self._current += took
                    self._current_cpu += time.thread_time() - started_cpu
                    self._current_hooks[name] = self._current_hooks.get(name, 0.0) + took
                    if name == "build_connector_meta":
                        self._end_step()

        return timed

    def _end_step(self) -> None:
        profile, self._profile = self._profile, None
        if profile is not None and self.profile_s is not None and self._current >= self.profile_s:
            if self.slow_profile is None:
                self.slow_profile = pstats.Stats(profile)
            else:
                self.slow_profile.add(profile)
            self.profiled_steps += 1
        if self.enabled:
            self.steps.append(self._current)
            self.cpu_steps.append(self._current_cpu)
            self.gc_steps.append(self._current_gc)
            self.hook_steps.append(self._current_hooks)
        self._current = self._current_cpu = self._current_gc = 0.0
        self._current_hooks = {}
        if self.enabled and self.after_step is not None:
            self.after_step()


def kvtier_counters(connector: Any) -> dict[str, Any]:
    """kvtier's cumulative stats snapshot (``get_kv_connector_stats`` hands vLLM per-step
    increments); empty for another connector."""
    snapshot = getattr(connector, "stats_snapshot", None)
    data = snapshot() if callable(snapshot) else None
    return dict(data) if isinstance(data, dict) else {}


COST_FIELDS = ("t_s", "prefill", "reads", "declined", "promoted", "deferred", "held")


class CostSampler:
    """What kvtier's promotion cost rules saw over a run, once a second at a step's end (the
    connector's cumulative stats): seconds since the first sample, the prefill rate they
    measured, each tier's read rate (tokens/s), and the promotions declined, blocks promoted,
    lookups deferred and held in order so far. Kept in the row as ``cost_samples``: a run's
    end-of-run rate alone hid a 2.9x spread between runs of one point (docs/vllm.md)."""

    def __init__(self, connector: Any, every_s: float = 1.0) -> None:
        self._connector = connector
        self._kvtier = callable(getattr(connector, "stats_snapshot", None))
        self.every_s = every_s
        self.rows: list[list[Any]] = []
        self._started: float | None = None
        self._next = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if not self._kvtier or now < self._next:
            return
        self._next = now + self.every_s
        if self._started is None:
            self._started = now
        data = kvtier_counters(self._connector)
        cache, connector = data.get("cache", {}), data.get("connector", {})
        reads = {name: round(rate) for name, rate in data.get("read_tokens_per_s", {}).items()}
        self.rows.append(
            [
                round(now - self._started, 2),
                round(data.get("prefill_tokens_per_s") or 0),
                reads,
                cache.get("promotions_declined", 0),
                cache.get("promoted_blocks", 0),
                connector.get("deferred_lookups", 0),
                connector.get("lookups_held_in_order", 0),
            ]
        )

    def figures(self) -> dict[str, Any]:
        """The row's ``cost_samples`` (``fields``, ``rows``), empty without samples."""
        return (
            {"cost_samples": {"fields": list(COST_FIELDS), "rows": self.rows}} if self.rows else {}
        )


def connector_figures(timer: HookTimer) -> dict[str, Any]:
    """A row's keys from the connector's hooks: per step in microseconds, wall
    (``connector_step_us``) and CPU (``connector_step_cpu_us``), p50/p90/p99 and mean; and the
    slowest 1% of steps by wall time (``connector_slowest_steps``): their mean wall, CPU and GC
    pause, and each hook's mean share."""
    if not timer.steps:
        return {}

    def of(seconds: list[float]) -> dict[str, float]:
        us = [s * 1e6 for s in seconds]
        out = {f"p{q}": round(gr.percentile(us, q), 1) for q in (50, 90, 99)}
        return {**out, "mean": round(sum(us) / len(us), 1), "steps": len(us)}

    count = max(1, len(timer.steps) // 100)
    slowest = sorted(range(len(timer.steps)), key=timer.steps.__getitem__)[-count:]

    def mean_us(values: Iterable[float]) -> float:
        return round(sum(values) * 1e6 / count, 1)

    hooks = sorted({name for i in slowest for name in timer.hook_steps[i]})
    return {
        "connector_step_us": of(timer.steps),
        "connector_step_cpu_us": of(timer.cpu_steps),
        "connector_slowest_steps": {
            "steps": count,
            "wall_us": mean_us(timer.steps[i] for i in slowest),
            "cpu_us": mean_us(timer.cpu_steps[i] for i in slowest),
            "gc_us": mean_us(timer.gc_steps[i] for i in slowest),
            "with_gc": sum(1 for i in slowest if timer.gc_steps[i] > 0),
            "by_hook_us": {
                name: mean_us(timer.hook_steps[i].get(name, 0.0) for i in slowest) for name in hooks
            },
        },
        "steps_with_gc": sum(1 for g in timer.gc_steps if g > 0),
    }


class DiskFloorReached(RuntimeError):
    pass


@dataclass(slots=True)
class DiskGuard:
    """Stops a run whose fs tier is filling the disk (vLLM's has no capacity option)."""

    path: Path
    floor: int
    """Bytes that must stay free."""
    interval_s: float = 0.5
    _next: float = 0.0

    def check(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        free = shutil.disk_usage(self.path).free
        if free < self.floor:
            raise DiskFloorReached(
                f"free space at {self.path} fell to {free / (1 << 30):.1f} GiB, below the "
                f"{self.floor / (1 << 30):.1f} GiB floor: run stopped (vLLM's fs tier has no "
                "capacity limit)"
            )


def offload_shm_files() -> set[str]:
    """vLLM's offloading regions in /dev/shm (a crashed engine may leave one behind)."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("vllm_offload_")}
    except OSError:
        return set()


def remove_new_shm(before: set[str]) -> None:
    for name in offload_shm_files() - before:
        (Path("/dev/shm") / name).unlink(missing_ok=True)


WARMUP_TOKENS = 4
"""Tokens generated per warm-up request."""


def warmup_prompts(model: ModelSpec, lengths: list[int]) -> tuple[list[list[int]], list[int]]:
    """The warm-up's prompts (random tokens of these lengths), and the first one again, longer,
    sent after vLLM's prefix cache was reset: connectors load it (their first load)."""
    rng = random.Random("warmup")
    prompts = [[rng.randrange(FIRST_TOKEN, model.vocab) for _ in range(n)] for n in lengths]
    return prompts, prompts[0] + [FIRST_TOKEN] * 64


def warmup(llm: Any, model: ModelSpec, lengths: list[int]) -> None:
    """Compiles and warms the engine before the timed run; the connectors keep what it stored
    (``reset_prefix_cache`` leaves them be), as a pool holds earlier traffic."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0, max_tokens=WARMUP_TOKENS, ignore_eos=True, detokenize=False
    )
    prompts, again = warmup_prompts(model, lengths)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    llm.reset_prefix_cache()
    llm.generate([TokensPrompt(prompt_token_ids=again)], params, use_tqdm=False)
    llm.reset_prefix_cache()


def warmup_lengths(lengths: list[int]) -> list[int]:
    """The warm-up's prompt lengths for a workload's sorted prompt lengths: its quartile,
    median and longest."""
    return [lengths[len(lengths) // 4], lengths[len(lengths) // 2], lengths[-1]]
