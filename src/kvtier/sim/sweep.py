"""``kvtier simulate --sweep``: the hit ratio curve over pool sizes, for capacity planning.

At each pool size (in blocks of ``block.bytes``, the unit of ``--pool-blocks``) the trace is
replayed through the real cache with the config's policy and tiers, next to the offline optimum
of a cache of that many blocks (``kvtier.sim.optimal``: a bound no online policy reaches) and the
ceiling (a cache that keeps every block). Results as a table, JSON and, with matplotlib
(``kvtier[plot]``), a PNG.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, KVTierError
from kvtier.sim.optimal import infinite_hit_ratio, optimal_hit_ratio
from kvtier.sim.simulate import DEFAULT_PAYLOAD_BYTES, simulate
from kvtier.sim.trace import read_trace
from kvtier.validation import format_size

AUTO_POINTS = 8


@dataclass(frozen=True, slots=True)
class SweepPoint:
    pool_blocks: int
    hit_ratio: float
    """The replay through the real cache (the config's policy and tiers)."""
    optimal_hit_ratio: float
    """The offline optimum of a cache of ``pool_blocks`` blocks (an upper bound)."""
    hit_blocks: int
    evictions: int


@dataclass(slots=True)
class SweepResult:
    trace: str
    requests: int
    blocks: int
    distinct_blocks: int
    policy: str
    tiers: list[str]
    block_bytes: int
    ceiling: float
    """Hit ratio of a cache that keeps every block."""
    points: list[SweepPoint] = field(default_factory=list)
    unit: str = "pool sizes in blocks of block.bytes"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_sizes(text: str) -> list[int] | None:
    """``auto`` (None) or a comma-separated list of positive block counts."""
    if text.strip() == "auto":
        return None
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ConfigError("--sweep", text, "'auto' or block counts such as 500,1000,2000") from None
    if not sizes or sizes[0] < 1:
        raise ConfigError("--sweep", text, "positive block counts such as 500,1000,2000")
    return sizes


def auto_sizes(distinct_blocks: int, points: int = AUTO_POINTS) -> list[int]:
    """``points`` sizes doubling up to the trace's distinct blocks (where every policy meets
    the ceiling)."""
    top = max(distinct_blocks, 2**points)
    return sorted({max(1, top >> shift) for shift in range(points - 1, -1, -1)})


def sweep(
    config: KVTierConfig,
    trace: str | Path,
    sizes: list[int] | None,
    *,
    payload_bytes: int = DEFAULT_PAYLOAD_BYTES,
    limit: int | None = None,
    progress: bool = False,
) -> SweepResult:
    requests = read_trace(trace, limit)
    distinct = len({h for r in requests for h in r.hash_ids})
    result = SweepResult(
        trace=Path(trace).name,
        requests=len(requests),
        blocks=sum(len(r.hash_ids) for r in requests),
        distinct_blocks=distinct,
        policy=config.eviction,
        tiers=[f"{t.name} ({t.kind})" for t in config.tiers],
        block_bytes=config.block.bytes,
        ceiling=infinite_hit_ratio(requests),
    )
    for n in sizes if sizes is not None else auto_sizes(distinct):
        replay = simulate(
            config,
            trace,
            pool_blocks=n,
            payload_bytes=payload_bytes,
            limit=limit,
            progress=progress,
        )
        if replay.mismatched_blocks:
            raise KVTierError(f"pool of {n} blocks: {replay.mismatched_blocks} payload mismatches")
        best = optimal_hit_ratio(requests, n)
        result.points.append(
            SweepPoint(
                n, replay.hit_ratio, best.hit_ratio, replay.hit_blocks, replay.tiers[0].evictions
            )
        )
    return result


def format_sweep(r: SweepResult) -> str:
    lines = [
        f"trace       {r.trace}: {r.requests} requests, {r.blocks} blocks, "
        f"{r.distinct_blocks} distinct",
        f"policy      {r.policy}; tiers behind the pool: {', '.join(r.tiers) or 'none'}",
        f"unit        {r.unit} ({format_size(r.block_bytes)} each)",
        "",
        f"{'pool blocks':>12}{'pool size':>12}{'hit ratio':>11}{'optimum':>10}"
        f"{'of optimum':>12}{'ceiling':>9}",
    ]
    for p in r.points:
        share = p.hit_ratio / p.optimal_hit_ratio if p.optimal_hit_ratio else 0.0
        lines.append(
            f"{p.pool_blocks:>12}{format_size(p.pool_blocks * r.block_bytes):>12}"
            f"{p.hit_ratio:>11.4f}{p.optimal_hit_ratio:>10.4f}{share:>12.1%}{r.ceiling:>9.4f}"
        )
    lines.append(
        "optimum: offline (evicts the block used farthest ahead, may skip a store), a bound"
    )
    return "\n".join(lines)


def write_json(r: SweepResult, path: Path) -> None:
    path.write_text(json.dumps(r.to_dict(), indent=1) + "\n")


def write_png(r: SweepResult, path: Path) -> None:
    """The curve, the optimum and the ceiling over pool size (log scale)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KVTierError(
            "the sweep's plot needs matplotlib: pip install 'kvtier[plot]' "
            "(or leave out --sweep-png)"
        ) from None
    xs = [p.pool_blocks for p in r.points]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    ax.plot(xs, [p.hit_ratio for p in r.points], "o-", label=f"kvtier ({r.policy})")
    ax.plot(xs, [p.optimal_hit_ratio for p in r.points], "s--", label="offline optimum (bound)")
    ax.axhline(r.ceiling, color="grey", linestyle=":", label=f"ceiling {r.ceiling:.3f}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"pool size, blocks of {format_size(r.block_bytes)}")
    ax.set_ylabel("hit ratio (blocks)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{r.trace}: {r.requests} requests")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
