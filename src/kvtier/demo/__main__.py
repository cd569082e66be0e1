"""Run the vLLM + kvtier demo: ``python -m kvtier.demo [options]`` (``--help`` lists them)."""

from __future__ import annotations

import argparse
import gc
import json
import random
import shutil
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.demo import (
    BLOCK_TOKENS,
    FIRST_TOKEN,
    MODELS,
    ModelSize,
    Shares,
    Workload,
    build_workload,
    engine_blocks_for,
    kvtier_config,
    predict_shares,
    prepare_env,
    unbounded_engine_blocks,
    write_model,
)
from kvtier.policies import DEFAULT_EVICTION
from kvtier.stats_report import read_snapshot

BASELINE = "without kvtier"
KVTIER = "with kvtier"
IDEAL = "vLLM cache for all"
BASELINE_AGAIN = "without kvtier, again"


@dataclass(slots=True)
class Request:
    """One timed request of one run."""

    seconds: float
    output: list[int]
    engine_cached: int
    """Prompt tokens vLLM did not compute: its own prefix cache plus kvtier's loads."""
    kvtier_tokens: int | None = None
    """Prompt tokens loaded from kvtier (None without kvtier or without its counters)."""
    pool_blocks: int | None = None
    """kvtier blocks hit in the host pool / promoted from the fs tier for this request."""
    fs_blocks: int | None = None


@dataclass(slots=True)
class Run:
    label: str
    requests: list[Request] = field(default_factory=list)
    kvtier: dict[str, Any] | None = None
    """kvtier's counters for the timed requests: settled at the end minus settled after the
    warm-up (the whole run, warm-up included, when they cannot be read in-process)."""
    start_s: float = 0.0
    warmup_s: float = 0.0

    @property
    def seconds(self) -> list[float]:
        return [r.seconds for r in self.requests]

    @property
    def total(self) -> float:
        return sum(self.seconds)


