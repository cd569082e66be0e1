"""Shared-index throughput: block lookups per second, in total, of several processes that look up
keys in one shared block index (``pool.share``) at once.

One process fills a shared pool of ``--slots`` blocks with real kvtier keys; ``--processes``
processes (each an engine attached to the pool) then look up batches of ``--batch`` keys (half of
them present, in random order) for ``--seconds``, with no lock (``SharedIndex.count_visible``, the
call behind ``lookup``), plus one engine that keeps storing new blocks (reservations, evictions and
publications under the index lock) so the lookups race real changes. Also measured: the engine's
path for one request (``SharedTieredCache.lookup`` of a 512-block prompt, bytes keys included).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from bench_common import cpu_name

from kvtier.cache.factory import build_cache
from kvtier.cache.shared import SharedTieredCache
from kvtier.config import load_config
from kvtier.keys import Namespace, chain_keys
from kvtier.shared_pool import table

NAMESPACE = Namespace(model="bench", dtype="float16", block_tokens=16)
SLOT_BYTES = 256


@dataclass(slots=True)
class Figure:
    what: str
    processes: int
    batch: int
    lookups: int
    seconds: float
    lookups_per_s: float


def machine() -> str:
    cpu = cpu_name()
    return f"{cpu}, {mp.cpu_count()} cores, Python {platform.python_version()}"


def open_cache(shm_dir: str, slots: int) -> SharedTieredCache:
    config = load_config(
        {"pool": {"size": slots * SLOT_BYTES, "shm_dir": shm_dir, "share": "bench"}}
    )
    _, cache = build_cache(config, NAMESPACE, SLOT_BYTES)
    assert isinstance(cache, SharedTieredCache)
    return cache


def keys_of(prompt: int, blocks: int) -> list[bytes]:
    return chain_keys(NAMESPACE, [prompt * 1_000_003 + t for t in range(blocks * 16)])


def lookups(shm_dir: str, slots: int, batch: int, seconds: float, seed: int, out: mp.Queue) -> None:
    cache = open_cache(shm_dir, slots)
    present = np.concatenate([table.keys_array(keys_of(p, 512)) for p in range(slots // 512)])
    absent = table.keys_array(keys_of(10_000 + seed, 512))
    rng = np.random.default_rng(seed)
    mix = np.concatenate([present[rng.choice(len(present), len(absent))], absent])
    batches = [mix[rng.permutation(len(mix))[:batch]] for _ in range(64)]
    count_visible = cache.index.count_visible
    done = 0
    began = time.perf_counter()
    end = began + seconds
    while time.perf_counter() < end:
        for k in batches[:16]:
            count_visible(k)
        done += 16 * batch
    out.put(("lookups", done, time.perf_counter() - began))
    cache.close()


def stores(shm_dir: str, slots: int, seconds: float, out: mp.Queue) -> None:
    cache = open_cache(shm_dir, slots)
    prompt, stored = 20_000, 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        reservation = cache.prepare_store(keys_of(prompt, 16))
        cache.complete_store(reservation.keys, True)
        stored += len(reservation.keys)
        prompt += 1
    out.put(("stores", stored, seconds))
    cache.close()


def engine_path(cache: SharedTieredCache, slots: int, seconds: float) -> Figure:
    prompts = [keys_of(p, 512) for p in range(min(8, slots // 512))]
    done = 0
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        for keys in prompts:
            cache.lookup(keys)
            done += len(keys)
    took = time.perf_counter() - began
    return Figure("engine lookup (bytes keys, leading hits)", 1, 512, done, took, done / took)


def run(args: argparse.Namespace) -> list[Figure]:
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(dir=args.shm_dir) as shm_dir:
        filler = open_cache(shm_dir, args.slots)
        for p in range(args.slots // 512):
            keys = keys_of(p, 512)
            filler.complete_store(filler.prepare_store(keys).keys, True)
        figures.append(engine_path(filler, args.slots, 1.0))
        ctx = mp.get_context("spawn")
        for processes, with_stores in ((1, False), (args.processes, False), (args.processes, True)):
            out = ctx.Queue()
            procs = [
                ctx.Process(
                    target=lookups, args=(shm_dir, args.slots, args.batch, args.seconds, i, out)
                )
                for i in range(processes)
            ]
            if with_stores:
                store_args = (shm_dir, args.slots, args.seconds, out)
                procs.append(ctx.Process(target=stores, args=store_args))
            for proc in procs:
                proc.start()
            results = [out.get(timeout=args.seconds + 120) for _ in procs]
            for proc in procs:
                proc.join(60)
            looked = [(n, t) for kind, n, t in results if kind == "lookups"]
            total = sum(n for n, _ in looked)
            took = max(t for _, t in looked)
            what = "lock-free batch lookups" + (" while one engine stores" if with_stores else "")
            figures.append(Figure(what, processes, args.batch, total, took, total / took))
            for _, stored, secs in (r for r in results if r[0] == "stores"):
                what = "stores (reserve + publish)"
                figures.append(Figure(what, 1, 16, stored, secs, stored / secs))
        filler.check_invariants(settled=True)
        filler.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--slots", type=int, default=65_536)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--shm-dir", default="/dev/shm")
    parser.add_argument("--json", type=Path, default=Path("docs/results/shared_index_bench.json"))
    args = parser.parse_args()
    figures = run(args)
    print(f"{'what':<48} {'procs':>5} {'batch':>5} {'lookups':>12} {'s':>6} {'per s':>12}")
    for f in figures:
        print(
            f"{f.what:<48} {f.processes:>5} {f.batch:>5} {f.lookups:>12,} {f.seconds:>6.2f} "
            f"{f.lookups_per_s:>12,.0f}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": machine(),
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args) | {"json": str(args.json)},
        "figures": [asdict(f) for f in figures],
    }
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
