"""A pool under pressure: more conversations in flight than the host pool holds between turns.

The request sequence is the engine benchmark's own (``benchmarks/vllm_gpu_bench.py``, prompts
widened by ``vllm_bench_engine.widen``): the demo's multi-turn conversations from the bundled trace
(``kvtier.demo.build_workload`` with 5 turns and at most 40 context blocks), each token widened
4x, ``--concurrency`` conversations round robin (160 / 240 / 320 requests for 8 / 16 / 32 in
flight), cut into 16-token engine blocks of 2 MiB (Llama-3.1-8B in bf16) whose ids chain the
prefix, as vLLM's block hashes do. Each request is replayed through the real ``TieredCache`` over
a host pool of 2 / 3 / 4 / 8 GiB (``Replayer``, no GPU cache in front: the pool alone), with 64
output tokens in each request's hint.

Policies: ``lru``; ``hinted`` as it was before the pressure mode (its source at ``--before``, read
with git); ``hinted`` now with every store admitted (its ``admit_store`` answering all, as before
the pool asked it); ``hinted`` now (the default: under pressure the pool stores only what its
``admit_store`` admits); and the offline optimum (``kvtier.sim.optimal``).
Then the bundled trace with ``--bundled-concurrency`` conversations in flight, exactly what
``kvtier simulate --concurrency N --pool-blocks B --policy P`` replays. Prints tables and writes
JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.cache.manager import TieredCache
from kvtier.demo import build_workload
from kvtier.keys import Namespace
from kvtier.policies import EvictionPolicy, HintedPolicy, LRUPolicy
from kvtier.pool import HostPool
from kvtier.sim.conversations import trace_requests
from kvtier.sim.optimal import infinite_hit_ratio, optimal_hit_ratio
from kvtier.sim.replay import Replayer, machine_description
from kvtier.sim.trace import TraceRequest, bundled_trace_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_bench_engine import LLAMA_8B, widen  # the GPU benchmark's own widening

ENGINE_BLOCK_TOKENS = 16
BLOCK_BYTES = 2 * 1024 * 1024
"""16 tokens of Llama-3.1-8B KV in bf16: 32 layers x K and V x 8 heads x 128 x 2 bytes."""
GIB = 1024**3
BEFORE = "266712f"
"""The commit before the pressure mode (``hinted`` as the issue measured it)."""

PolicyFactory = Callable[[int], EvictionPolicy]


class AdmittingAll(HintedPolicy):
    """``hinted`` with every store admitted: the pool evicts for all of a store, as before
    ``TieredCache.prepare_store`` asked the policy's ``admit_store`` (what the refusals add)."""

    def admit_store(self, n: int, free: int) -> int:
        return n


