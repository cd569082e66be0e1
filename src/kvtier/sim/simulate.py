"""``kvtier simulate``: build a cache from a config and replay a trace through it."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from kvtier.cache.factory import build_cache
from kvtier.cache.manager import TieredCache
from kvtier.config import KVTierConfig
from kvtier.keys import Namespace
from kvtier.sim.conversations import trace_requests
from kvtier.sim.replay import Replayer, ReplayResult
from kvtier.tiers.payload import HEADER_BYTES

SIMULATE_MODEL = "kvtier-simulate"
DEFAULT_PAYLOAD_BYTES = 4096


def simulation_namespace(config: KVTierConfig) -> Namespace:
    """The namespace of simulated blocks: stable, so a second run finds what a first one stored
    in a persistent tier."""
    return Namespace(
        model=config.model or SIMULATE_MODEL,
        dtype="simulated",
        block_tokens=config.block.tokens,
        tenant=config.tenant,
    )


def tiers_in_blocks(
    config: KVTierConfig, payload_bytes: int
) -> tuple[KVTierConfig, dict[str, int]]:
    """Tier capacities in the pool's unit: a tier given ``capacity`` bytes holds
    ``capacity // block.bytes`` blocks in the engine, so in the replay, whose blocks are
    ``payload_bytes`` real bytes, it gets room for that many blocks of its own size (a block file
    is its header plus the payload; a tier counting blocks gets the count). Returns the config
    the replay uses and each capacity-bounded tier's capacity in blocks."""
    tiers = []
    blocks_of: dict[str, int] = {}
    for tier in config.tiers:
        options = tier.options
        capacity = getattr(options, "capacity", None)
        if isinstance(capacity, int):
            blocks = max(1, capacity // config.block.bytes)
            blocks_of[tier.name] = blocks
            if hasattr(options, "capacity_blocks"):
                options = dataclasses.replace(options, capacity=None, capacity_blocks=blocks)
            else:
                options = dataclasses.replace(
                    options, capacity=blocks * (HEADER_BYTES + payload_bytes)
                )
            tier = dataclasses.replace(tier, options=options)
        tiers.append(tier)
    return dataclasses.replace(config, tiers=tuple(tiers)), blocks_of


def simulate(
    config: KVTierConfig,
    trace: str | Path,
    *,
    pool_blocks: int,
    payload_bytes: int = DEFAULT_PAYLOAD_BYTES,
    limit: int | None = None,
    overlap: bool = False,
    progress: bool = False,
    on_request: Callable[[TieredCache], object] | None = None,
    concurrency: int | None = None,
) -> ReplayResult:
    """Replay ``trace`` through a ``TieredCache`` built from ``config`` with ``pool_blocks`` slots
    of ``payload_bytes`` real bytes each (``config.block.bytes`` counts as each block's logical
    size for bytes moved). ``on_request`` sees the cache after each request (metrics).
    ``concurrency``: the trace's requests in the order that many conversations in flight send
    them (``sim/conversations.py``); None: trace order."""
    requests = trace_requests(trace, limit, concurrency)
    # The pool really allocates payload_bytes per block: a simulated 64 MiB block costs 4 KiB.
    # Tier capacities follow in the same unit (blocks of block.bytes).
    scaled, tier_blocks = tiers_in_blocks(config, payload_bytes)
    sized = dataclasses.replace(
        scaled, pool=dataclasses.replace(config.pool, size=pool_blocks * payload_bytes)
    )
    pool, cache = build_cache(sized, simulation_namespace(config), payload_bytes)
    try:
        replayer = Replayer(
            cache,
            pool,
            simulation_namespace(config),
            tier_labels={t.name: (t.kind, t.write.value) for t in config.tiers},
            block_bytes=config.block.bytes,
            pending_timeout_s=max(2 * config.job_timeout_s, 1.0),
            overlap=overlap,
            trace_name=Path(trace).name,
        )
        replayer.tier_capacity_blocks = tier_blocks
        replayer.result.policy = config.eviction
        replayer.result.admission_min_seen = config.admission.min_seen
        replayer.result.concurrency = concurrency or 0
        with tqdm(
            total=len(requests),
            unit="req",
            file=sys.stderr,
            disable=not progress,
            desc="simulate",
            dynamic_ncols=True,
        ) as bar:

            def after_request() -> None:
                bar.update(1)
                if on_request is not None:
                    on_request(cache)

            return replayer.run(requests, on_request=after_request)
    finally:
        cache.close()
        pool.close()
