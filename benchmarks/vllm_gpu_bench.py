"""kvtier against vLLM's own CPU offloading, in a real vLLM on one GPU, on one request sequence.

Configurations (``--configs``, run in that order, each in a fresh engine):

* ``none``: vLLM alone (its GPU prefix cache only);
* ``native``: vLLM's own offloading (``kv_offloading_size`` = ``--host-gib``, backend ``native``);
* ``kvtier``: kvtier with a host pool of the same ``--host-gib``;
* ``kvtier_fs``: that pool plus an fs tier in ``--workdir``/fs.

Model: Llama-3.1-8B's architecture (``--model llama8b``; ``config.json`` only, vLLM's dummy
weights, bfloat16, CUDA graphs on, vLLM's default attention backend, prefix caching on) or a
tiny Llama for a CPU smoke run (``--model tiny``). Token-id prompts, no tokenizer.

Workload: the demo's multi-turn conversations from the bundled trace (``kvtier.demo``: each
turn re-sends the previous prompt and answer, then a new question), each demo token widened to
``--widen`` tokens (4: a 512-token trace block becomes 128 tokens) so prompts are 1k-8k tokens.
``--concurrency`` conversations are in flight: a conversation's next turn is sent only when its
previous turn finished, and a finished conversation's place goes to the next one. Every request
generates ``--max-tokens`` tokens (greedy, EOS ignored). vLLM's GPU KV cache holds the
concurrent requests and little more (``--gpu-kv-gib``, default: ``concurrency`` longest prompts
with their outputs), so a conversation is evicted from it between its turns.

Measured on the host per request: TTFT (``add_request`` to the step that returns its first
token), cached prompt tokens (``num_cached_tokens``: vLLM's GPU prefix cache plus connector
loads). Per configuration: TTFT p50/p90/p99, mean TTFT of requests with and without cached
tokens, output tokens/s over the timed run, prompt tokens cached vs computed, host memory (the
machine's MemTotal - MemAvailable before the engine started and at the end of the run, the
process's peak RSS), engine start time, and the scheduler-side time the connector adds per
engine step (every scheduler-side connector call timed in this process, summed per step,
p50/p99 over the timed steps). Results are merged into ``--json`` per configuration as each
finishes, so the configurations can run in separate invocations; ``--report-only`` prints the
table from that file.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.demo import FIRST_TOKEN, MODELS, ModelSize, Workload, build_workload, write_model

CONFIGS = ("none", "native", "kvtier", "kvtier_fs")
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
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "take_events",
    "get_kv_connector_stats",
)


@dataclass(slots=True)
class ModelSpec:
    name: str
    path: Path
    vocab: int
    kv_bytes_per_token: int
    gpu: bool


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
    size: ModelSize = MODELS["tiny"]
    write_model(path, size)
    per_token = size.num_hidden_layers * 2 * size.num_key_value_heads * size.head_dim * 4
    return ModelSpec("tiny Llama, float32 (CPU smoke run)", path, size.vocab_size, per_token, False)


def widen(tokens: tuple[int, ...], factor: int, vocab: int) -> list[int]:
    """Each token becomes ``factor`` tokens derived from it: equal prefixes stay equal."""
    span = vocab - FIRST_TOKEN
    out: list[int] = []
    for t in tokens:
        out.extend(FIRST_TOKEN + (t * 7919 + k * 104729) % span for k in range(factor))
    return out


Conversation = deque[list[int]]
"""A conversation's turns not sent yet, each a prompt."""


def conversations(workload: Workload, factor: int, vocab: int) -> list[Conversation]:
    """The workload's turns grouped by conversation, conversations in the order they start."""
    by_session: dict[int, Conversation] = {}
    for turn in workload.turns:
        by_session.setdefault(turn.session, deque()).append(widen(turn.tokens, factor, vocab))
    return list(by_session.values())


# -- connector timing ---------------------------------------------------------------------------


