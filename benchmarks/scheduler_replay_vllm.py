"""vLLM's side of the scheduler replay (``scheduler_replay.py``): the vLLM it imports (the
installed one or an unpacked wheel), its configuration, its scheduler with a connector's
scheduler half, requests and the model runner's outputs. What differs between vLLM 0.25.1 and
0.32 is handled here, by asking vLLM's own functions where both have them.

Imports vLLM only inside functions, after ``use_vllm`` has chosen which.
"""

from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 16
"""vLLM's block size on CUDA (the grid's)."""
LLAMA_LAYERS = 32
"""The grid's model (Llama-3.1-8B) has 32 layers; the replay's KV cache has one, so a block is
1/32 of the real one's bytes and the host pools are scaled by the same factor: they hold as many
blocks as the real ones."""


def use_vllm(path: Path | None) -> str:
    """Import vLLM from ``path`` (an unpacked wheel: the folder holding ``vllm/``) or, without
    one, the installed vLLM; its version. Its platform is forced to the CPU's: an unpacked CUDA
    wheel on a machine without a GPU would find none, and the replay runs no kernel."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    if path is not None:
        if not (path / "vllm" / "__init__.py").is_file():
            raise ValueError(f"--vllm-path {path}: no vllm/__init__.py under it")
        if "vllm" in sys.modules:
            raise RuntimeError("vLLM was imported before --vllm-path could choose it")
        sys.path.insert(0, str(path))
    import vllm
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    return str(vllm.__version__)


@dataclass(frozen=True, slots=True)
class EngineShape:
    """The engine the grid runs (``vllm_bench_engine.engine_kwargs`` on an H100)."""

    gpu_blocks: int
    max_num_seqs: int
    max_model_len: int
    block_tokens: int = BLOCK_TOKENS
    max_batched_tokens: int = 16384
    """vLLM's default for ``LLM`` on a GPU of 70 GiB or more."""


@dataclass(frozen=True, slots=True)
class ConnectorChoice:
    """Which connector's scheduler half runs, and its config (host bytes already scaled)."""

    kind: str
    """``none``, ``native`` (vLLM's ``OffloadingConnector``) or ``kvtier``."""
    host_bytes: int = 0
    kvtier_extra: dict[str, Any] | None = None


def _transfer_config(choice: ConnectorChoice) -> Any:
    from vllm.config import KVTransferConfig

    if choice.kind == "none":
        return None
    if choice.kind == "native":
        # What ``kv_offloading_size`` / ``kv_offloading_backend="native"`` make of the host size.
        return KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes_to_use": choice.host_bytes},
        )
    if choice.kind == "kvtier":
        return KVTransferConfig(
            kv_connector="KVTierConnector",
            kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both",
            kv_load_failure_policy="recompute",
            kv_connector_extra_config=dict(choice.kvtier_extra or {}),
        )
    raise ValueError(f"unknown connector {choice.kind!r}")


def vllm_config(shape: EngineShape, model_dir: Path, choice: ConnectorChoice) -> Any:
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    model = ModelConfig(
        model=str(model_dir),
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=shape.max_model_len,
        seed=0,
    )
    scheduler = SchedulerConfig(
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_batched_tokens,
        max_model_len=shape.max_model_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
        async_scheduling=True,
    )
    cache = CacheConfig(block_size=shape.block_tokens, enable_prefix_caching=True)
    config = VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        kv_transfer_config=_transfer_config(choice),
    )
    # The CPU platform's checks rewrite these for CPU kernels the replay never runs; the GPU's
    # engine has them as set here.
    config.cache_config.block_size = shape.block_tokens
    config.scheduler_config.max_num_batched_tokens = shape.max_batched_tokens
    config.scheduler_config.async_scheduling = True
    return config


