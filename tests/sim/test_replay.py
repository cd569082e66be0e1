"""Trace replay through the real manager, checked against independent reference computations."""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvtier.cache.factory import build_cache
from kvtier.config import load_config
from kvtier.keys import BlockKey
from kvtier.sim.replay import Replayer, ReplayResult
from kvtier.sim.simulate import simulate, simulation_namespace
from kvtier.sim.trace import bundled_trace_path, read_trace

# -- independent references (no kvtier code) -----------------------------------------------------


def reference_lru(requests: Iterable[Sequence[int]], capacity: int) -> tuple[int, int, int]:
    """(hit blocks, stored blocks, all blocks): a hit is the leading run of ids present; then every
    id of the request is stored: present ones are touched, missing ones inserted, each evicting
    the least recently used id when full; both deepest first, as the manager does."""
    lru: OrderedDict[int, None] = OrderedDict()
    hits = stored = total = 0
    for ids in requests:
        total += len(ids)
        for h in ids:
            if h not in lru:
                break
            hits += 1
        missing = []
        for h in reversed(ids):
            if h in lru:
                lru.move_to_end(h)
            else:
                missing.append(h)
        for h in missing:
            if len(lru) >= capacity:
                lru.popitem(last=False)
            lru[h] = None
            stored += 1
    return hits, stored, total


def reference_unbounded(requests: Iterable[Sequence[int]]) -> tuple[int, int]:
    """(hit blocks, all blocks) when nothing is ever evicted (an unbounded secondary tier)."""
    seen: set[int] = set()
    hits = total = 0
    for ids in requests:
        total += len(ids)
        for h in ids:
            if h not in seen:
                break
            hits += 1
        seen.update(ids)
    return hits, total


def trace_ids(limit: int | None = None) -> list[list[int]]:
    out = []
    with bundled_trace_path().open() as f:
        for line in f:
            out.append(json.loads(line)["hash_ids"])
            if limit is not None and len(out) == limit:
                break
    return out


def write_trace(path: Path, requests: Sequence[Sequence[int]]) -> Path:
    with path.open("w") as f:
        for i, ids in enumerate(requests):
            f.write(
                json.dumps(
                    {
                        "timestamp": i,
                        "input_length": 512 * len(ids),
                        "output_length": 1,
                        "hash_ids": list(ids),
                    }
                )
                + "\n"
            )
    return path


def run(
    trace: Path, pool_blocks: int, payload_bytes: int = 256, limit: int | None = None, **config: Any
) -> ReplayResult:
    return simulate(
        load_config(config),
        trace,
        pool_blocks=pool_blocks,
        payload_bytes=payload_bytes,
        limit=limit,
    )


def by_tier(result: ReplayResult) -> dict[str, int]:
    return {t.name: t.hit_blocks for t in result.tiers}


def assert_consistent(result: ReplayResult) -> None:
    assert result.mismatched_blocks == 0
    assert result.failed_loads == 0
    assert result.pending_timeouts == 0 and result.drain_timeouts == 0
    assert sum(by_tier(result).values()) == result.hit_blocks
    assert result.hit_ratio == pytest.approx(result.hit_blocks / result.blocks)


# -- the bundled trace -----------------------------------------------------------------------------


def test_acceptance_lru_4000_blocks_on_bundled_trace() -> None:
    result = run(bundled_trace_path(), pool_blocks=4000, eviction="lru")
    expected_hits, expected_stored, total = reference_lru(trace_ids(), 4000)
    assert (result.requests, result.blocks) == (3993, total) == (3993, 121877)
    assert result.hit_blocks == expected_hits
    assert result.hit_ratio == pytest.approx(0.2345, abs=0.001)
    assert_consistent(result)
    assert by_tier(result) == {"pool": expected_hits}
    assert result.stored_blocks == expected_stored
    pool = result.tiers[0]
    assert pool.evictions == result.stored_blocks - 4000
    assert pool.read_bytes == expected_hits * result.block_bytes