class HookTimer:
    """Wraps the scheduler-side connector's methods; a step ends with ``build_connector_meta``."""

    def __init__(self, connector: Any) -> None:
        self.steps: list[float] = []
        self._current = 0.0
        self.enabled = False
        for name in SCHEDULER_HOOKS:
            method = getattr(connector, name, None)
            if method is not None:
                setattr(connector, name, self._wrap(name, method))

    def _wrap(self, name: str, method: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._current += time.perf_counter() - started
                if name == "build_connector_meta":
                    if self.enabled:
                        self.steps.append(self._current)
                    self._current = 0.0

        return timed


# -- one configuration --------------------------------------------------------------------------


@dataclass(slots=True)
class Timed:
    ttft: float
    prompt: int
    cached: int
    output: list[int] = field(default_factory=list)


def meminfo_used() -> int:
    values: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        values[key] = int(rest.split()[0]) * 1024
    return values["MemTotal"] - values["MemAvailable"]


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def kvtier_extra(config: str, args: argparse.Namespace, stats_path: Path) -> dict[str, Any]:
    tiers = []
    if config == "kvtier_fs":
        fs = Path(args.workdir) / "fs"
        fs.mkdir(parents=True, exist_ok=True)
        tiers.append({"kind": "fs", "path": str(fs), "capacity": f"{args.fs_gib}GiB"})
    return {
        "pool": {"size": f"{args.host_gib}GiB"},
        "tiers": tiers,
        "vllm": {"stats_path": str(stats_path)},
    }


def engine_kwargs(
    config: str, args: argparse.Namespace, model: ModelSpec, kv_bytes: int
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": str(model.path),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16" if model.gpu else "float32",
        "kv_cache_memory_bytes": kv_bytes,
        "max_model_len": args.max_model_len,
        "max_num_seqs": max(args.concurrency, 8),
        "enable_prefix_caching": True,
        "enforce_eager": not model.gpu,
        "seed": 0,
    }
    if not model.gpu:
        kwargs["block_size"] = 32
    if config == "native":
        kwargs["kv_offloading_size"] = args.host_gib
        kwargs["kv_offloading_backend"] = "native"
    elif config.startswith("kvtier"):
        stats = Path(args.workdir) / f"stats-{config}.json"
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": kvtier_extra(config, args, stats),
        }
    return kwargs


def connector_of(llm: Any) -> Any:
    core = llm.llm_engine.engine_core.engine_core
    return getattr(core.scheduler, "connector", None)


def kvtier_counters(connector: Any) -> dict[str, Any]:
    # The cumulative snapshot (get_kv_connector_stats hands vLLM per-step increments).
    data = connector.stats_snapshot() if connector is not None else None
    return dict(data) if isinstance(data, dict) else {}


def drive(
    llm: Any, convs: list[Conversation], args: argparse.Namespace, label: str
) -> tuple[list[Timed], float]:
    """Keep ``concurrency`` conversations in flight; returns the timed requests and wall time."""
    from tqdm import tqdm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(
        temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, detokenize=False
    )
    pending = deque(convs)
    active: dict[str, tuple[Conversation, float, int]] = {}
    first_token: dict[str, float] = {}
    done: list[Timed] = []
    total = sum(len(c) for c in convs)
    counter = 0

    def submit(conv: Conversation) -> None:
        nonlocal counter
        tokens = conv.popleft()
        req_id = f"{label}-{counter}"
        counter += 1
        active[req_id] = (conv, time.perf_counter(), len(tokens))
        engine.add_request(req_id, TokensPrompt(prompt_token_ids=tokens), params)

    started = time.perf_counter()
    while pending and len(active) < args.concurrency:
        submit(pending.popleft())
    with tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False) as bar:
        while active:
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                req_id = out.request_id
                if req_id not in active:
                    continue
                if req_id not in first_token and out.outputs and out.outputs[0].token_ids:
                    first_token[req_id] = now
                if not out.finished:
                    continue
                conv, sent, prompt = active.pop(req_id)
                done.append(
                    Timed(
                        first_token.get(req_id, now) - sent,
                        prompt,
                        int(out.num_cached_tokens or 0),
                        list(out.outputs[0].token_ids),
                    )
                )
                bar.update(1)
                if conv:
                    submit(conv)
                elif pending:
                    submit(pending.popleft())
    return done, time.perf_counter() - started


def warmup(llm: Any, model: ModelSpec, lengths: list[int]) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    rng = random.Random("warmup")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False)
    prompts = [[rng.randrange(FIRST_TOKEN, model.vocab) for _ in range(n)] for n in lengths]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    # The first prompt again, longer, after a reset: connectors load it (their first load).
    llm.reset_prefix_cache()
    again = prompts[0] + [FIRST_TOKEN] * 64
    llm.generate([TokensPrompt(prompt_token_ids=again)], params, use_tqdm=False)
    llm.reset_prefix_cache()


