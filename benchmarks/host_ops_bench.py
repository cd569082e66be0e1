#!/usr/bin/env python3
"""How fast this host runs the operations kvtier's scheduler side is made of: dict and
OrderedDict operations on 300,000 keys (the pool index, the policy's orders), one block key of
the blake2b chain (``kvtier.keys``), the clocks, a lock, a thread round trip and a system call.

The connector's time per engine step differs between the 2-core VM the tests run on and a lent
GPU machine by more than native's does; this tells the host apart from kvtier. Each figure is the
least of five passes. Prints a table and, with ``--json``, adds this host's row to the file's
``hosts`` (one file for the machines compared).

    python3 benchmarks/host_ops_bench.py --json docs/results/host_ops_bench.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

KEYS = 300_000
PASSES = 5


def least_ns_per_op(run: Callable[[], object], ops: int) -> float:
    best = float("inf")
    for _ in range(PASSES):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best / ops * 1e9


def chain_blocks(n: int) -> None:
    """``keys.chain_keys_of_bytes``'s work per block: a copy of a blank hash, the parent key and
    16 tokens of 8 bytes."""
    blank = hashlib.blake2b(digest_size=16)
    block = os.urandom(128)
    parent = b"\0" * 16
    for _ in range(n):
        h = blank.copy()
        h.update(parent)
        h.update(block)
        parent = h.digest()


def round_trips(n: int) -> None:
    """Two threads handing a turn to each other through a condition (a job to a tier's thread and
    its answer back)."""
    turn = threading.Condition()
    count = [0]

    def other() -> None:
        for _ in range(n):
            with turn:
                while count[0] % 2 == 0:
                    turn.wait()
                count[0] += 1
                turn.notify()

    thread = threading.Thread(target=other)
    thread.start()
    for _ in range(n):
        with turn:
            count[0] += 1
            turn.notify()
            while count[0] % 2 == 1:
                turn.wait()
    thread.join()


def measure() -> dict[str, float]:
    keys = [os.urandom(16) for _ in range(KEYS)]
    index = dict.fromkeys(keys, 1)
    order: OrderedDict[bytes, None] = OrderedDict.fromkeys(keys)
    lock = threading.Lock()

    def locked(n: int) -> None:
        for _ in range(n):
            with lock:
                pass

    return {
        "dict get": least_ns_per_op(lambda: [index.get(k) for k in keys], KEYS),
        "OrderedDict move_to_end": least_ns_per_op(
            lambda: [order.move_to_end(k) for k in keys], KEYS
        ),
        "blake2b chain block": least_ns_per_op(lambda: chain_blocks(50_000), 50_000),
        "time.monotonic": least_ns_per_op(
            lambda: [time.monotonic() for _ in range(200_000)], 200_000
        ),
        "time.thread_time": least_ns_per_op(
            lambda: [time.thread_time() for _ in range(50_000)], 50_000
        ),
        "uncontended lock": least_ns_per_op(lambda: locked(200_000), 200_000),
        "thread round trip": least_ns_per_op(lambda: round_trips(5_000), 5_000),
        "os.stat": least_ns_per_op(lambda: [os.stat(".") for _ in range(50_000)], 50_000),
    }


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    host = {
        "cpu": cpu_name(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d"),
    }
    figures = measure()
    print(f"{host['cpu']}, {host['cpus']} cpus, Python {host['python']}")
    for name, ns in figures.items():
        print(f"{name:26s} {ns:10.1f} ns")
    if args.json is not None:
        data = json.loads(args.json.read_text()) if args.json.exists() else {"hosts": []}
        data["hosts"].append({**host, "ns_per_op": figures})
        args.json.write_text(json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
