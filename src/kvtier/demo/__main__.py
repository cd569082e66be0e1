"""Run the vLLM + kvtier demo: ``python -m kvtier.demo [--requests N] [--workdir DIR]``."""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.demo import (
    BLOCK_BYTES,
    BLOCK_TOKENS,
    build_workload,
    kvtier_config,
    prepare_env,
    write_model,
)


def run_engine(
    model: Path, prompts: list[list[int]], kv_cache_blocks: int, transfer: dict[str, Any] | None
) -> tuple[list[float], list[list[int]]]:
    """Send the requests one by one (a multi-turn conversation order); time each prefill."""
    from tqdm import tqdm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = {}
    if transfer is not None:
        kwargs["kv_transfer_config"] = transfer
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=BLOCK_TOKENS,
        kv_cache_memory_bytes=kv_cache_blocks * BLOCK_BYTES,
        max_model_len=1024,
        max_num_seqs=4,
        enforce_eager=True,
        enable_prefix_caching=True,
        **kwargs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], params, use_tqdm=False)  # warm up
    times: list[float] = []
    outputs: list[list[int]] = []
    label = "with kvtier" if transfer is not None else "without kvtier"
    for prompt in tqdm(prompts, desc=label, unit="req", file=sys.stdout):
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        times.append(time.perf_counter() - start)
        outputs.append(list(out[0].outputs[0].token_ids))
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return times, outputs


def summarize(stats: dict[str, Any]) -> dict[str, Any]:
    cache = stats["cache"]
    looked = max(int(cache["lookup_blocks"]), 1)
    promoted = stats.get("promoted", {})
    pool_hits = int(cache["hit_blocks"]) - sum(int(v) for v in promoted.values())
    tiers: dict[str, Any] = {"host pool": {"hit_ratio": pool_hits / looked}}
    for name, counters in stats["tiers"].items():
        tiers[name] = {
            "hit_ratio": int(promoted.get(name, 0)) / looked,
            "read_bytes": counters["read_bytes"],
            "write_bytes": counters["write_bytes"],
        }
    return {
        "lookup_blocks": cache["lookup_blocks"],
        "hit_blocks": cache["hit_blocks"],
        "loaded_blocks": cache["loaded_blocks"],
        "stored_blocks": cache["stored_blocks"],
        "pool_to_engine_bytes": int(cache["loaded_blocks"]) * BLOCK_BYTES,
        "engine_to_pool_bytes": int(cache["stored_blocks"]) * BLOCK_BYTES,
        "hit_tokens": stats["connector"]["hit_tokens"],
        "tiers": tiers,
    }


def mib(n: float) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvtier.demo", description=__doc__)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--workdir", type=Path, default=Path("kvtier-demo"))
    parser.add_argument("--json", type=Path, default=None, help="default: WORKDIR/results.json")
    parser.add_argument(
        "--kv-cache-blocks", type=int, default=64, help="vLLM's own KV cache, in 32-token blocks"
    )
    args = parser.parse_args(argv)
    prepare_env()
    workdir: Path = args.workdir.resolve()
    shutil.rmtree(workdir / "fs", ignore_errors=True)
    model = write_model(workdir / "model")
    prompts = build_workload(args.requests)
    print(
        f"workload: {len(prompts)} requests from the bundled trace, "
        f"{sum(map(len, prompts))} prompt tokens; vLLM KV cache {args.kv_cache_blocks} blocks"
    )
    base_times, base_out = run_engine(model, prompts, args.kv_cache_blocks, None)
    stats_path = workdir / "stats.json"
    transfer = {
        "kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": kvtier_config(workdir, stats_path),
    }
    kv_times, kv_out = run_engine(model, prompts, args.kv_cache_blocks, transfer)
    summary = summarize(json.loads(stats_path.read_text()))
    result = {
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "prefill_s_without": sum(base_times),
        "prefill_s_with": sum(kv_times),
        "prefill_ms_per_request_without": [t * 1e3 for t in base_times],
        "prefill_ms_per_request_with": [t * 1e3 for t in kv_times],
        "outputs_identical": base_out == kv_out,
        "kvtier": summary,
    }
    out_path = args.json or workdir / "results.json"
    out_path.write_text(json.dumps(result, indent=1))

    print()
    print(f"{'tier':<12}{'hit ratio':>10}{'read':>14}{'written':>14}")
    for name, t in summary["tiers"].items():
        read = mib(t["read_bytes"]) if "read_bytes" in t else "-"
        written = mib(t["write_bytes"]) if "write_bytes" in t else "-"
        print(f"{name:<12}{t['hit_ratio']:>10.1%}{read:>14}{written:>14}")
    print(
        f"bytes moved: engine->pool {mib(summary['engine_to_pool_bytes'])}, "
        f"pool->engine {mib(summary['pool_to_engine_bytes'])}; "
        f"{summary['hit_tokens']} prompt tokens loaded instead of computed"
    )
    print(f"{'':<16}{'prefill total':>14}{'mean/request':>14}")
    n = max(len(prompts), 1)
    for label, total in (("without kvtier", sum(base_times)), ("with kvtier", sum(kv_times))):
        print(f"{label:<16}{total:>13.2f}s{total / n * 1e3:>12.1f}ms")
    print(f"outputs identical: {result['outputs_identical']}   JSON: {out_path}")
    return 0 if result["outputs_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