@pytest.mark.parametrize("capacity", [300, 1500])
def test_lru_matches_reference_at_other_capacities(capacity: int) -> None:
    result = run(bundled_trace_path(), pool_blocks=capacity, eviction="lru")
    assert result.hit_blocks == reference_lru(trace_ids(), capacity)[0]
    assert_consistent(result)


def test_arc_runs_clean_and_differs_from_lru() -> None:
    lru = run(bundled_trace_path(), pool_blocks=1000, limit=1500, eviction="lru")
    arc = run(bundled_trace_path(), pool_blocks=1000, limit=1500, eviction="arc")
    assert_consistent(arc)
    assert arc.policy == "arc" and lru.policy == "lru"
    assert arc.hit_blocks != lru.hit_blocks
    assert arc.hit_blocks <= reference_unbounded(trace_ids(1500))[0]


# -- small traces with hand-computed results -------------------------------------------------------


def test_hand_computed_lru(tmp_path: Path) -> None:
    # cap 4, a request's blocks touched and stored deepest first: [1,2] miss (LRU order 2 1);
    # [1,2,3] hits 1,2 (2 1 3); [4,5] evicts 2 (1 3 5 4); [1,2] hits 1 and, storing 2, evicts 3.
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 2, 3], [4, 5], [1, 2]])
    result = run(trace, pool_blocks=4, eviction="lru")
    assert (result.requests, result.blocks, result.hit_blocks) == (4, 9, 2 + 1)
    assert result.stored_blocks == 2 + 1 + 2 + 1
    assert result.tiers[0].evictions == 2
    # 4 lookups + 4 prepare/complete_store + 4 hint_request + one prepare/complete_load for each
    # request with hits
    assert result.manager_ops == 4 + 8 + 4 + 2 * 2
    assert_consistent(result)


def test_hinted_evicts_a_requests_tail_before_its_prefix(tmp_path: Path) -> None:
    # The same trace with the default: at its hint [1,2,3] is touched again deepest first, so
    # [4,5] evicts 3, not 1, and [1,2] hits both (LRU: none).
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 2, 3], [4, 5], [1, 2]])
    result = run(trace, pool_blocks=4)
    assert result.hit_blocks == 2 + 2
    assert result.stored_blocks == 2 + 1 + 2 and result.tiers[0].evictions == 1
    assert_consistent(result)


def test_only_the_leading_run_hits(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2, 3], [9, 2, 3], [9, 2, 3], [1, 4, 3]])
    result = run(trace, pool_blocks=10)
    assert result.hit_blocks == 0 + 0 + 3 + 1
    assert result.stored_blocks == 5  # 1, 2, 3, 9, 4
    assert_consistent(result)


def test_request_longer_than_the_pool_keeps_its_leading_blocks(tmp_path: Path) -> None:
    # The manager gives the slots there are to the leading keys (the useful ones for a prefix).
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2, 3], [1, 2, 3]])
    result = run(trace, pool_blocks=2)
    # [1,2,3]: only 1 and 2 get slots. [1,2,3]: hits 1, 2; storing 3 evicts 1.
    assert result.hit_blocks == 2
    assert result.cache["cache"]["store_skipped_full"] == 1
    assert result.tiers[0].evictions == 1
    assert_consistent(result)


def test_admission_stores_on_second_offer(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 2], [1, 2]])
    result = run(trace, pool_blocks=10, admission={"min_seen": 2})
    assert result.hit_blocks == 2  # only the third request hits
    assert result.stored_blocks == 2
    assert result.admission_min_seen == 2
    assert result.cache["cache"]["store_skipped_admission"] == 2
    assert_consistent(result)


def test_secondary_hits_are_attributed_to_their_tier(tmp_path: Path) -> None:
    # Pool of 2: [3,4] evicts 1 and 2, which the memory tier got on store (write-through).
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2], [3, 4], [1, 2], [1, 2, 5]])
    result = run(trace, pool_blocks=2, tiers=[{"kind": "memory"}])
    # [1,2]: both from memory (promoted); [1,2,5]: 1 and 2 from the pool.
    assert by_tier(result) == {"pool": 2, "memory": 2}
    assert result.hit_blocks == 4
    memory = result.tiers[1]
    assert (memory.kind, memory.write) == ("memory", "through")
    assert memory.read_blocks == 2
    assert memory.written_blocks == 5  # 1, 2, 3, 4, 5
    assert memory.written_bytes == 5 * result.block_bytes
    assert_consistent(result)