def output_digest(tokens: list[int]) -> str:
    """A request's output tokens, short enough to keep per request in the JSON."""
    import hashlib

    return hashlib.blake2b(repr(tokens).encode(), digest_size=6).hexdigest()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def run_config(
    config: str, args: argparse.Namespace, model: ModelSpec, workload: Workload, kv_bytes: int
) -> dict[str, Any]:
    from vllm import LLM

    convs = conversations(workload, args.widen, model.vocab)
    used_before = meminfo_used()
    started = time.perf_counter()
    llm = LLM(**engine_kwargs(config, args, model, kv_bytes))
    start_s = time.perf_counter() - started
    try:
        lengths = sorted(len(t) for c in convs for t in c)
        warmup(llm, model, [lengths[len(lengths) // 4], lengths[len(lengths) // 2], lengths[-1]])
        connector = connector_of(llm)
        timer = HookTimer(connector) if connector is not None else None
        before = kvtier_counters(connector) if config.startswith("kvtier") else {}
        if timer is not None:
            timer.enabled = True
        timed, wall = drive(llm, convs, args, config)
        if timer is not None:
            timer.enabled = False
        after = kvtier_counters(connector) if config.startswith("kvtier") else {}
        used_after = meminfo_used()
    finally:
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()
        del llm
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:
            pass
    ttft = [t.ttft * 1e3 for t in timed]
    hits = [t.ttft * 1e3 for t in timed if t.cached]
    misses = [t.ttft * 1e3 for t in timed if not t.cached]
    prompt_tokens = sum(t.prompt for t in timed)
    cached = sum(t.cached for t in timed)
    out_tokens = sum(len(t.output) for t in timed)
    step_us = [s * 1e6 for s in (timer.steps if timer is not None else [])]
    row: dict[str, Any] = {
        "requests": len(timed),
        "ttft_ms": {str(q): round(percentile(ttft, q), 2) for q in (50, 90, 99)},
        "ttft_mean_ms_with_cached_tokens": round(statistics.fmean(hits), 2) if hits else None,
        "ttft_mean_ms_without": round(statistics.fmean(misses), 2) if misses else None,
        "requests_with_cached_tokens": len(hits),
        "output_tokens_per_s": round(out_tokens / wall, 1),
        "wall_s": round(wall, 2),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_cached": cached,
        "prompt_tokens_computed": prompt_tokens - cached,
        "host_used_gib_delta": round((used_after - used_before) / (1 << 30), 2),
        "peak_rss_gib": round(peak_rss() / (1 << 30), 2),
        "engine_start_s": round(start_s, 1),
        "connector_step_us": {
            "p50": round(percentile(step_us, 50), 1),
            "p99": round(percentile(step_us, 99), 1),
            "steps": len(step_us),
        }
        if step_us
        else None,
        "output_digests": [output_digest(t.output) for t in timed],
    }
    if config.startswith("kvtier"):
        conn_before, conn_after = before.get("connector", {}), after.get("connector", {})
        row["kvtier_hit_tokens"] = conn_after.get("hit_tokens", 0) - conn_before.get(
            "hit_tokens", 0
        )
        row["kvtier_load_blocks_failed"] = conn_after.get(
            "load_blocks_failed", 0
        ) - conn_before.get("load_blocks_failed", 0)
        row["kvtier_stats"] = after
    return row


# -- report -------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }
    try:
        import torch
        import vllm

        info["vllm"] = vllm.__version__
        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def report(data: dict[str, Any]) -> None:
    rows = data.get("configs", {})
    print(f"model     {data.get('model')}")
    print(f"workload  {data.get('workload')}")
    print(f"machine   {data.get('machine')}")
    head = (
        f"{'config':<10} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'hit mean':>9} {'miss mean':>9} "
        f"{'out tok/s':>10} {'cached':>9} {'computed':>9} {'host GiB':>8} {'step us p50/p99':>16}"
    )
    print(head)
    for name in CONFIGS:
        row = rows.get(name)
        if row is None:
            continue
        if "error" in row:
            print(f"{name:<10} failed: {row['error'][:100]}")
            continue
        t = row["ttft_ms"]
        step = row.get("connector_step_us")
        steps = f"{step['p50']:.0f}/{step['p99']:.0f}" if step else "-"
        print(
            f"{name:<10} {t['50']:>9.1f} {t['90']:>8.1f} {t['99']:>8.1f} "
            f"{row['ttft_mean_ms_with_cached_tokens'] or 0:>9.1f} "
            f"{row['ttft_mean_ms_without'] or 0:>9.1f} {row['output_tokens_per_s']:>10.1f} "
            f"{row['prompt_tokens_cached']:>9} {row['prompt_tokens_computed']:>9} "
            f"{row['host_used_gib_delta']:>8.2f} {steps:>16}"
        )
    base = rows.get("none", {}).get("output_digests")
    for name in CONFIGS:
        row = rows.get(name)
        if base and row and "output_digests" in row and name != "none":
            same = sum(a == b for a, b in zip(base, row["output_digests"], strict=False))
            print(f"outputs   {name}: {same} of {len(base)} requests as without offloading")
    native, kv, kvfs = rows.get("native"), rows.get("kvtier"), rows.get("kvtier_fs")
    if native and kv and "error" not in native and "error" not in kv:
        print("check     kvtier vs native (within 3% = tie):")
        for label, ours, theirs, higher in (
            ("output tok/s", kv["output_tokens_per_s"], native["output_tokens_per_s"], True),
            ("TTFT p50", kv["ttft_ms"]["50"], native["ttft_ms"]["50"], False),
            ("TTFT p90", kv["ttft_ms"]["90"], native["ttft_ms"]["90"], False),
        ):
            ratio = ours / theirs if theirs else float("nan")
            better = ratio >= 1 if higher else ratio <= 1
            verdict = "better" if better else ("tie" if abs(ratio - 1) <= 0.03 else "worse")
            print(f"          {label:<13} {ours:10.1f} vs {theirs:10.1f}  ({ratio:.3f}x) {verdict}")
    if native and kvfs and "error" not in native and "error" not in kvfs:
        p90 = kvfs["ttft_ms"]["90"] < native["ttft_ms"]["90"]
        computed = kvfs["prompt_tokens_computed"] < native["prompt_tokens_computed"]
        print(
            f"check     kvtier_fs vs native: TTFT p90 {kvfs['ttft_ms']['90']:.1f} vs "
            f"{native['ttft_ms']['90']:.1f} ({'better' if p90 else 'not better'}), computed "
            f"{kvfs['prompt_tokens_computed']} vs {native['prompt_tokens_computed']} "
            f"({'fewer' if computed else 'not fewer'})"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--model", choices=["llama8b", "tiny"], default="llama8b")
    parser.add_argument("--host-gib", type=float, default=8.0)
    parser.add_argument("--fs-gib", type=float, default=200.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=160)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--context-blocks", type=int, default=40)
    parser.add_argument("--widen", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=16384)
    parser.add_argument("--gpu-kv-gib", type=float, default=None)
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "kvtier-gpu-bench"))
    parser.add_argument("--json", default="docs/results/vllm_gpu_bench.json")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    out = Path(args.json)
    data: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {}
    if args.report_only:
        report(data)
        return 0
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    model = make_model(args.model, workdir)
    workload = build_workload(
        args.requests, args.concurrency, args.turns, args.context_blocks, vocab=model.vocab
    )
    lengths = sorted(len(t.tokens) * args.widen for t in workload.turns)
    longest = lengths[-1] + args.max_tokens
    if longest > args.max_model_len:
        parser.error(f"the longest request needs {longest} tokens > --max-model-len")
    kv_bytes = int(
        args.gpu_kv_gib * (1 << 30)
        if args.gpu_kv_gib
        else args.concurrency * longest * model.kv_bytes_per_token
    )
    data["model"] = model.name
    data["workload"] = {
        "requests": len(workload.turns),
        "conversations": workload.sessions,
        "concurrency": args.concurrency,
        "prompt_tokens": sum(lengths),
        "prompt_tokens_p50": lengths[len(lengths) // 2],
        "prompt_tokens_max": lengths[-1],
        "max_tokens": args.max_tokens,
        "gpu_kv_gib": round(kv_bytes / (1 << 30), 2),
        "host_gib": args.host_gib,
    }
    data["machine"] = machine()
    data.setdefault("configs", {})
    print(f"workload  {data['workload']}", file=sys.stderr)
    for config in configs:
        if config.startswith("kvtier") and (workdir / "fs").exists():
            shutil.rmtree(workdir / "fs")
        try:
            row = run_config(config, args, model, workload, kv_bytes)
        except Exception as exc:  # one failing configuration must not lose the others
            traceback.print_exc()
            row = {"error": f"{type(exc).__name__}: {exc}"}
            # An engine that failed to start leaves its worker's connector registered in this
            # process, and the next engine would reuse it.
            from vllm.distributed.kv_transfer.kv_transfer_state import (
                ensure_kv_transfer_shutdown,
            )

            ensure_kv_transfer_shutdown()
        data["configs"][config] = row
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1))
    report(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