def hinted_before(rev: str) -> PolicyFactory | None:
    """``HintedPolicy`` as of commit ``rev`` (None when git cannot show it)."""
    try:
        source = subprocess.run(
            ["git", "show", f"{rev}:src/kvtier/policies/hinted.py"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("hinted_before")
    exec(compile(source, f"{rev}:hinted.py", "exec"), module.__dict__)
    cls: type[HintedPolicy] = module.HintedPolicy
    return cls


def benchmark_sequence(
    concurrency: int, requests: int, turns: int, context: int, factor: int
) -> list[TraceRequest]:
    """The engine benchmark's requests as trace requests of chained 16-token block ids."""
    vocab = int(LLAMA_8B["vocab_size"])
    workload = build_workload(requests, concurrency, turns, context, vocab=vocab)
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    out: list[TraceRequest] = []
    for turn in workload.turns:
        tokens = widen(turn.tokens, factor, vocab)
        chain: list[int] = []
        parent = -1
        for start in range(0, len(tokens) - ENGINE_BLOCK_TOKENS + 1, ENGINE_BLOCK_TOKENS):
            block = tuple(tokens[start : start + ENGINE_BLOCK_TOKENS])
            parent = ids.setdefault((parent, block), len(ids))
            chain.append(parent)
        out.append(TraceRequest(float(len(out)), len(tokens), 64, tuple(chain)))
    return out


def replay(requests: Sequence[TraceRequest], policy: EvictionPolicy, blocks: int) -> float:
    """Hit ratio of ``requests`` through the real manager over a pool of ``blocks`` slots."""
    with tempfile.TemporaryDirectory(prefix="kvtier-pressure-") as shm:
        pool = HostPool.create(blocks, 64, shm)
        cache = TieredCache(pool, policy, record_events=False)
        try:
            namespace = Namespace(model="pressure-bench", dtype="bf16", block_tokens=16)
            result = Replayer(cache, pool, namespace).run(requests)
            assert result.mismatched_blocks == 0
            return result.hit_ratio
        finally:
            cache.close()
            pool.close()


@dataclass(slots=True)
class Row:
    sequence: str
    concurrency: int
    requests: int
    pool_blocks: int
    pool_gib: float
    policy: str
    hit_ratio: float
    fraction_of_optimum: float
    seconds: float
    reusable: float
    """Hit ratio of a cache that keeps every block (the reusable share of the blocks)."""


def measure(
    label: str,
    concurrency: int,
    requests: Sequence[TraceRequest],
    blocks: int,
    policies: dict[str, PolicyFactory],
) -> list[Row]:
    optimum = optimal_hit_ratio(requests, blocks).hit_ratio
    reusable = infinite_hit_ratio(requests)
    gib = blocks * BLOCK_BYTES / GIB
    cell = (label, concurrency, len(requests), blocks, gib)
    rows = [Row(*cell, "optimal", optimum, 1.0, 0.0, reusable)]
    for name, factory in policies.items():
        start = time.perf_counter()
        ratio = replay(requests, factory(blocks), blocks)
        share = ratio / optimum if optimum else 0.0
        seconds = time.perf_counter() - start
        rows.append(Row(*cell, name, ratio, share, seconds, reusable))
        print(f"  {label} c={concurrency} {blocks} blocks {name}: {ratio:.4f}", file=sys.stderr)
    return rows


def table(rows: list[Row], names: list[str], key: str) -> None:
    """One line per (concurrency, pool): every policy's hit ratio, the optimum, and whether the
    default holds half the optimum where LRU caches under 5% of the reusable blocks."""
    head = f"{'in flight':>10}{key:>10}" + "".join(f"{n:>22}" for n in names)
    print(head + f"{'optimum':>10}{'LRU < 5% of reusable: hinted >= optimum/2':>44}")
    cells = sorted({(r.concurrency, r.pool_blocks) for r in rows})
    for concurrency, blocks in cells:
        by = {r.policy: r for r in rows if (r.concurrency, r.pool_blocks) == (concurrency, blocks)}
        size = f"{by['optimal'].pool_gib:.0f} GiB" if key == "pool" else str(blocks)
        line = f"{concurrency or 'trace':>10}{size:>10}"
        line += "".join(
            f"{by[n].hit_ratio:>13.4f} ({by[n].fraction_of_optimum:>5.0%})" for n in names
        )
        optimum = by["optimal"].hit_ratio
        verdict = "-"
        if by["lru"].hit_ratio < 0.05 * by["lru"].reusable:
            verdict = "yes" if by["hinted"].hit_ratio >= optimum / 2 else "NO"
        print(line + f"{optimum:>10.4f}{verdict:>44}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--requests", type=int, nargs="+", default=[160, 240, 320])
    parser.add_argument("--gib", type=float, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--context-blocks", type=int, default=40)
    parser.add_argument("--widen", type=int, default=4)
    parser.add_argument("--before", default=BEFORE, help="git revision of 'hinted (before)'")
    parser.add_argument("--bundled-concurrency", type=int, nargs="+", default=[0, 8, 32, 128])
    parser.add_argument("--bundled-pool-blocks", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--json", type=Path, default=Path("docs/results/pressure_bench.json"))
    args = parser.parse_args()
    if len(args.requests) != len(args.concurrency):
        parser.error("--requests needs one count per --concurrency")
    policies: dict[str, PolicyFactory] = {"lru": lambda _: LRUPolicy()}
    before = hinted_before(args.before)
    if before is not None:
        policies["hinted (before)"] = before
    policies["hinted, all stores"] = AdmittingAll
    policies["hinted"] = HintedPolicy
    rows: list[Row] = []
    for concurrency, count in zip(args.concurrency, args.requests, strict=True):
        requests = benchmark_sequence(
            concurrency, count, args.turns, args.context_blocks, args.widen
        )
        for gib in args.gib:
            blocks = int(gib * GIB // BLOCK_BYTES)
            rows += measure("benchmark", concurrency, requests, blocks, policies)
    bundled = bundled_trace_path()
    for concurrency in args.bundled_concurrency:
        requests = trace_requests(bundled, concurrency=concurrency or None)
        for blocks in args.bundled_pool_blocks:
            rows += measure("bundled", concurrency, requests, blocks, policies)
    names = list(policies)
    where, when = machine_description(), datetime.date.today().isoformat()
    print(f"pool under pressure, {when}, {where}")
    print("benchmark sequence (vllm_gpu_bench's requests, 2 MiB blocks of 16 tokens), hit ratio")
    print("(fraction of the optimum):")
    table([r for r in rows if r.sequence == "benchmark"], names, "pool")
    print("bundled trace, N conversations in flight (kvtier simulate --concurrency N):")
    table([r for r in rows if r.sequence == "bundled"], names, "blocks")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": where,
        "date": when,
        "before": args.before,
        "block_bytes": BLOCK_BYTES,
        "turns": args.turns,
        "context_blocks": args.context_blocks,
        "widen": args.widen,
        "rows": [asdict(r) for r in rows],
    }
    args.json.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