# -- secondary tiers on the bundled trace ---------------------------------------------------------


def test_fs_tier_survives_restart(tmp_path: Path) -> None:
    limit = 200
    ids = trace_ids(limit)
    pool_blocks = max(len(r) for r in ids)  # every request fits: no store is ever skipped
    fs = {"kind": "fs", "path": str(tmp_path / "fs"), "capacity": "1TiB"}  # 16,384 blocks

    first = run(bundled_trace_path(), pool_blocks, limit=limit, tiers=[fs])
    # With an unbounded write-through tier nothing stored is ever lost.
    assert first.hit_blocks == reference_unbounded(ids)[0]
    assert by_tier(first)["fs"] > 0
    assert first.tiers[1].written_blocks == first.stored_blocks == len({h for r in ids for h in r})
    assert_consistent(first)

    # A new process (new pool, new cache) on the same directory: every block is found on disk.
    second = run(bundled_trace_path(), pool_blocks, limit=limit, tiers=[fs])
    assert second.hit_blocks == second.blocks
    assert by_tier(second)["fs"] > 0
    assert by_tier(second)["fs"] + by_tier(second)["pool"] == second.blocks
    assert second.tiers[1].corrupt == 0
    assert second.stored_blocks == 0
    assert_consistent(second)


@pytest.mark.parametrize("kind", ["fs", "memory"])
def test_tier_capacity_counts_blocks_of_block_bytes(tmp_path: Path, kind: str) -> None:
    # 4 GiB of 64 MiB blocks is 64 blocks, whatever the replay's real payload size: the tier
    # evicts at 64 blocks, as in an engine (it once held 4 GiB of 4 KiB payloads instead).
    tier: dict[str, Any] = {"kind": kind, "capacity": "4GiB"}
    if kind == "fs":
        tier["path"] = str(tmp_path / "fs")
    result = run(
        bundled_trace_path(), 100, limit=300, block={"tokens": 512, "bytes": "64MiB"}, tiers=[tier]
    )
    stats = result.tiers[1]
    assert stats.capacity_blocks == 64
    assert stats.written_blocks - stats.evictions <= 64 < stats.written_blocks
    if kind == "fs":
        assert len(list((tmp_path / "fs").rglob("*.kvb"))) <= 64
    assert_consistent(result)


def test_fs_tier_on_evict(tmp_path: Path) -> None:
    result = run(
        bundled_trace_path(),
        200,
        limit=200,
        tiers=[{"kind": "fs", "write": "on_evict", "path": str(tmp_path), "capacity": "1TiB"}],
    )
    assert result.tiers[1].write == "on_evict"
    assert by_tier(result)["fs"] > 0
    assert result.tiers[1].written_blocks <= result.tiers[0].evictions
    assert_consistent(result)


def test_memory_tier_with_injected_failures_stays_correct(tmp_path: Path) -> None:
    limit = 600
    faulty = {"kind": "memory", "failure_rate": 0.2, "corrupt_rate": 0.1, "seed": 7}
    result = run(bundled_trace_path(), 300, limit=limit, tiers=[faulty])
    memory = result.cache["tiers"]["memory"]
    cache = result.cache["cache"]
    assert memory["errors"] > 0 and memory["corrupt"] > 0
    assert cache["promotion_failures"] > 0 and cache["cascade_failures"] > 0
    assert result.tiers[1].errors == memory["errors"]
    assert result.tiers[1].corrupt == memory["corrupt"]
    assert by_tier(result)["memory"] > 0
    assert result.hit_blocks <= reference_unbounded(trace_ids(limit))[0]
    assert_consistent(result)  # above all: not one wrong payload
    # Faults are seeded and the replay waits for every job: the run is reproducible.
    again = run(bundled_trace_path(), 300, limit=limit, tiers=[faulty])
    assert (again.hit_blocks, again.cache) == (result.hit_blocks, result.cache)