def _kv_cache_config(config: Any, shape: EngineShape) -> Any:
    """One full-attention layer of Llama-3.1-8B's shape (8 KV heads of 128, bf16) in
    ``gpu_blocks`` blocks, through vLLM's own functions (as its engine core builds it)."""
    import torch
    from vllm.v1.core import kv_cache_utils as utils
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(
        block_size=shape.block_tokens, num_kv_heads=8, head_size=128, dtype=torch.bfloat16
    )
    specs = {"model.layers.0.self_attn.attn": spec}
    if hasattr(config.cache_config, "kv_cache_layout") and not config.cache_config.kv_cache_layout:
        # 0.32's engine core resolves a layout from its workers first; the replay has none, and
        # the scheduler does not depend on it.
        config.cache_config.kv_cache_layout = "LBNHC"
    memory = spec.page_size_bytes * shape.gpu_blocks
    try:
        configs = utils.get_kv_cache_configs(config, [specs], [memory])
    except ValueError:
        # 0.32 keeps a block back when it checks that one request of max_model_len fits (0.25.1,
        # which the grid ran, does not): one block less is still far above the longest prompt.
        config.model_config.max_model_len = (shape.gpu_blocks - 1) * shape.block_tokens
        configs = utils.get_kv_cache_configs(config, [specs], [memory])
    kv_config = utils.generate_scheduler_kv_cache_config(configs)
    config.cache_config.num_gpu_blocks = kv_config.num_blocks
    return kv_config


@dataclass(slots=True)
class Engine:
    """A scheduler and what requests need to join it."""

    scheduler: Any
    hasher: Any
    version: str

    @property
    def connector(self) -> Any:
        return getattr(self.scheduler, "connector", None)


def make_engine(shape: EngineShape, model_dir: Path, choice: ConnectorChoice) -> Engine:
    import vllm
    from vllm.v1.core import kv_cache_utils as utils
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.structured_output import StructuredOutputManager

    try:
        from vllm.utils.hashing import get_hash_fn_by_name
    except ImportError:  # older layouts
        get_hash_fn_by_name = importlib.import_module("vllm.utils").get_hash_fn_by_name

    config = vllm_config(shape, model_dir, choice)
    kv_config = _kv_cache_config(config, shape)
    block_size, hash_block_size = utils.resolve_kv_cache_block_sizes(kv_config, config)
    if hasattr(kv_config, "hash_block_size"):  # 0.32: the engine core resolves these
        kv_config.hash_block_size = hash_block_size
        resolve = getattr(utils, "resolve_cache_hit_alignment_tokens", None)
        if resolve is not None:
            align = resolve(kv_config, config, block_size, hash_block_size)
            kv_config.cache_hit_alignment_tokens = align
    scheduler = AsyncScheduler(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        hash_block_size=hash_block_size,
    )
    hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
    utils.init_none_hash(hash_fn)
    hasher = utils.get_request_block_hasher(hash_block_size, hash_fn)
    return Engine(scheduler, hasher, str(vllm.__version__))


def sampling_params(max_tokens: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)


def make_request(engine: Engine, req_id: str, tokens: list[int], params: Any, now: float) -> Any:
    from vllm.v1.request import Request

    return Request(req_id, tokens, params, None, arrival_time=now, block_hasher=engine.hasher)


def runner_output(
    req_ids: list[str], produced: set[str], finished_recving: set[str], worker_meta: Any
) -> Any:
    """The model runner's output of a step: one token for each request in ``produced``, the
    connector's report (loads ended for ``finished_recving``, the worker's metadata)."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    kv_output = None
    if worker_meta is not None or finished_recving:
        kv_output = KVConnectorOutput(
            finished_recving=finished_recving or None, kv_connector_worker_meta=worker_meta
        )
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[[1000] if r in produced else [] for r in req_ids],
        kv_connector_output=kv_output,
    )


def native_worker_meta(completed: list[int]) -> Any:
    """vLLM's ``OffloadingWorkerMetadata`` for jobs that ended (None: none ended)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
        OffloadingWorkerMetadata,
    )

    if not completed:
        return None
    meta = OffloadingWorkerMetadata()
    for job_id in completed:
        meta.mark_completed(job_id)
    return meta


def kvtier_worker_meta(completed: list[int]) -> Any:
    """kvtier's worker report: each job ended, nothing failed (None: none ended)."""
    from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata

    if not completed:
        return None
    return KVTierWorkerMetadata(dict.fromkeys(completed, 1), {})
