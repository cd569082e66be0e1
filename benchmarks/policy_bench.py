"""Eviction policies on a trace: hit ratio per pool size, through the real manager.

Each online policy replays the trace through ``kvtier simulate``'s path (``TieredCache`` over a
host pool, no secondary tier, every block stored). The offline optimum (``kvtier.sim.optimal``,
an upper bound no online policy reaches) and a cache that keeps every block frame the results; the
last columns give each policy's fraction of the optimum. Then the same trace with an engine's
timing (``kvtier.sim.engine_timing``): stores of ``--engine-chunk`` blocks, hints
``--engine-lag`` requests late ("late"), and hints given before the request's last store
completed ("first", vLLM's order). Prints tables and writes JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier.config import bundled_config_mapping, parse_config
from kvtier.registry import POLICIES
from kvtier.sim.engine_timing import EngineTiming, engine_hit_ratio
from kvtier.sim.optimal import infinite_hit_ratio, optimal_hit_ratio
from kvtier.sim.replay import machine_description
from kvtier.sim.simulate import simulate
from kvtier.sim.trace import bundled_trace_path, read_trace

CAPACITIES = (300, 1000, 2000, 4000, 8000, 16000)


@dataclass(slots=True)
class Row:
    capacity_blocks: int
    policy: str
    hit_ratio: float
    fraction_of_optimum: float
    seconds: float
    timing: str = "replay"
    """replay (kvtier simulate's order), or an engine's: late / first (see the module doc)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace", type=Path, default=None, help="default: the bundled trace")
    parser.add_argument("--capacities", type=int, nargs="+", default=list(CAPACITIES))
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), help="online policies")
    parser.add_argument(
        "--engine-lag", type=int, default=4, help="late: hints this many requests late"
    )
    parser.add_argument("--engine-chunk", type=int, default=16, help="blocks per engine store")
    parser.add_argument("--json", type=Path, default=Path("docs/results/policy_bench.json"))
    args = parser.parse_args()
    trace = args.trace or bundled_trace_path()
    requests = read_trace(trace)
    base = parse_config(bundled_config_mapping())
    infinite = infinite_hit_ratio(requests)
    rows: list[Row] = []
    for capacity in args.capacities:
        start = time.perf_counter()
        optimum = optimal_hit_ratio(requests, capacity).hit_ratio
        rows.append(Row(capacity, "optimal", optimum, 1.0, time.perf_counter() - start))
        for name in args.policies:
            config = dataclasses.replace(base, eviction=name)
            start = time.perf_counter()
            result = simulate(config, trace, pool_blocks=capacity)
            assert result.mismatched_blocks == 0
            rows.append(
                Row(
                    capacity,
                    name,
                    result.hit_ratio,
                    result.hit_ratio / optimum if optimum else 0.0,
                    time.perf_counter() - start,
                )
            )
    timings = {
        "late": EngineTiming(hint_lag=args.engine_lag, store_chunk=args.engine_chunk),
        "first": EngineTiming(store_chunk=args.engine_chunk, hint_first=True),
    }
    for capacity in args.capacities:
        optimum = next(
            r.hit_ratio for r in rows if r.capacity_blocks == capacity and r.policy == "optimal"
        )
        for label, timing in timings.items():
            for name in args.policies:
                start = time.perf_counter()
                ratio = engine_hit_ratio(requests, name, capacity, timing)
                seconds = time.perf_counter() - start
                rows.append(
                    Row(capacity, name, ratio, ratio / optimum if optimum else 0.0, seconds, label)
                )
    where = machine_description()
    print(f"policy benchmark: {trace.name}, {len(requests)} requests, on {where}")
    names = [*args.policies, "optimal"]
    header = f"{'blocks':>8}" + "".join(f"{n:>11}" for n in names)
    header += "".join(f"{n + '/opt':>15}" for n in args.policies)
    print(header)
    for capacity in args.capacities:
        by = {r.policy: r for r in rows if r.capacity_blocks == capacity and r.timing == "replay"}
        line = f"{capacity:>8}" + "".join(f"{by[n].hit_ratio:>11.4f}" for n in names)
        line += "".join(f"{by[n].fraction_of_optimum:>15.3f}" for n in args.policies)
        print(line)
    print(f"infinite cache: {infinite:.4f} (the optimal column is an offline bound, not a policy)")
    for label, timing in timings.items():
        print(f"engine timing '{label}': {timing}")
        print(f"{'blocks':>8}" + "".join(f"{n:>11}" for n in args.policies))
        for capacity in args.capacities:
            by = {r.policy: r for r in rows if r.capacity_blocks == capacity and r.timing == label}
            print(f"{capacity:>8}" + "".join(f"{by[n].hit_ratio:>11.4f}" for n in args.policies))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": where,
        "trace": trace.name,
        "requests": len(requests),
        "infinite_hit_ratio": infinite,
        "engine_timings": {label: asdict(t) for label, t in timings.items()},
        "rows": [asdict(r) for r in rows],
    }
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
