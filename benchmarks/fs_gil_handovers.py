"""What an fs tier's I/O threads cost a Python thread beside them, without an engine.

A thread standing for the engine's runs "steps": a fixed piece of Python work (about
``--work-us``, with ``--yields`` short system calls in it that let go of the GIL, as CUDA calls
and syscalls do in vLLM's loop), then submits the blocks owed at ``--rate`` a second to an fs
tier as write jobs and polls it, then sleeps ``--wait-ms`` (the forward pass). Printed per
configuration: the step's p50 / p90 / p99 wall time, the thread's voluntary context switches
a second besides its sleeps (it blocked: for the GIL, a lock), and the blocks written.

The calls by which threads wait for and hand over the GIL or a lock are futex calls; to count
them run it under ``strace -f -c -e trace=futex``. ``--pin`` puts the stepping thread alone on
the first CPU and the tier's threads on the others, so their CPU cannot take its core.

    python3 benchmarks/fs_gil_handovers.py --threads 4,2,1 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import engine_threads

from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import TierJob, TierJobKind
from kvtier.tiers.fs.tier import FsTier, Options

SLOTS = 512


def python_work(iterations: int, every: int, fd: int) -> int:
    """Bytecode for the GIL to be wanted during; ``os.fstat(fd)`` every ``every`` iterations
    lets go of it and takes it back."""
    acc = 0
    for i in range(iterations):
        acc ^= i
        if i % every == 0:
            os.fstat(fd)
    return acc


def calibrated(work_us: float, yields: int, fd: int) -> tuple[int, int]:
    """(iterations, iterations between yields) for about ``work_us`` of work."""
    started = time.perf_counter()
    python_work(100_000, 100_001, fd)
    per_iteration = (time.perf_counter() - started) / 100_000
    iterations = max(1, int(work_us / 1e6 / per_iteration))
    return iterations, max(1, iterations // yields) if yields else iterations + 1


def run(args: argparse.Namespace, threads: int, workdir: Path) -> dict[str, Any]:
    slot_bytes = int(args.block_kib * 1024)
    pool = HostPool.create(SLOTS, slot_bytes)
    store = workdir / "fs"
    capacity = args.capacity_blocks * (slot_bytes + 64)
    options = Options(path=str(store), capacity=capacity, threads=threads)
    tier = FsTier("bench", Namespace("bench", "bf16", 16), pool, options)
    try:
        if args.pin:
            engine_threads.pin_apart(
                [t for t in threading.enumerate() if t.name.startswith("kvtier-bench")]
            )
        probe = os.pipe()
        iterations, every = calibrated(args.work_us, args.yields, probe[0])
        steps: list[float] = []
        owed = 0.0
        next_key = job = 0
        me = threading.get_native_id()
        switches = engine_threads.switches(me)[0]
        started = last = time.perf_counter()
        while last - started < args.seconds:
            step = time.perf_counter()
            python_work(iterations, every, probe[0])
            owed += args.rate * (step - last)
            last = step
            if owed >= 1:
                count = int(owed)
                owed -= count
                keys = [(next_key + i).to_bytes(16, "big") for i in range(count)]
                slots = [(next_key + i) % SLOTS for i in range(count)]
                next_key += count
                job += 1
                tier.submit(TierJob(job, TierJobKind.WRITE, keys, slots))
            tier.poll()
            steps.append((time.perf_counter() - step) * 1e6)
            time.sleep(args.wait_ms / 1000)
        seconds = time.perf_counter() - started
        blocked = engine_threads.switches(me)[0] - switches - len(steps)  # less the sleeps
        for fd in probe:
            os.close(fd)
    finally:
        tier.close()
        pool.close()
        shutil.rmtree(store, ignore_errors=True)
    steps.sort()
    return {
        "threads": threads,
        "steps": len(steps),
        "step_us": {
            f"p{q}": round(steps[min(len(steps) - 1, len(steps) * q // 100)], 1)
            for q in (50, 90, 99)
        },
        "blocked_per_s": round(blocked / seconds, 1),
        "blocks_submitted": next_key,
        "blocks_written": tier.counters.write_blocks,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", default="4,1", help="the fs tier's I/O threads, each a run")
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of every configuration, in turns"
    )
    parser.add_argument("--rate", type=float, default=200.0, help="blocks written a second")
    parser.add_argument("--block-kib", type=float, default=64.0)
    parser.add_argument("--capacity-blocks", type=int, default=400)
    parser.add_argument("--seconds", type=float, default=6.0, help="length of each run")
    parser.add_argument("--work-us", type=float, default=1000.0)
    parser.add_argument("--yields", type=int, default=100, help="GIL releases in a step's work")
    parser.add_argument("--wait-ms", type=float, default=8.0)
    parser.add_argument("--pin", action="store_true")
    parser.add_argument("--dir", default=None, help="where the tier writes (default: a temp dir)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    counts = [int(t) for t in args.threads.split(",")]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for round_ in range(1, args.rounds + 1):
            for threads in counts:
                row = {"round": round_, **run(args, threads, Path(tmp))}
                rows.append(row)
                print(
                    f"round {round_} threads {threads}: step p50 / p90 / p99 "
                    + " / ".join(f"{v:,.0f}" for v in row["step_us"].values())
                    + f" us, blocked {row['blocked_per_s']:,.0f}/s, "
                    + f"written {row['blocks_written']:,} of {row['blocks_submitted']:,}",
                    file=sys.stderr,
                    flush=True,
                )
    heads = ("threads", "round", "p50 us", "p90 us", "p99 us", "blocked/s", "written")
    print(" ".join(f"{h:>{max(8, len(h))}}" for h in heads))
    for row in sorted(rows, key=lambda r: (-r["threads"], r["round"])):
        p50, p90, p99 = row["step_us"].values()
        print(
            f"{row['threads']:>8} {row['round']:>8} {p50:>8,.0f} {p90:>8,.0f} {p99:>8,.0f} "
            f"{row['blocked_per_s']:>9,.0f} {row['blocks_written']:>8,}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
