"""kvtier's stats through vLLM's interfaces (TP=2 rig of ``test_vllm_tp``, vLLM's own output
aggregator): per-step increments merged over ranks and halves, Prometheus series, the log line's
summary and prefix-cache hits by source."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support import require

require.importorskip("vllm", "vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

from integrations.vllm import test_vllm_tp  # noqa: E402
from integrations.vllm.test_vllm_tp import (  # noqa: E402
    A_BLOCKS,
    B_BLOCKS,
    BLOCK_TOKENS,
    C_BLOCKS,
    OTHER,
    PART,
    PROMPT,
    TP,
    FakeBlocks,
    Rig,
    store_prompt,
)
from kvtier import series  # noqa: E402
from kvtier.integrations.vllm import KVTierConnector  # noqa: E402
from kvtier.integrations.vllm import scheduler as scheduler_side  # noqa: E402
from kvtier.integrations.vllm.stats import KVTierStats  # noqa: E402

make_rig = test_vllm_tp.make_rig  # the fixture


def merged(rig: Rig) -> dict[str, Any]:
    out = series.empty_payload()
    for stats in rig.step_stats:
        if stats is not None:
            out = series.merge(out, stats.data)
    return out


def registry_types(registry: CollectorRegistry) -> dict[type, type]:
    """vLLM's metric classes, bound to a private registry."""

    def bind(base: type) -> type:
        class Bound(base):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, registry=registry, **kwargs)

        return Bound

    return {Counter: bind(Counter), Gauge: bind(Gauge), Histogram: bind(Histogram)}


def settle(rig: Rig) -> None:
    """Let the tier jobs in flight end (the fs tier runs them on its own threads)."""
    cache = rig.scheduler._scheduler.cache
    deadline = time.monotonic() + 10
    while cache.jobs_in_flight and time.monotonic() < deadline:
        cache.wait(0.05)
    assert not cache.jobs_in_flight


def test_step_stats_add_up_to_the_snapshot_and_count_both_ranks_copies(make_rig: Any) -> None:
    rig = make_rig()
    store_prompt(rig)
    rig.add("B", PROMPT)
    assert rig.admit("B", B_BLOCKS) == 3 * BLOCK_TOKENS
    rig.run({"B": len(PROMPT) - 3 * BLOCK_TOKENS})
    total = merged(rig)
    snap = rig.stats()
    c = total["counters"]
    assert c["kvtier_stored_blocks"] == {"": snap["cache"]["stored_blocks"]} == {"": 3}
    assert c["kvtier_loaded_blocks"] == {"": 3}
    assert c["kvtier_hit_blocks"] == {"pool": 3} and snap["hits_by_tier"] == {"pool": 3}
    assert c["kvtier_hit_tokens"] == {"": 3 * BLOCK_TOKENS}
    assert c["kvtier_lookup_blocks"] == {"": snap["cache"]["lookup_blocks"]}
    # Worker copies, summed over both ranks: 3 slots of PART bytes each per rank and direction.
    assert c["kvtier_copy_bytes"] == {"store": TP * 3 * PART, "load": TP * 3 * PART}
    assert c["kvtier_copy_jobs"] == {"store": TP, "load": TP}
    assert c["kvtier_copy_seconds"]["load"] > 0 and c["kvtier_copy_seconds"]["store"] > 0
    assert len(total["histograms"]["kvtier_load_seconds"][""]) == TP  # one per rank
    assert total["gauges"]["kvtier_pool_used_slots"] == {"": 3}
    assert total["gauges"]["kvtier_pool_slots"] == {"": 8}
    series.check_payload(total)
    # Increments, not totals: with nothing new, the next step has nothing to say.
    assert rig.scheduler.get_kv_connector_stats() is None
    assert all(w.get_kv_connector_stats() is None for w in rig.workers)
    rig.finish("A", "B")


