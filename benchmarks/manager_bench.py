"""Manager throughput: block lookups and block stores per second for 8k-token requests.

One Python thread drives the real ``TieredCache`` (host pool + each eviction policy, no secondary
tier, so the figure is the manager's own cost). Each request is ``--tokens`` tokens in blocks of
``--block-tokens``; keys are real kvtier keys. Stores run with the pool full, so every store also
evicts. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench_common import cpu_name

from kvtier.cache.manager import TieredCache
from kvtier.keys import Namespace, chain_keys
from kvtier.policies import RequestHint, make_policy
from kvtier.pool import HostPool
from kvtier.registry import POLICIES


@dataclass(slots=True)
class Figure:
    operation: str
    policy: str
    blocks: int
    seconds: float
    blocks_per_s: float


def machine() -> str:
    cpu = cpu_name()
    return f"{platform.node()} ({cpu}, {os.cpu_count()} cores, Python {platform.python_version()})"


def request_keys(ns: Namespace, n_requests: int, tokens: int, seed: int) -> list[list[bytes]]:
    out = []
    for r in range(n_requests):
        base = (seed * 1_000_003 + r) * tokens
        out.append(chain_keys(ns, range(base, base + tokens)))
    return out


def best_of(repeats: int, run: object) -> float:
    assert callable(run)
    return min(run() for _ in range(repeats))


def bench(policy_kind: str, args: argparse.Namespace) -> list[Figure]:
    ns = Namespace(model="bench", dtype="bfloat16", block_tokens=args.block_tokens)
    blocks_per_request = args.tokens // args.block_tokens
    pool_blocks = args.pool_requests * blocks_per_request
    pool = HostPool.create(pool_blocks, 64)
    try:
        cache = TieredCache(pool, make_policy(policy_kind, pool_blocks), record_events=False)
        warm = request_keys(ns, args.pool_requests, args.tokens, seed=1)
        for keys in warm:
            res = cache.prepare_store(keys)
            cache.complete_store(res.keys)
        fresh = request_keys(ns, args.requests, args.tokens, seed=2)

        # Each stored request is hinted as an engine does when it finished (a no-op for policies
        # without hints); the hint's cost counts as part of the store.
        hint = RequestHint(hit_blocks=0, output_tokens=50)

        def stores() -> float:
            start = time.perf_counter()
            for keys in fresh:
                res = cache.prepare_store(keys)
                cache.complete_store(res.keys)
                cache.hint_request(keys, hint)
            return time.perf_counter() - start

        # Every store evicts (the pool is full); later rounds re-store keys evicted earlier.
        store_s = stores()
        resident = request_keys(ns, args.requests, args.tokens, seed=2)[-args.pool_requests :]

        def lookups() -> float:
            start = time.perf_counter()
            for _ in range(args.lookup_rounds):
                for keys in resident:
                    result = cache.lookup(keys)
                    assert result.hits == len(keys) and result.final
            return time.perf_counter() - start

        lookup_s = best_of(3, lookups)
        n_store = args.requests * blocks_per_request
        n_lookup = args.lookup_rounds * len(resident) * blocks_per_request
        stats = cache.stats()
        assert stats.pool_used <= pool_blocks
        cache.close()
    finally:
        pool.close()
    name = policy_kind
    return [
        Figure("lookup (full hit)", name, n_lookup, lookup_s, n_lookup / lookup_s),
        Figure("store (with eviction)", name, n_store, store_s, n_store / store_s),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--block-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=400, help="requests stored")
    parser.add_argument("--pool-requests", type=int, default=64, help="pool size in requests")
    parser.add_argument("--lookup-rounds", type=int, default=20)
    parser.add_argument("--json", type=Path, default=Path("docs/results/manager_bench.json"))
    args = parser.parse_args()

    figures = [f for kind in POLICIES for f in bench(kind, args)]
    where = machine()
    print(f"kvtier manager benchmark on {where}")
    print(f"{args.tokens}-token requests, {args.block_tokens}-token blocks, one Python thread")
    print(f"{'operation':<24}{'policy':<11}{'blocks':>10}{'seconds':>10}{'blocks/s':>14}")
    for f in figures:
        print(
            f"{f.operation:<24}{f.policy:<11}{f.blocks:>10}{f.seconds:>10.3f}{f.blocks_per_s:>14,.0f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {"machine": where, "args": vars(args) | {"json": str(args.json)}}
    payload["figures"] = [asdict(f) for f in figures]
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
