"""Redis tier throughput for 2 MiB blocks against ``redis-benchmark`` on the same server, same run.

Starts its own ``redis-server`` on a free loopback port (or uses ``--url``), then alternates
rounds of:

* the tier: ``--blocks`` new blocks written (SET), read back (GET, header and checksum verified
  into pool slots) and written again (overwrite), as a manager drives it: jobs of
  ``--job-blocks`` blocks, two in flight, each split by the tier into pipelined batches over its
  ``io_threads`` connections;
* ``redis-benchmark -d <block bytes>`` with as many parallel clients (``-c``) as the tier has I/O
  connections, with ``-P 1`` and with the tier's pipeline depth: SET to new keys
  (``-r 1000000000``), then SET and GET over a filled keyspace of ``--blocks`` keys (``-r``), the
  same work as the tier's. Its default (one key, hot in the server's caches) is printed too, for
  reference only.

The reference for each operation is the better redis-benchmark depth (its median over rounds);
the tier's figure is its median too. Prints a table naming the machine and writes JSON.
Acceptance (issue 5): tier >= 80% of redis-benchmark for SET and for GET.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import redis
from bench_common import cpu_name

from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.tiers.base import TierJob, TierJobKind
from kvtier.tiers.redis.options import Options
from kvtier.tiers.redis.tier import RedisTier
from kvtier.validation import Section

MIB = 1024 * 1024
OPERATIONS = ("SET new keys", "SET overwrite", "GET")
GB = 1e9


@dataclass(slots=True)
class Run:
    who: str
    """"tier" or "redis-benchmark -P n"."""
    operation: str
    blocks: int
    seconds: float
    clients: int
    pipeline: int

    @property
    def blocks_per_s(self) -> float:
        return self.blocks / self.seconds if self.seconds > 0 else 0.0


@dataclass(slots=True)
class Row:
    operation: str
    tier_blocks_per_s: float
    tier_gb_per_s: float
    reference: str
    reference_blocks_per_s: float
    reference_gb_per_s: float
    ratio: float
    passed: bool


@dataclass(slots=True)
class Report:
    machine: dict[str, object]
    settings: dict[str, object]
    rows: list[Row] = field(default_factory=list)
    runs: list[dict[str, object]] = field(default_factory=list)
    acceptance: str = "tier >= 80% of the better redis-benchmark run, for each operation"
    passed: bool = False


def machine_info(redis_version: str) -> dict[str, object]:
    cpu = cpu_name()
    try:
        import hiredis  # noqa: F401

        parser = "hiredis"
    except ImportError:
        parser = "python"
    return {
        "hostname": platform.node(),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "redis_server": redis_version,
        "redis_py": redis.__version__,
        "reply_parser": parser,
    }


# -- the server ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def own_server(maxmemory: str) -> Iterator[str]:
    directory = Path(tempfile.mkdtemp(prefix="kvtier-redis-bench-"))
    port = free_port()
    log = directory / "redis.log"
    process = subprocess.Popen(
        [
            "redis-server",
            "--bind",
            "127.0.0.1",
            "--port",
            str(port),
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(directory),
            "--logfile",
            str(log),
            "--maxmemory",
            maxmemory,
            "--maxmemory-policy",
            "allkeys-lru",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 15
        while "Ready to accept connections" not in (log.read_text() if log.exists() else ""):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        process.kill()
        process.wait(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


# -- the tier -----------------------------------------------------------------------------------


def tier_pass(
    tier: RedisTier, kind: TierJobKind, keys: list[bytes], job_blocks: int, inflight_jobs: int
) -> float:
    """Seconds to move ``keys`` through the tier in jobs of ``job_blocks`` blocks, at most
    ``inflight_jobs`` at a time (each with its own slots), as a manager cascading or promoting."""
    jobs = [keys[i : i + job_blocks] for i in range(0, len(keys), job_blocks)]
    free = [list(range(j * job_blocks, (j + 1) * job_blocks)) for j in range(inflight_jobs)]
    running: dict[int, list[int]] = {}
    next_job = 0
    ok_blocks = 0
    started = time.perf_counter()
    while next_job < len(jobs) or running:
        while next_job < len(jobs) and free:
            slots = free.pop()
            job_keys = jobs[next_job]
            tier.submit(TierJob(next_job, kind, job_keys, slots[: len(job_keys)]))
            running[next_job] = slots
            next_job += 1
        results = tier.poll()
        if not results:
            time.sleep(0.001)  # an engine polls once per step, less often than this
        for result in results:
            free.append(running.pop(result.job_id))
            ok_blocks += sum(result.ok)
    seconds = time.perf_counter() - started
    if ok_blocks != len(keys):
        raise RuntimeError(f"{kind.value}: only {ok_blocks} of {len(keys)} blocks succeeded")
    return seconds


def block_keys(n: int, salt: int) -> list[bytes]:
    return [(salt * 10_000_000 + i).to_bytes(8, "little") + b"kvtierbn" for i in range(n)]


# -- redis-benchmark ----------------------------------------------------------------------------


def redis_benchmark(
    url: str,
    test: str,
    value_bytes: int,
    requests: int,
    clients: int,
    pipeline: int,
    keyspace: int | None,
) -> float:
    """Requests per second of one redis-benchmark test (``set`` or ``get``) over ``keyspace``
    random keys (``key:000000000042``...), or over one key when None."""
    parts = urlsplit(url)
    cmd = ["redis-benchmark", "-h", parts.hostname or "127.0.0.1", "-p", str(parts.port or 6379)]
    cmd += ["-t", test, "-d", str(value_bytes), "-n", str(requests), "-c", str(clients)]
    cmd += ["-P", str(pipeline), "--csv"]
    if keyspace is not None:
        cmd += ["-r", str(keyspace)]
    if parts.password:
        cmd += ["-a", parts.password]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True).stdout
    for row in csv.reader(io.StringIO(out)):
        if len(row) >= 2 and row[0] == test.upper():
            return float(row[1])
    raise RuntimeError(f"unexpected redis-benchmark output:\n{out}")


# -- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--url", help="an existing server (default: start redis-server here)")
    parser.add_argument("--block-mib", type=float, default=2.0)
    parser.add_argument("--blocks", type=int, default=384, help="blocks per round and operation")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--io-threads", type=int, default=Options().io_threads)
    parser.add_argument(
        "--pipeline-blocks", type=int, default=0, help="0: the tier's automatic choice"
    )
    parser.add_argument("--job-blocks", type=int, default=16, help="blocks per tier job")
    parser.add_argument("--maxmemory", default="4gb", help="of the server this script starts")
    parser.add_argument("--json", default="docs/results/redis_bench.json")
    args = parser.parse_args(argv)
    for tool in ("redis-server", "redis-benchmark"):
        if shutil.which(tool) is None:
            print(f"{tool} not found (Debian: apt-get install redis-server redis-tools)")
            return 2

    block_bytes = int(args.block_mib * MIB)
    args.pipeline_blocks = Options(pipeline_blocks=args.pipeline_blocks).batch_blocks(block_bytes)
    version = subprocess.run(
        ["redis-server", "--version"], capture_output=True, text=True, timeout=30
    ).stdout.strip()
    report = Report(
        machine=machine_info(version),
        settings={
            "block_bytes": block_bytes,
            "blocks_per_round": args.blocks,
            "rounds": args.rounds,
            "io_threads": args.io_threads,
            "pipeline_blocks": args.pipeline_blocks,
            "job_blocks": args.job_blocks,
            "jobs_in_flight": 2,
            "parallel_clients": args.io_threads,
            "note": "tier values carry a 64-byte header; GB/s counts block payload bytes. "
            "The database is flushed before each round's tier and redis-benchmark parts.",
        },
    )
    server = contextlib.nullcontext(args.url) if args.url else own_server(args.maxmemory)
    with server as url:
        job, inflight = args.job_blocks, 2
        pool = HostPool.create(job * inflight, block_bytes)
        section = Section(
            {
                "url": url,
                "io_threads": args.io_threads,
                "pipeline_blocks": args.pipeline_blocks,
                "timeout_s": 30.0,
            },
            "bench",
        )
        namespace = Namespace(model="bench", dtype="bf16", block_tokens=16)
        tier = RedisTier("bench", namespace, pool, Options.parse(section))
        raw = redis.Redis.from_url(url, socket_timeout=60)
        try:
            if not tier.healthy:
                print(f"cannot reach {url}")
                return 2
            depths = sorted({1, args.pipeline_blocks})
            # Warm-up: connections, the server's allocator.
            tier_pass(tier, TierJobKind.WRITE, block_keys(job * inflight, 999), job, inflight)
            for r in range(args.rounds):
                raw.flushall()
                keys = block_keys(args.blocks, r)
                timed = [
                    ("SET new keys", tier_pass(tier, TierJobKind.WRITE, keys, job, inflight)),
                    ("GET", tier_pass(tier, TierJobKind.READ, keys, job, inflight)),
                    ("SET overwrite", tier_pass(tier, TierJobKind.WRITE, keys, job, inflight)),
                ]
                for op, secs in timed:
                    run = Run("tier", op, args.blocks, secs, args.io_threads, args.pipeline_blocks)
                    report.runs.append(asdict(run))
                for depth in depths:
                    n, c = args.blocks, args.io_threads
                    who = f"redis-benchmark -P {depth}"
                    raw.flushall()
                    rates = [
                        (
                            "SET new keys",
                            redis_benchmark(url, "set", block_bytes, n, c, depth, 10**9),
                        )
                    ]
                    # Fill a keyspace as large as the tier's (6n random SETs leave < 0.3% of the
                    # n keys unset), then overwrite and read it, as the tier does.
                    redis_benchmark(url, "set", block_bytes, 6 * n, c, depth, n)
                    rates.append(
                        ("SET overwrite", redis_benchmark(url, "set", block_bytes, n, c, depth, n))
                    )
                    rates.append(("GET", redis_benchmark(url, "get", block_bytes, n, c, depth, n)))
                    # For reference only: redis-benchmark's default, one key over and over.
                    rates.append(
                        ("SET one key", redis_benchmark(url, "set", block_bytes, n, c, depth, None))
                    )
                    rates.append(
                        ("GET one key", redis_benchmark(url, "get", block_bytes, n, c, depth, None))
                    )
                    for op, rate in rates:
                        report.runs.append(asdict(Run(who, op, n, n / rate, c, depth)))
                print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
        finally:
            raw.close()
            tier.close()
            pool.close()

    def median_rate(who: str, op: str) -> float:
        rates = [
            float(r["blocks"]) / float(r["seconds"])  # type: ignore[arg-type]
            for r in report.runs
            if r["who"] == who and r["operation"] == op
        ]
        return statistics.median(rates)

    references = sorted({str(r["who"]) for r in report.runs if r["who"] != "tier"})
    for op in OPERATIONS:
        tier_rate = median_rate("tier", op)
        ref_who = max(references, key=lambda who: median_rate(who, op))
        ref_rate = median_rate(ref_who, op)
        ratio = tier_rate / ref_rate
        report.rows.append(
            Row(
                op,
                tier_rate,
                tier_rate * block_bytes / GB,
                ref_who,
                ref_rate,
                ref_rate * block_bytes / GB,
                ratio,
                ratio >= 0.8,
            )
        )
    report.passed = all(row.passed for row in report.rows)
    informational = {
        op: max(median_rate(who, op) for who in references) for op in ("SET one key", "GET one key")
    }
    report.settings["redis_benchmark_one_key_blocks_per_s"] = informational

    m = report.machine
    print(
        f"\nRedis tier vs redis-benchmark, {block_bytes / MIB:g} MiB values, {args.io_threads} "
        f"parallel clients each side, median of {args.rounds} rounds x {args.blocks} blocks"
    )
    print(
        f"machine: {m['hostname']} ({m['cpu']}, {m['cores']} cores); {m['redis_server']}; "
        f"redis-py {m['redis_py']} ({m['reply_parser']} parser)"
    )
    print(
        f"{'operation':13} {'tier blk/s':>10} {'tier GB/s':>9} {'reference':>20} "
        f"{'ref blk/s':>9} {'ref GB/s':>8} {'ratio':>5}  pass"
    )
    for row in report.rows:
        print(
            f"{row.operation:13} {row.tier_blocks_per_s:10.0f} {row.tier_gb_per_s:9.2f} "
            f"{row.reference:>20} {row.reference_blocks_per_s:9.0f} "
            f"{row.reference_gb_per_s:8.2f} {row.ratio:5.2f}  {'yes' if row.passed else 'NO'}"
        )
    print(
        "redis-benchmark on one key (its default; hot in the server's caches, not comparable): "
        + ", ".join(f"{op} {rate:.0f} blk/s" for op, rate in informational.items())
    )
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(asdict(report), indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