def test_stats_are_taken_at_most_every_interval_while_requests_are_in_flight(
    make_rig: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM asks every step; a payload cost 220-400 us of the H100's slowest scheduler steps.
    Skipped steps lose nothing: their increments come in the next payload, and the step that
    finished the last request in flight reports at once."""
    rig = make_rig()
    monkeypatch.setattr(scheduler_side, "STATS_INTERVAL_S", 0.1)
    side = rig.scheduler._scheduler
    now = [1000.0]
    side.clock = lambda: now[0]
    store_prompt(rig)  # A in flight; its step's payload is the first: taken
    rig.add("B", PROMPT)
    assert rig.admit("B", B_BLOCKS) == 3 * BLOCK_TOKENS
    now[0] += 0.05
    rig.run({"B": len(PROMPT) - 3 * BLOCK_TOKENS})  # within the interval: skipped
    assert rig.step_stats[0] is not None and rig.step_stats[-1] is not None
    assert "kvtier_loaded_blocks" not in merged(rig)["counters"]  # the workers' stats only
    now[0] += 0.06
    rig.run({})  # the interval passed: B's lookup and load come now
    assert merged(rig)["counters"]["kvtier_loaded_blocks"] == {"": 3}
    rig.add("C", PROMPT)
    assert rig.admit("C", C_BLOCKS) == 3 * BLOCK_TOKENS
    rig.finish("A", "B")
    rig.run({"C": len(PROMPT) - 3 * BLOCK_TOKENS})  # C in flight, within the interval
    assert merged(rig)["counters"]["kvtier_loaded_blocks"] == {"": 3}
    rig.finish("C")
    rig.run({})  # nothing in flight: at once, with everything since
    total, snap = merged(rig)["counters"], rig.stats()
    assert total["kvtier_loaded_blocks"] == {"": snap["cache"]["loaded_blocks"]} == {"": 6}
    assert total["kvtier_lookup_blocks"] == {"": snap["cache"]["lookup_blocks"]}
    assert total["kvtier_requests_looked_up"] == {"": 3}


def test_prometheus_series_and_log_summary(make_rig: Any) -> None:
    rig = make_rig()
    store_prompt(rig)
    rig.add("B", PROMPT)
    rig.admit("B", B_BLOCKS)
    rig.run({"B": len(PROMPT) - 3 * BLOCK_TOKENS})
    registry = CollectorRegistry()
    labels = {"model_name": "tiny", "engine": "0"}
    prom = KVTierConnector.build_prom_metrics(
        SimpleNamespace(kv_transfer_config=None),
        registry_types(registry),
        list(labels),
        {0: list(labels.values())},
    )
    # As vLLM's front end: rebuild each step's payload from its dict, then record it.
    for stats in rig.step_stats:
        if stats is not None:
            rebuilt = KVTierConnector.build_kv_connector_stats(stats.to_dict())
            prom.observe(rebuilt.data, engine_idx=0)

    def value(name: str, **extra: str) -> float | None:
        return registry.get_sample_value(name, {**labels, **extra})

    assert value("vllm:kvtier_stored_blocks_total") == 3
    assert value("vllm:kvtier_hit_blocks_total", tier="pool") == 3
    assert value("vllm:kvtier_copy_bytes_total", direction="load") == TP * 3 * PART
    assert value("vllm:kvtier_pool_used_slots") == 3
    assert value("vllm:kvtier_load_seconds_count") == TP
    assert value("vllm:kvtier_promotion_wait_seconds_count") == 0  # present before any sample
    assert value("vllm:kvtier_store_failed_blocks_total") == 0

    interval = KVTierStats()
    for stats in rig.step_stats:
        if stats is not None:
            interval = interval.aggregate(stats)
    line = interval.reduce()
    assert line["kvtier_lookup_blocks"] == 6 and line["kvtier_hit_ratio"] == 0.5  # A missed
    assert line["kvtier_hits_pool"] == 3 and line["kvtier_hit_tokens"] == 3 * BLOCK_TOKENS
    assert line["kvtier_load_GiB"] >= 0 and "kvtier_load_GiB_per_s" in line
    assert line["kvtier_failures"] == 0
    assert line["kvtier_pool_used"] == pytest.approx(3 / 8, abs=1e-3)
    rig.finish("A", "B")


def test_hits_split_by_source_pool_as_host_fs_as_disk(make_rig: Any, tmp_path: Path) -> None:
    fs = {"kind": "fs", "name": "disk0", "path": str(tmp_path / "fs"), "capacity": "1MiB"}
    rig = make_rig(pool_slots=3, tiers=[fs])
    store_prompt(rig)  # A: 3 blocks in the pool, written through to fs
    settle(rig)
    rig.add("O", OTHER)
    rig.admit("O", C_BLOCKS)
    rig.run({"O": len(OTHER)})  # evicts A's blocks from the 3-slot pool
    settle(rig)
    rig.add("B", PROMPT)
    assert rig.matched("B") is None  # promoting from fs: ask again
    settle(rig)
    rig.run({})  # an engine step collects the promotion
    found = rig.matched("B")
    assert found == 3 * BLOCK_TOKENS
    request = rig.requests["B"]
    rig.scheduler.update_state_after_alloc(request, FakeBlocks(B_BLOCKS), found)
    rig.tables["B"] = B_BLOCKS
    sources = rig.scheduler.get_external_cache_hit_sources(request, found)
    assert sources == {CacheHitSource.DISK: 3 * BLOCK_TOKENS}
    request.num_computed_tokens = found
    rig.run({"B": len(PROMPT) - found})
    total = merged(rig)
    assert total["counters"]["kvtier_hit_blocks"] == {"disk0": 3}
    assert total["counters"]["kvtier_deferred_lookups"] == {"": 1}
    assert total["counters"]["kvtier_read_blocks"]["disk0"] == 3
    (wait,) = total["histograms"]["kvtier_promotion_wait_seconds"][""]
    assert 0 < wait < 10
    assert rig.stats()["hits_by_tier"] == {"pool": 0, "disk0": 3}
    assert rig.stats()["hit_tokens_by_tier"] == {"pool": 0, "disk0": 3 * BLOCK_TOKENS}
    # Asked twice (vLLM asks once): the split was handed over, a second answer is unspecified.
    again = rig.scheduler.get_external_cache_hit_sources(request, found)
    assert again == {CacheHitSource.EXTERNAL_UNSPECIFIED: found}
    rig.finish("A", "O", "B")


def test_pool_hit_after_vllm_own_prefix_counts_only_loaded_tokens(make_rig: Any) -> None:
    rig = make_rig()
    store_prompt(rig)
    rig.add("B", PROMPT)
    request = rig.requests["B"]
    # vLLM's own cache holds the first engine block (4 tokens) of the first kvtier block.
    external, _ = rig.scheduler.get_num_new_matched_tokens(request, 4)
    assert external == 3 * BLOCK_TOKENS - 4
    rig.scheduler.update_state_after_alloc(request, FakeBlocks(B_BLOCKS), external)
    sources = rig.scheduler.get_external_cache_hit_sources(request, external)
    assert sources == {CacheHitSource.HOST: external}
    assert rig.stats()["connector"]["engine_hit_blocks"] == 0  # 4 tokens: no whole block
    # vLLM holds every block kvtier could offer: nothing to look up, all counted as its hits.
    rig.add("C", PROMPT)
    assert rig.scheduler.get_num_new_matched_tokens(rig.requests["C"], 3 * BLOCK_TOKENS) == (
        0,
        False,
    )
    assert rig.stats()["connector"]["engine_hit_blocks"] == 3
    assert A_BLOCKS  # the rig's tables stay as stored
    rig.finish("A", "B")
