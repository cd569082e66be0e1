"""Helpers for end-to-end tests that run a real vLLM engine (CPU build).

Importable module, no tests in it. It builds a ``vllm.LLM`` around a tiny
Llama-architecture model that is created locally, so nothing is downloaded:

* :func:`write_tiny_llama` writes ``config.json`` (``LlamaForCausalLM``, small
  hidden size, 2 layers, small vocab, no tokenizer) and, unless asked not to,
  a ``model.safetensors`` with seeded random weights.
* :func:`build_llm` starts the engine with token-id prompts only
  (``skip_tokenizer_init=True``), a small KV cache, a block size that the CPU
  attention kernel accepts (multiple of 32), eager mode, and optionally a
  ``kv_transfer_config`` that loads an out-of-tree connector through
  ``kv_connector_module_path``.
* :func:`generate_ids` runs greedy generation and returns token ids.

Determinism across processes: vLLM's ``load_format="dummy"`` fills *every*
parameter with ``uniform(-1e-3, 1e-3)`` from a generator seeded with the fixed
value 1234 (vllm/model_executor/model_loader/weight_utils.py), so dummy
weights are identical in every process, whatever ``seed`` is. They are also so
small that the output barely depends on anything but the last token, which
makes them a poor detector of wrong KV. The default here is therefore a real
checkpoint with the demo's N(0, 1/fan_in) weights (``kvtier.demo.llama_weights``)
from a ``torch.Generator`` seeded by ``weights_seed``: bit-identical across
processes and sensitive to the KV contents. Use ``weights="dummy"`` for the vLLM-native variant.

Environment: vLLM reads several variables when the engine starts. Call
:func:`prepare_env` (``build_llm`` does) before building an engine; it sets
``HF_HUB_OFFLINE=1`` / ``TRANSFORMERS_OFFLINE=1`` and, when asked,
``VLLM_ENABLE_V1_MULTIPROCESSING`` (``False`` = engine core in this process,
~10 s start; ``True`` = vLLM's default separate engine-core process, slower).

Tensor parallelism: ``build_llm(..., tensor_parallel_size=2)`` runs each rank
in its own worker process (vLLM's multiprocessing executor, also with the
engine core in this process). The CPU build binds each rank's OpenMP threads
to CPUs; its automatic binding wants one NUMA node per rank, so ``build_llm``
hands each rank its own share of this process's CPUs
(:func:`cpu_threads_bind`) unless ``VLLM_CPU_OMP_THREADS_BIND`` is set. The
``kvtier_*`` functions at the end run inside the workers through
``llm.collective_rpc``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.demo import ModelSize, llama_weights

if TYPE_CHECKING:  # vllm is heavy; import it lazily so this module is cheap.
    from vllm import LLM

# A tiny Llama. head_dim must be one the CPU attention kernel supports
# (32, 64, 80, ...; 16 fails with "Unsupported CPU attention configuration").
TINY_LLAMA = ModelSize(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=512,
)
TINY_LLAMA_CONFIG: dict[str, Any] = {**TINY_LLAMA.config(), "max_position_embeddings": 4096}
# On a GPU: head_dim 64, one FlashAttention 3 (vLLM's default on Hopper) compiles kernels for.
GPU_LLAMA = ModelSize(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=512,
)
GPU_CUDA_GRAPH_SIZES = [1, 2, 4, 8]
"""Batch sizes vLLM captures CUDA graphs for in the GPU tests (fewer than its default: faster
starts, same code path)."""

# vLLM's CPU attention backend only supports multiples of 32 as block size.
DEFAULT_BLOCK_SIZE = 32
DEFAULT_KV_CACHE_BYTES = 32 << 20


def prepare_env(
    multiprocessing: bool | None = None, extra: Mapping[str, str] | None = None
) -> None:
    """Set the environment variables vLLM needs to run offline on CPU.

    Must run before the engine is built (vLLM reads most of them at engine
    start, some at import). ``multiprocessing`` sets
    ``VLLM_ENABLE_V1_MULTIPROCESSING`` when not None; ``extra`` is applied
    last and overrides.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    if multiprocessing is not None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocessing else "0"
    for key, value in (extra or {}).items():
        os.environ[key] = value