def warmup_prompts(workload: Workload, vocab: int) -> list[list[int]]:
    """Unrelated prompts at the workload's length quartiles, then the first one again with a few
    more tokens once the others pushed it out of vLLM's cache: in the kvtier run that last one
    also exercises the load path, so no run pays a first-time cost inside the timed part."""
    lengths = sorted(len(t.tokens) for t in workload.turns)
    picks = [lengths[min(len(lengths) - 1, q * len(lengths) // 4)] for q in (1, 2, 3, 4)]
    rng = random.Random("warmup")
    prompts = [[rng.randrange(FIRST_TOKEN, vocab) for _ in range(n)] for n in picks]
    again = prompts[0] + [rng.randrange(FIRST_TOKEN, vocab) for _ in range(BLOCK_TOKENS)]
    prompts.append(again[-workload.max_prompt_tokens :])
    return prompts


def connector_stats(llm: Any) -> dict[str, Any] | None:
    """kvtier's counters, read from the scheduler-side connector in this process (the demo runs
    vLLM's engine core in-process); None when vLLM's internals are laid out differently."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    scheduler = getattr(getattr(core, "engine_core", None), "scheduler", None)
    connector = getattr(scheduler, "connector", None)
    if connector is None:
        return None
    snapshot = getattr(connector, "stats_snapshot", None)
    data = snapshot() if snapshot is not None else None
    return dict(data) if isinstance(data, dict) and data else None


def _counter(stats: dict[str, Any] | None, *path: str) -> int:
    node: Any = stats or {}
    for key in path:
        node = node.get(key, {}) if isinstance(node, dict) else {}
    return int(node) if isinstance(node, int | float) else 0


COUNTER_SECTIONS = ("cache", "tiers", "promoted", "connector")
"""Sections of kvtier's stats that hold counters; the top-level numbers (pool_used, ...) are
gauges and stay as they are."""


def delta(after: dict[str, Any], before: dict[str, Any] | None) -> dict[str, Any]:
    """The counters of ``after`` minus those of ``before``, recursively; gauges from ``after``."""
    out: dict[str, Any] = dict(after)
    for section in COUNTER_SECTIONS:
        if isinstance(after.get(section), dict):
            old = (before or {}).get(section)
            out[section] = _subtract(after[section], old if isinstance(old, dict) else {})
    return out


def _subtract(after: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in after.items():
        old = before.get(key)
        if isinstance(value, dict):
            out[key] = _subtract(value, old if isinstance(old, dict) else {})
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = value - (old if isinstance(old, int | float) else 0)
        else:
            out[key] = value
    return out


def settle(llm: Any, params: Any) -> dict[str, Any] | None:
    """Let kvtier finish what earlier requests started (copies, fs writes, promotions), then
    return its counters. Untimed, after the warm-up and at the end.

    Engine steps collect finished jobs, so this sends one-token prompts (nothing to look up or
    store) until every stored block was written through to the fs tier, every promotion ended
    and the counters stopped changing (at most about 5 s).
    """
    from vllm.inputs import TokensPrompt

    previous = connector_stats(llm)
    if previous is None:
        return None
    for _ in range(200):
        llm.generate([TokensPrompt(prompt_token_ids=[FIRST_TOKEN])], params, use_tqdm=False)
        time.sleep(0.02)
        current = connector_stats(llm)
        if current is None:
            return previous
        if _idle(current) and _counters(current) == _counters(previous):
            return current
        previous = current
    return previous


def _idle(stats: dict[str, Any]) -> bool:
    c = stats.get("cache", {})
    written = c.get("cascade_writes", 0) + c.get("cascade_failures", 0)
    promoted = c.get("promoted_blocks", 0) + c.get("promotion_failures", 0)
    return bool(
        stats.get("jobs_in_flight", 0) == 0
        and written >= c.get("stored_blocks", 0)
        and promoted >= c.get("promotions", 0)
    )


def _counters(stats: dict[str, Any] | None) -> list[Any]:
    return [(stats or {}).get(section) for section in COUNTER_SECTIONS]


def run_engine(
    label: str,
    model: Path,
    workload: Workload,
    size: ModelSize,
    engine_blocks: int,
    transfer: dict[str, Any] | None = None,
) -> Run:
    """Start an engine, warm it up, send the workload's requests one at a time (the order is the
    conversations' interleaving) and time each one: with ``max_tokens=1`` a request is its
    prefill plus one sampling step."""
    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    run = Run(label)
    kwargs: dict[str, Any] = {}
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    started = time.perf_counter()
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK_TOKENS,
        kv_cache_memory_bytes=engine_blocks * size.block_bytes,
        # What the longest request needs; vLLM insists its KV cache holds at least that.
        max_model_len=(engine_blocks_for(workload) - 1) * BLOCK_TOKENS,
        max_num_seqs=1,
        enforce_eager=True,
        enable_prefix_caching=True,
        seed=0,
        **kwargs,
    )
    run.start_s = time.perf_counter() - started
    try:
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
        started = time.perf_counter()
        for tokens in warmup_prompts(workload, size.vocab_size):
            llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        first = before = settle(llm, params)
        run.warmup_s = time.perf_counter() - started
        for turn in tqdm(workload.turns, desc=label, unit="req", file=sys.stderr, leave=False):
            prompt = TokensPrompt(prompt_token_ids=list(turn.tokens))
            started = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            seconds = time.perf_counter() - started
            request = Request(seconds, list(out.outputs[0].token_ids), out.num_cached_tokens or 0)
            after = connector_stats(llm)
            if transfer is not None and after is not None:
                request.kvtier_tokens = _counter(after, "connector", "hit_tokens") - _counter(
                    before, "connector", "hit_tokens"
                )
                promoted = _counter(after, "cache", "promoted_blocks") - _counter(
                    before, "cache", "promoted_blocks"
                )
                hits = _counter(after, "cache", "hit_blocks") - _counter(
                    before, "cache", "hit_blocks"
                )
                request.pool_blocks, request.fs_blocks = hits - promoted, promoted
            before = after
            run.requests.append(request)
        last = settle(llm, params)
        if transfer is not None and last is not None:
            run.kvtier = delta(last, first)
    finally:
        core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
        if core is not None:
            core.shutdown()  # also shuts the connector down (it writes its stats file)
        del llm, core
        gc.collect()
    if transfer is not None and run.kvtier is None:
        # No in-process counters: fall back to the stats file (warm-up included).
        stats_path = Path(transfer["kv_connector_extra_config"]["vllm"]["stats_path"])
        run.kvtier = read_snapshot(stats_path)  # through safe_files, bounded
    return run


# -- numbers ------------------------------------------------------------------------------------


def tier_summary(stats: dict[str, Any], block_bytes: int) -> dict[str, Any]:
    """Per-tier hit ratios (of the blocks kvtier was asked for) and bytes moved."""
    cache = stats["cache"]
    looked = max(int(cache["lookup_blocks"]), 1)
    promoted = {k: int(v) for k, v in stats.get("promoted", {}).items()}
    pool_hits = int(cache["hit_blocks"]) - sum(promoted.values())
    tiers: dict[str, Any] = {
        "host pool": {
            "hit_blocks": pool_hits,
            "hit_ratio": pool_hits / looked,
            "read_bytes": int(cache["loaded_blocks"]) * block_bytes,
            "write_bytes": int(cache["stored_blocks"]) * block_bytes,
        }
    }
    for name, counters in stats.get("tiers", {}).items():
        tiers[name] = {
            "hit_blocks": promoted.get(name, 0),
            "hit_ratio": promoted.get(name, 0) / looked,
            "read_bytes": int(counters["read_bytes"]),
            "write_bytes": int(counters["write_bytes"]),
        }
    return {
        "lookup_blocks": int(cache["lookup_blocks"]),
        "hit_blocks": int(cache["hit_blocks"]),
        "loaded_blocks": int(cache["loaded_blocks"]),
        "stored_blocks": int(cache["stored_blocks"]),
        "pool_evictions": int(cache["pool_evictions"]),
        "pool_slots": int(stats.get("pool_slots", 0)),
        "hit_tokens": int(stats["connector"]["hit_tokens"]),
        "load_blocks_failed": int(stats["connector"]["load_blocks_failed"]),
        "tiers": tiers,
    }


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def ms(seconds: list[float]) -> tuple[float, float, float]:
    if not seconds:
        return 0.0, 0.0, 0.0
    return sum(seconds), statistics.mean(seconds) * 1e3, statistics.median(seconds) * 1e3


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvtier.demo",
        description="vLLM (CPU) with kvtier on a multi-turn workload from the bundled trace: "
        "the same requests without kvtier, with it, and without it again.",
    )
    parser.add_argument("--requests", type=int, default=64, help="requests replayed (64)")
    parser.add_argument("--concurrency", type=int, default=4, help="conversations open (4)")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation, max (4)")
    parser.add_argument(
        "--context-blocks", type=int, default=40, help="a conversation's context, max blocks (40)"
    )
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="demo", help="demo (53M parameters) or tiny"
    )
    parser.add_argument(
        "--pool-blocks", type=int, default=128, help="kvtier host pool, in 32-token blocks (128)"
    )
    parser.add_argument(
        "--eviction",
        default=DEFAULT_EVICTION,
        help=f"kvtier's eviction policy ({DEFAULT_EVICTION}; docs/policies.md)",
    )
    parser.add_argument(
        "--no-fs", action="store_true", help="the host pool alone, without the fs tier"
    )
    parser.add_argument(
        "--workdir", type=Path, default=Path("kvtier-demo"), help="model, fs tier, results"
    )
    parser.add_argument("--json", type=Path, default=None, help="default: WORKDIR/results.json")
    parser.add_argument(
        "--write-model",
        type=Path,
        default=None,
        metavar="DIR",
        help="only write --model's directory (config.json, seeded random weights) and exit",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.write_model is not None:  # a model for vllm serve (docs/vllm.md), no demo
        print(write_model(args.write_model, MODELS[args.model]))
        return 0
    wall = time.perf_counter()
    prepare_env()
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")
    size: ModelSize = MODELS[args.model]
    workdir: Path = args.workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    workload = build_workload(
        args.requests, args.concurrency, args.turns, args.context_blocks, size.vocab_size
    )
    engine_blocks = engine_blocks_for(workload)
    all_blocks = unbounded_engine_blocks(workload)
    expected = predict_shares(workload.prompts, engine_blocks, args.pool_blocks)
    model = write_model(workdir / "model", size)
    print_setup(args, size, workload, engine_blocks, expected)

    stats_path = workdir / "stats.json"
    base1 = run_engine(BASELINE, model, workload, size, engine_blocks)
    shutil.rmtree(workdir / "fs", ignore_errors=True)
    stats_path.unlink(missing_ok=True)
    transfer = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": kvtier_config(
            workdir,
            args.pool_blocks * size.block_bytes,
            stats_path,
            args.eviction,
            fs_tier=not args.no_fs,
            # The tiny model computes a block faster than a tier reads it back: weighing the
            # costs declined every fs promotion on a loaded machine (325 of 328 in one run),
            # and the tier this mode exists to exercise served nothing.
            promotion_costs=args.model != "tiny",
        ),
    }
    kv = run_engine(KVTIER, model, workload, size, engine_blocks, transfer)
    ideal = run_engine(IDEAL, model, workload, size, all_blocks)
    base2 = run_engine(BASELINE_AGAIN, model, workload, size, engine_blocks)
    result = report(workload, expected, [base1, kv, ideal, base2], size, args)
    out_path: Path = args.json or args.workdir / "results.json"
    out_path.write_text(json.dumps(result, indent=1))
    print(f"JSON      {out_path}   (demo took {time.perf_counter() - wall:.0f} s)")
    return 0 if result["outputs_identical"] else 1


def print_setup(
    args: Any, size: ModelSize, workload: Workload, engine_blocks: int, expected: Shares
) -> None:
    """What the demo runs: the model, the workload, the caches and the shares it expects."""
    print(
        f"model     Llama, hidden {size.hidden_size}, {size.num_hidden_layers} layers, "
        f"{size.parameters / 1e6:.0f}M parameters, seeded random weights, float32 "
        f"(KV: {size.block_bytes >> 10} KiB per {BLOCK_TOKENS}-token block)"
    )
    print(
        f"workload  {len(workload.turns)} requests of {workload.sessions} conversations from the "
        f"bundled trace ({workload.concurrency} open at a time), {workload.prompt_tokens} prompt "
        f"tokens, longest {workload.max_prompt_tokens}"
    )
    print(
        f"caches    vLLM {engine_blocks} blocks of {BLOCK_TOKENS} tokens; kvtier host pool "
        f"{args.pool_blocks} blocks ({mib(args.pool_blocks * size.block_bytes)}, eviction "
        f"{args.eviction})" + ("" if args.no_fs else f" + fs tier in {args.workdir / 'fs'}")
    )
    print(
        f"expected  (LRU model) {expected.reusable:.0%} of the prompt tokens reusable: vLLM's "
        f"own cache {expected.engine:.0%},\n          kvtier's host pool {expected.pool:.0%}, "
        f"fs {expected.fs:.0%}"
    )
    sys.stdout.flush()


def report(
    workload: Workload, expected: Shares, runs: list[Run], size: ModelSize, args: Any
) -> dict[str, Any]:
    """Print the results and return them as a JSON-able dict. ``runs``: the first baseline, the
    kvtier run, the run with a vLLM cache that keeps everything, the second baseline."""
    base1, kv, _, _ = runs
    assert kv.kvtier is not None
    summary = tier_summary(kv.kvtier, size.block_bytes)
    print_tiers(summary)
    tokens = token_counts(workload.prompt_tokens, summary["hit_tokens"], runs)
    timing = prefill_timing(runs)
    gains = print_check(tokens, runs)
    identical = all(
        [r.output for r in run.requests] == [r.output for r in base1.requests] for run in runs
    )
    print(f"outputs    identical in all four runs: {identical}")
    return {
        "model": {**asdict(size), "parameters": size.parameters, "block_bytes": size.block_bytes},
        "workload": workload_record(workload, args),
        "caches": {
            "vllm_blocks": engine_blocks_for(workload),
            "vllm_blocks_for_all": unbounded_engine_blocks(workload),
            "pool_blocks": args.pool_blocks,
            "eviction": args.eviction,
            "fs_tier": not args.no_fs,
        },
        "expected_shares": asdict(expected),
        "kvtier": summary,
        "kvtier_stats": kv.kvtier,
        "tokens": tokens,
        "timing": timing,
        **gains,
        "requests": {run.label: [asdict(r) for r in run.requests] for run in runs},
        "outputs_identical": identical,
    }


def print_tiers(summary: dict[str, Any]) -> None:
    """kvtier's hit ratio and bytes moved per tier."""
    print()
    print(f"{'kvtier':<11}{'hit ratio':>10}{'hit blocks':>12}{'read':>12}{'written':>12}")
    for name, t in summary["tiers"].items():
        print(
            f"{name:<11}{t['hit_ratio']:>10.1%}{t['hit_blocks']:>12}"
            f"{mib(t['read_bytes']):>12}{mib(t['write_bytes']):>12}"
        )
    print(
        f"           hit ratio: of the {summary['lookup_blocks']} blocks looked up in kvtier; "
        f"host pool read/written:\n           pool -> vLLM / vLLM -> pool; fs read: promoted "
        f"back into the pool"
    )


def token_counts(tokens: int, loaded: int, runs: list[Run]) -> dict[str, Any]:
    """Print and return where the kvtier run's prompt tokens came from (``loaded``: from
    kvtier), next to the engine's own cache in the other runs."""
    base1, kv, ideal, _ = runs
    cached = {run.label: sum(r.engine_cached for r in run.requests) for run in runs}
    engine_own = cached[kv.label] - loaded
    computed = tokens - cached[kv.label]
    print(
        f"tokens     {tokens} prompt tokens: {loaded} ({loaded / max(tokens, 1):.1%}) loaded "
        f"from kvtier, {computed} computed, {engine_own} from vLLM's own cache\n"
        f"           (without kvtier: {cached[base1.label]} from vLLM's own cache; with a vLLM "
        f"cache for all: {cached[ideal.label]})"
    )
    return {
        "prompt": tokens,
        "loaded_from_kvtier": loaded,
        "computed": computed,
        "vllm_cache": engine_own,
        "vllm_cache_by_run": cached,
    }


def prefill_timing(runs: list[Run]) -> dict[str, Any]:
    """Print and return each run's prefill times: of all requests, of those the kvtier run
    loaded something for, and of the others."""
    kv = runs[1]
    hits = [i for i, r in enumerate(kv.requests) if (r.kvtier_tokens or 0) > 0]
    misses = [i for i in range(len(kv.requests)) if i not in set(hits)]
    groups = (
        ("all", f"all {len(kv.requests)} requests", list(range(len(kv.requests)))),
        ("kvtier_hits", f"{len(hits)} with kvtier hits", hits),
        ("no_kvtier_hits", f"{len(misses)} without", misses),
    )
    print()
    print(f"{'prefill':<22}" + "".join(f"{title:>26}" for _, title, _ in groups))
    print(f"{'':<22}" + f"{'total':>10}{'mean':>8}{'median':>8}" * len(groups))
    timing: dict[str, Any] = {}
    for run in runs:
        cells = []
        entry: dict[str, Any] = {"engine_start_s": run.start_s, "warmup_s": run.warmup_s}
        for key, _, idx in groups:
            total, mean, median = ms([run.requests[i].seconds for i in idx])
            cells.append(f"{total:>9.2f}s{mean:>6.0f}ms{median:>6.0f}ms")
            entry[key] = {
                "requests": len(idx),
                "total_s": total,
                "mean_ms": mean,
                "median_ms": median,
            }
        print(f"{run.label:<22}" + "".join(cells))
        timing[run.label] = entry
    return timing


def print_check(tokens: dict[str, Any], runs: list[Run]) -> dict[str, float]:
    """Print and return how much shorter prefill was with kvtier and with a vLLM cache for all,
    against the mean of the two baselines (and how far those differ)."""
    base1, kv, ideal, base2 = runs
    prompt = max(tokens["prompt"], 1)
    baseline = (base1.total + base2.total) / 2
    drift = abs(base1.total - base2.total) / max(baseline, 1e-9)
    saved = 1 - kv.total / max(baseline, 1e-9)
    ideal_saved = 1 - ideal.total / max(baseline, 1e-9)
    print()
    print(
        f"check      {tokens['loaded_from_kvtier'] / prompt:.0%} of the prompt tokens loaded "
        f"from kvtier: prefill {saved:.0%} shorter ({baseline:.2f} s -> {kv.total:.2f} s)\n"
        f"           a vLLM cache that keeps every block (no evictions, no copies) serves "
        f"{tokens['vllm_cache_by_run'][ideal.label] / prompt:.0%}:\n"
        f"           {ideal_saved:.0%} shorter ({ideal.total:.2f} s); kvtier's loads, promotions "
        f"and stores cost the difference ({kv.total - ideal.total:+.2f} s)\n"
        f"           baseline: the mean of the two runs without kvtier, which differ by "
        f"{drift:.1%}"
    )
    if drift > 0.1:
        print(
            "           note: the baselines differ a lot, the machine's speed changed during the "
            "demo\n           (another process?): timings are disturbed, re-run for clean ones"
        )
    return {
        "baseline_mean_s": baseline,
        "baselines_differ": drift,
        "saved": saved,
        "saved_with_vllm_cache_for_all": ideal_saved,
    }


def workload_record(workload: Workload, args: Any) -> dict[str, Any]:
    """The workload as results.json records it: its options and every request."""
    return {
        "requests": len(workload.turns),
        "conversations": workload.sessions,
        "concurrency": workload.concurrency,
        "max_turns": args.turns,
        "max_context_blocks": args.context_blocks,
        "prompt_tokens": workload.prompt_tokens,
        "max_prompt_tokens": workload.max_prompt_tokens,
        "turns": [
            {
                "conversation": t.session,
                "turn": t.turn,
                "trace_index": t.trace_index,
                "tokens": len(t.tokens),
                "resent": t.resent,
            }
            for t in workload.turns
        ],
    }


if __name__ == "__main__":
    raise SystemExit(main())
