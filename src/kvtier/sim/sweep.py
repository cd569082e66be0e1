"""``kvtier simulate --sweep``: the hit ratio curve over pool sizes (or over one tier's
capacity), for capacity planning.

At each size (in blocks of ``block.bytes``, the unit of ``--pool-blocks`` and of tier capacities)
the trace is replayed through the real cache with the config's policy and tiers, next to the
offline optimum of a cache of that many blocks (``kvtier.sim.optimal``: a bound no online policy
reaches; for a tier, of one cache as large as the pool and the tier together, which bounds any
hierarchy of the two) and the ceiling (a cache that keeps every block). Results as a table, JSON
and, with matplotlib (``kvtier[plot]``), a PNG.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError, KVTierError
from kvtier.extras import install_hint
from kvtier.sim.conversations import trace_requests
from kvtier.sim.optimal import infinite_hit_ratio, optimal_hit_ratio
from kvtier.sim.replay import ReplayResult
from kvtier.sim.simulate import DEFAULT_PAYLOAD_BYTES, simulate, simulation_namespace
from kvtier.validation import format_size

AUTO_POINTS = 8


@dataclass(frozen=True, slots=True)
class SweepPoint:
    pool_blocks: int
    """The size swept: pool blocks, or the swept tier's blocks (``SweepResult.tier``)."""
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
    tier: str = ""
    """The tier whose capacity was swept (empty: the pool was)."""
    fixed_pool_blocks: int = 0
    """The pool's size while a tier is swept."""
    concurrency: int = 0
    """Conversations in flight the trace was reordered for (0: trace order); the replays and the
    optimum see the same order."""

    @property
    def swept(self) -> str:
        return f"tier {self.tier}" if self.tier else "pool"

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
    tier: str = "",
    pool_blocks: int = 0,
    concurrency: int | None = None,
) -> SweepResult:
    """Sweep the pool, or with ``tier`` that tier's capacity with the pool at ``pool_blocks``;
    ``concurrency``: the trace reordered for that many conversations in flight (replays and
    optimum alike)."""
    requests = trace_requests(trace, limit, concurrency)
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
        concurrency=concurrency or 0,
    )
    if tier:
        result.tier, result.fixed_pool_blocks = tier, pool_blocks
        result.unit = (
            f"tier {tier} capacities in blocks of block.bytes, pool fixed at {pool_blocks} blocks"
        )
    for n in sizes if sizes is not None else auto_sizes(distinct):
        # Each size starts cold: a tenant of its own, so that blocks a persistent tier kept from
        # the previous size are not found (and its fs directories removed afterwards).
        cold = dataclasses.replace(config, tenant=f"{config.tenant}.sweep-{uuid.uuid4().hex[:12]}")
        try:
            replay = simulate(
                with_tier_capacity(cold, tier, n) if tier else cold,
                trace,
                pool_blocks=pool_blocks if tier else n,
                payload_bytes=payload_bytes,
                limit=limit,
                progress=progress,
                concurrency=concurrency,
            )
        finally:
            _remove_fs_blocks(cold)
        if replay.mismatched_blocks:
            raise KVTierError(f"pool of {n} blocks: {replay.mismatched_blocks} payload mismatches")
        best = optimal_hit_ratio(requests, n + pool_blocks if tier else n)
        result.points.append(
            SweepPoint(
                n, replay.hit_ratio, best.hit_ratio, replay.hit_blocks, _evictions(replay, tier)
            )
        )
    return result


def with_tier_capacity(config: KVTierConfig, name: str, blocks: int) -> KVTierConfig:
    """``config`` with tier ``name`` given ``blocks`` blocks of ``block.bytes``."""
    tiers = list(config.tiers)
    for i, tier in enumerate(tiers):
        if tier.name == name:
            if not hasattr(tier.options, "capacity"):
                raise ConfigError("--sweep-tier", name, "a tier with a capacity (fs, memory)")
            options = dataclasses.replace(tier.options, capacity=blocks * config.block.bytes)
            if hasattr(options, "capacity_blocks"):
                options = dataclasses.replace(options, capacity_blocks=None)
            tiers[i] = dataclasses.replace(tier, options=options)
            return dataclasses.replace(config, tiers=tuple(tiers))
    known = ", ".join(t.name for t in tiers) or "none (add one with --tier)"
    raise ConfigError("--sweep-tier", name, f"the name of a configured tier: {known}")


def _remove_fs_blocks(config: KVTierConfig) -> None:
    """Delete the namespace directories a sweep point's file tiers wrote (nothing else)."""
    namespace = simulation_namespace(config).hex
    for tier in config.tiers:
        path = getattr(tier.options, "path", None)
        if isinstance(path, str):
            shutil.rmtree(os.path.join(path, namespace), ignore_errors=True)


def _evictions(replay: ReplayResult, tier: str) -> int:
    return next((t.evictions for t in replay.tiers if t.name == (tier or "pool")), 0)


def format_sweep(r: SweepResult) -> str:
    order = f", {r.concurrency} conversations in flight" if r.concurrency else ""
    lines = [
        f"trace       {r.trace}: {r.requests} requests{order}, {r.blocks} blocks, "
        f"{r.distinct_blocks} distinct",
        f"policy      {r.policy}; tiers behind the pool: {', '.join(r.tiers) or 'none'}",
        f"unit        {r.unit} ({format_size(r.block_bytes)} each)",
        "",
        f"{r.swept + ' blocks':>12}{'size':>12}{'hit ratio':>11}{'optimum':>10}"
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


def plotting() -> Any:
    """matplotlib's pyplot (the Agg backend), or the ``KVTierError`` with the install hint. The
    command line asks before the sweep starts, so a missing matplotlib costs no replay."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise KVTierError(
            f"the sweep's plot needs matplotlib: {install_hint('plot')} (or leave out --sweep-png)"
        ) from None
    return plt


def write_png(r: SweepResult, path: Path) -> None:
    """The curve, the optimum and the ceiling over pool size (log scale)."""
    plt = plotting()
    xs = [p.pool_blocks for p in r.points]
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    ax.plot(xs, [p.hit_ratio for p in r.points], "o-", label=f"kvtier ({r.policy})")
    ax.plot(xs, [p.optimal_hit_ratio for p in r.points], "s--", label="offline optimum (bound)")
    ax.axhline(r.ceiling, color="grey", linestyle=":", label=f"ceiling {r.ceiling:.3f}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{r.swept} size, blocks of {format_size(r.block_bytes)}")
    ax.set_ylabel("hit ratio (blocks)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{r.trace}: {r.requests} requests")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