@contextlib.contextmanager
def scoped_env(values: Mapping[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore them."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def cpu_threads_bind(ranks: int) -> str:
    """A ``VLLM_CPU_OMP_THREADS_BIND`` value giving each of ``ranks`` workers its
    own CPUs out of this process's affinity set (``"0|1"`` on two CPUs); ranks
    share CPUs when there are fewer CPUs than ranks."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // ranks)
    lists = []
    for rank in range(ranks):
        mine = cpus[rank * per : (rank + 1) * per] or [cpus[rank % len(cpus)]]
        lists.append(",".join(str(c) for c in mine))
    return "|".join(lists)


def write_tiny_llama(
    model_dir: str | os.PathLike[str],
    *,
    weights: str = "random",
    weights_seed: int = 0,
    size: ModelSize = TINY_LLAMA,
) -> Path:
    """Write a tiny ``LlamaForCausalLM`` model directory and return its path.

    ``weights="random"`` also writes ``model.safetensors`` with weights drawn
    from a CPU ``torch.Generator`` seeded with ``weights_seed`` (identical in
    every process: ``kvtier.demo.llama_weights``); ``weights="dummy"`` writes
    only ``config.json`` and the engine must use ``load_format="dummy"``
    (``build_llm`` picks that itself). No tokenizer files are written: use
    token-id prompts.
    """
    if weights not in ("random", "dummy"):
        raise ValueError(f"weights must be 'random' or 'dummy', not {weights!r}")
    path = Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    config = {**size.config(), "max_position_embeddings": 4096}
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    weights_file = path / "model.safetensors"
    if weights == "random":
        from safetensors.torch import save_file

        save_file(llama_weights(size, weights_seed), str(weights_file), metadata={"format": "pt"})
    elif weights_file.exists():
        weights_file.unlink()
    return path


def make_kv_transfer_config(
    connector: str,
    module_path: str | None = None,
    *,
    extra_config: Mapping[str, Any] | None = None,
    kv_role: str = "kv_both",
    **fields: Any,
) -> dict[str, Any]:
    """Build the dict that ``LLM(kv_transfer_config=...)`` accepts.

    ``connector`` is the class name looked up in ``module_path`` (an
    importable module name, not a file path: it is imported with
    ``importlib.import_module`` in the front-end process, the engine-core
    process and each worker). The same dict, JSON-encoded, is what
    ``vllm serve --kv-transfer-config`` takes. ``fields`` are further
    ``KVTransferConfig`` fields (e.g. ``kv_load_failure_policy``).
    """
    cfg: dict[str, Any] = {"kv_connector": connector, "kv_role": kv_role}
    if module_path is not None:
        cfg["kv_connector_module_path"] = module_path
    if extra_config:
        cfg["kv_connector_extra_config"] = dict(extra_config)
    cfg.update(fields)
    return cfg


def build_llm(
    model_dir: str | os.PathLike[str] | None = None,
    *,
    kv_transfer_config: Mapping[str, Any] | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES,
    max_model_len: int = 2048,
    max_num_seqs: int = 8,
    seed: int = 0,
    load_format: str | None = None,
    enable_prefix_caching: bool = True,
    enforce_eager: bool = True,
    multiprocessing: bool | None = None,
    env: Mapping[str, str] | None = None,
    gpu: bool = False,
    **llm_kwargs: Any,
) -> LLM:
    """Start a ``vllm.LLM`` for a tiny local Llama (see module docstring).

    ``model_dir`` defaults to a fresh temporary directory with a
    :func:`write_tiny_llama` model. ``load_format`` defaults to ``"dummy"``
    when the directory holds no ``*.safetensors`` and to vLLM's ``"auto"``
    otherwise. ``kv_cache_memory_bytes`` bounds the paged KV cache (the CPU
    build's legacy ``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB and would
    override it, so it is removed from the environment here). ``block_size``
    must be a multiple of 32 on CPU. Remaining keyword arguments go to
    ``vllm.LLM``. With ``tensor_parallel_size`` > 1 and no
    ``VLLM_CPU_OMP_THREADS_BIND`` in the environment, the workers are bound
    with :func:`cpu_threads_bind` while the engine starts (the variable is not
    left set: a later single-rank engine would reject a multi-rank binding).

    ``gpu=True``: a CUDA engine as users run it: bfloat16, CUDA graphs on (captured for
    ``GPU_CUDA_GRAPH_SIZES``), vLLM's default attention backend.
    """
    if block_size % 32 and not gpu:
        raise ValueError("vLLM's CPU attention needs block_size % 32 == 0")
    prepare_env(multiprocessing=multiprocessing, extra=env)
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    if model_dir is None:
        import tempfile

        model_dir = write_tiny_llama(tempfile.mkdtemp(prefix="kvtier-tinyllama-"))
    model_path = Path(model_dir)
    if load_format is None:
        has_weights = any(model_path.glob("*.safetensors"))
        load_format = "auto" if has_weights else "dummy"

    from vllm import LLM

    _forget_cached_env()
    if gpu:
        allow_cuda_graph_capture()
    kwargs: dict[str, Any] = {
        "model": str(model_path),
        "load_format": load_format,
        "skip_tokenizer_init": True,
        "dtype": "bfloat16" if gpu else "float32",
        "block_size": block_size,
        "kv_cache_memory_bytes": kv_cache_memory_bytes,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "seed": seed,
        "enforce_eager": enforce_eager and not gpu,
        "enable_prefix_caching": enable_prefix_caching,
    }
    if gpu:
        kwargs["compilation_config"] = {"cudagraph_capture_sizes": GPU_CUDA_GRAPH_SIZES}
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = dict(kv_transfer_config)
    kwargs.update(llm_kwargs)
    ranks = int(kwargs.get("tensor_parallel_size") or 1)
    bind: dict[str, str] = {}
    if ranks > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        bind["VLLM_CPU_OMP_THREADS_BIND"] = cpu_threads_bind(ranks)
    with scoped_env(bind):
        return LLM(**kwargs)


def _forget_cached_env() -> None:
    """vLLM caches its environment variables once an engine started (``enable_envs_cache``);
    a later engine in this process must see the variables as they are now."""
    import vllm.envs

    clear = getattr(getattr(vllm.envs, "__getattr__", None), "cache_clear", None)
    if clear is not None:
        clear()


def allow_cuda_graph_capture() -> None:
    """vLLM 0.25.1's first model runner turns the process-wide CUDA graph capture flag off after
    its capture and the second (Gemma-3 and other models it runs) never turns it on: an engine on
    the second runner after one on the first fails its start in this process ("CUDA graph
    capturing detected at an inappropriate time"). Each engine starts as in a fresh process."""
    import vllm.compilation.monitor as monitor

    if hasattr(monitor, "cudagraph_capturing_enabled"):
        monitor.cudagraph_capturing_enabled = True


def greedy_params(max_tokens: int = 8, **kwargs: Any) -> Any:
    """Greedy ``SamplingParams`` that never stop early on an EOS token."""
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        detokenize=False,
        **kwargs,
    )


def generate_ids(
    llm: LLM,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int = 8,
    sampling_params: Any = None,
    use_tqdm: bool = False,
) -> list[list[int]]:
    """Greedy-generate from token-id prompts; returns the new token ids."""
    from vllm.inputs import TokensPrompt

    params = sampling_params if sampling_params is not None else greedy_params(max_tokens)
    inputs = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts]
    outputs = llm.generate(inputs, params, use_tqdm=use_tqdm)
    return [list(o.outputs[0].token_ids) for o in outputs]


def prompt_tokens(
    n: int, *, start: int = 3, vocab_size: int | None = None, seed: int | None = None
) -> list[int]:
    """``n`` token ids inside the tiny vocab (ids 0..2 left out: pad/bos/eos).

    Without ``seed`` a deterministic ramp; with it, seeded pseudo-random ids.
    """
    vocab = int(vocab_size or TINY_LLAMA_CONFIG["vocab_size"])
    span = vocab - 3
    if seed is None:
        return [3 + (start - 3 + i) % span for i in range(n)]
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def reset_prefix_cache(llm: LLM, *, reset_connector: bool = False) -> bool:
    """Drop vLLM's own (device-tier) prefix cache between rounds.

    Returns vLLM's result (False when blocks are still in use). With
    ``reset_connector=True`` vLLM also calls the connector's ``reset_cache()``.
    """
    return bool(llm.reset_prefix_cache(reset_connector=reset_connector))


def shutdown_llm(llm: LLM) -> None:
    """Shut the engine down now (connectors get ``shutdown()``), then GC it.

    Needed before building a second engine in the same process: the worker-
    side connector lives in a module global that is only cleared on worker
    shutdown.
    """
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None:
        core.shutdown()
    del llm, engine, core
    gc.collect()


def run_in_fresh_process(
    func_path: str, *args: Any, timeout: float = 600, env: Mapping[str, str] | None = None
) -> Any:
    """Run ``module:function(*args)`` in a new Python process; return its result.

    For cross-process checks (warm restart, determinism). The function must
    be importable by the child (its module on ``sys.path``/``PYTHONPATH``),
    take JSON-serialisable arguments and return a JSON-serialisable value.
    """
    return finish_fresh_process(start_fresh_process(func_path, *args, env=env), timeout)


_RESULT = "@@RESULT@@"


def start_fresh_process(
    func_path: str, *args: Any, env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """``run_in_fresh_process`` without waiting: the child runs beside this process (two engines
    at once); ``finish_fresh_process`` collects its result."""
    module, _, name = func_path.partition(":")
    if not module or not name:
        raise ValueError("func_path must look like 'package.module:function'")
    code = (
        "import json, sys, importlib\n"
        "mod = importlib.import_module(sys.argv[1])\n"
        "res = getattr(mod, sys.argv[2])(*json.loads(sys.argv[3]))\n"
        f"sys.stdout.write('\\n{_RESULT}' + json.dumps(res) + '\\n')\n"
    )
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = os.pathsep.join(
        p for p in [*sys.path, child_env.get("PYTHONPATH", "")] if p
    )
    child_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-c", code, module, name, json.dumps(list(args))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env,
    )


def finish_fresh_process(proc: subprocess.Popen[str], timeout: float = 600) -> Any:
    """The result of a ``start_fresh_process`` child, once it exited (killed after ``timeout``
    seconds); ``RuntimeError`` with its output's tail when it failed."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    if proc.returncode != 0 or _RESULT not in stdout:
        tail = (stdout[-3000:] + "\n" + stderr[-3000:]).strip()
        raise RuntimeError(f"{proc.args[3:5]} failed (exit {proc.returncode}):\n{tail}")
    return json.loads(stdout.rsplit(_RESULT, 1)[1].strip().splitlines()[0])


def first_divergence(a: Iterable[int], b: Iterable[int]) -> int | None:
    """Index of the first differing token, or None when equal."""
    la, lb = list(a), list(b)
    for i, (x, y) in enumerate(zip(la, lb, strict=False)):
        if x != y:
            return i
    return None if len(la) == len(lb) else min(len(la), len(lb))


# -- Inside vLLM's worker processes ---------------------------------------------------------------
# Pass these to ``llm.collective_rpc(func, args=...)``: vLLM calls ``func(worker, *args)`` in every
# worker. They live in this importable module so cloudpickle sends them by reference.


def _kvtier_worker_side(worker: Any) -> Any:
    """This worker's kvtier ``WorkerSide`` (the worker half of ``KVTierConnector``)."""
    del worker  # the connector is a per-process global, not a worker attribute
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = getattr(get_kv_transfer_group(), "_worker", None)
    if side is None:
        raise RuntimeError("this worker's KV connector is not kvtier's")
    return side


def kvtier_worker_rank(worker: Any) -> int:
    """The tensor-parallel rank this worker's kvtier connector copies for."""
    return int(_kvtier_worker_side(worker).tp_rank)


def kvtier_fail_loads_on_rank(worker: Any, rank: int, rate: float) -> float | None:
    """On TP rank ``rank`` only, fail ``rate`` of kvtier's load orders from now on.

    The same fault hook as ``KVTIER_TEST_FAIL_LOADS``, which every worker reads
    from its (identical, inherited) environment when the connector starts, so it
    cannot single out one rank. Returns the rate set, or None on other ranks.
    """
    side = _kvtier_worker_side(worker)
    if side.tp_rank != rank:
        return None
    side._fault_rate = float(rate)
    return float(side._fault_rate)