def test_memory_tier_with_latency_and_overlap_stays_correct() -> None:
    slow = {"kind": "memory", "latency_ms": 2, "failure_rate": 0.1, "seed": 3}
    config = load_config({"tiers": [slow]})
    result = simulate(
        config, bundled_trace_path(), pool_blocks=300, payload_bytes=256, limit=300, overlap=True
    )
    assert result.overlap
    assert result.cache["tiers"]["memory"]["errors"] > 0
    assert_consistent(result)


# -- the payload check itself ---------------------------------------------------------------------


class WrongPayloads(Replayer):
    """Stores a wrong payload for every third key: the replay must notice each one it loads."""

    def write_payload(self, key: BlockKey, slot: int) -> None:
        super().write_payload(key, slot)
        if key[0] % 3 == 0:
            self.pool.view(slot)[0] ^= 0xFF


def test_payload_check_catches_wrong_data() -> None:
    config = load_config({"pool": {"size": 2000 * 256}})
    ns = simulation_namespace(config)
    pool, cache = build_cache(config, ns, 256)
    try:
        replayer = WrongPayloads(cache, pool, ns)
        result = replayer.run(read_trace(bundled_trace_path(), 500))
    finally:
        cache.close()
        pool.close()
    assert result.hit_blocks > 100
    assert 0 < result.mismatched_blocks < result.hit_blocks
    assert result.cache["cache"]["load_failed"] >= result.mismatched_blocks


def test_on_evict_with_full_writeback_window_keeps_stores_when_the_pool_is_full(
    tmp_path: Path,
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", [[1, 2], [3, 4], [3, 4], [1, 2]])
    through = run(trace, pool_blocks=2, tiers=[{"kind": "memory", "write": "through"}])
    assert through.hit_blocks == 4  # [3,4] from the pool, [1,2] promoted from memory
    on_evict = run(
        trace,
        pool_blocks=2,
        pool={"writeback_window": 1.0},
        tiers=[{"kind": "memory", "write": "on_evict"}],
    )
    assert on_evict.cache["cache"]["store_skipped_full"] == 0
    assert on_evict.hit_blocks == through.hit_blocks
    # Without write-back, evicted blocks hold their slots until copied: the evicting store loses.
    no_window = run(
        trace,
        pool_blocks=2,
        pool={"writeback_window": 0.0},
        tiers=[{"kind": "memory", "write": "on_evict"}],
    )
    assert no_window.cache["cache"]["store_skipped_full"] > 0
    assert_consistent(no_window)


def test_on_evict_hit_ratio_matches_write_through_on_the_bundled_trace() -> None:
    trace = bundled_trace_path()
    through = run(trace, pool_blocks=600, limit=1500, tiers=[{"kind": "memory"}])
    on_evict = run(
        trace, pool_blocks=600, limit=1500, tiers=[{"kind": "memory", "write": "on_evict"}]
    )
    assert_consistent(on_evict)
    assert on_evict.hit_blocks > 0.99 * through.hit_blocks
    written = on_evict.cache["cache"]["cascade_writes"]
    assert 0 < written <= through.cache["cache"]["cascade_writes"]


def test_an_unreachable_on_evict_tier_neither_stalls_nor_spins(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: write-back resubmitted every rejected copy each step, so the drain after each
    request spun a core for 2 x job_timeout_s (4 s here) without a word; now it pauses
    write-back and says which tier fails."""
    import socket
    import time

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    tier = {"kind": "redis", "url": f"redis://127.0.0.1:{port}", "write": "on_evict"}
    wall0, cpu0 = time.monotonic(), time.process_time()
    with caplog.at_level(logging.WARNING):
        result = run(bundled_trace_path(), 16, limit=200, tiers=[tier], job_timeout_s=2)
    wall, cpu = time.monotonic() - wall0, time.process_time() - cpu0
    assert result.drain_timeouts == 0 and result.mismatched_blocks == 0
    assert wall < 2.0 and cpu < 2.0
    assert "tier redis: 4 of 4 block copies failed; write-back paused" in caplog.text
