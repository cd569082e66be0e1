"""End to end: two vLLM engines (CPU build), each in its own process, share one kvtier pool
(``pool.share``). Engine B's requests on prefixes that only engine A computed are hits, with
outputs identical to vLLM alone, and the pool's file is gone once both engines exited.

A runs first and stays up (holding the pool) while B runs: B's only source of those blocks is
A's. Each engine's stats file carries its line of the shared pool's table (``share``)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from support import require

pytestmark = [
    pytest.mark.e2e,
    require.unless("vllm", require.vllm_missing()),
    pytest.mark.timeout(420),
]

if require.vllm_missing() is None:
    from e2e import vllm_harness as h
    from e2e import vllm_jobs as jobs

Ref = dict[str, list[list[int]]]
A_SETS = ["prefix_only", "basic"]
B_SETS = ["shared", "basic"]


def _wait_for(path: Path, proc: subprocess.Popen[str], seconds: float) -> None:
    """Until ``path`` exists; fails at once with A's output if A exited first."""
    end = time.monotonic() + seconds
    while not path.exists():
        if proc.poll() is not None:
            h.finish_fresh_process(proc)  # raises with A's output
            raise AssertionError("engine A exited before it was ready")
        assert time.monotonic() < end, f"engine A not ready after {seconds} s"
        time.sleep(0.2)


def _wait_empty(directory: Path, seconds: float = 15.0) -> list[str]:
    """What is left in ``directory`` once it emptied or ``seconds`` passed (the pool reaper
    removes the file when the last user is gone)."""
    end = time.monotonic() + seconds
    while any(directory.iterdir()) and time.monotonic() < end:
        time.sleep(0.1)
    return sorted(p.name for p in directory.iterdir())


def test_engine_b_hits_what_engine_a_computed(
    model_dir: Path, reference: Ref, tmp_path: Path
) -> None:
    shm_dir, hold = tmp_path / "shm", tmp_path / "hold"
    shm_dir.mkdir()
    hold.mkdir()
    extra_a = jobs.shared_pool_config(tmp_path / "a.json", shm_dir, "e2e")
    extra_b = jobs.shared_pool_config(tmp_path / "b.json", shm_dir, "e2e")
    job = "e2e.vllm_jobs:serve_shared"
    a = h.start_fresh_process(job, str(model_dir), extra_a, A_SETS, str(hold))
    try:
        _wait_for(hold / "ready", a, 240)
        pool_files = [p.name for p in shm_dir.iterdir()]
        assert len(pool_files) == 1 and pool_files[0].startswith("kvtier-pool-share-e2e-")
        b = h.run_in_fresh_process(job, str(model_dir), extra_b, B_SETS, timeout=240)
    finally:
        (hold / "release").touch()
        result_a = h.finish_fresh_process(a, timeout=120)
    assert result_a["outputs"] == [reference[name] for name in A_SETS]
    assert b["outputs"] == [reference[name] for name in B_SETS]

    prefix_blocks = len(jobs.SHARED_PREFIX) // jobs.BLOCK_TOKENS  # 8
    basic_blocks = sum(len(p) // jobs.BLOCK_TOKENS for p in jobs.PROMPT_SETS["basic"])  # 27
    share_a, share_b = result_a["stats"]["share"], b["stats"]["share"]
    assert share_a["stored"] >= prefix_blocks + basic_blocks, share_a
    assert share_a["hits_others"] == 0, share_a  # B started after A was done
    # Every block of B's prompts that A stored was a hit on A's block: the 8-block prefix (each
    # of the 4 requests may pin it) and the 27 blocks of "basic".
    assert share_b["hits_others"] >= prefix_blocks + basic_blocks, share_b
    assert share_b["engine"] != share_a["engine"], (share_a, share_b)
    cache_b = b["stats"]["cache"]
    assert cache_b["loaded_blocks"] >= prefix_blocks + basic_blocks, cache_b
    hit_tokens = b["stats"]["connector"]["hit_tokens"]
    assert hit_tokens >= (prefix_blocks + basic_blocks) * jobs.BLOCK_TOKENS, b["stats"]
    assert b["stats"]["pool_pinned"] == 0 and b["stats"]["jobs_in_flight"] == 0
    assert _wait_empty(shm_dir) == []  # no kvtier file once both engines exited


def test_engine_b_hits_from_the_shared_fs_tier_what_the_pool_evicted(
    model_dir: Path, reference: Ref, tmp_path: Path
) -> None:
    """Both engines name one fs tier behind the shared pool, and the pool holds 12 blocks: A's
    prefix leaves the pool while A computes "basic", and B's hits on it come from the fs tier
    (read into the shared pool), with outputs identical to vLLM alone. Each block is written to
    the tier once, by the engine that stored it."""
    shm_dir, hold, fs = tmp_path / "shm", tmp_path / "hold", tmp_path / "fs"
    shm_dir.mkdir()
    hold.mkdir()
    extras = []
    for name in ("a", "b"):
        extra = jobs.shared_pool_config(tmp_path / f"{name}.json", shm_dir, "e2e-fs")
        extra["pool"]["size"] = 12 * jobs.BLOCK_BYTES
        # Every block found is promoted and waited for: with the cost model's deadline (two
        # engine steps here) B once took 4 of the 8 on a loaded 2-core machine, the rest
        # computed; that rule has tests of its own.
        extra["pool"]["promotion_costs"] = False
        extra["tiers"] = [{"kind": "fs", "path": str(fs), "capacity": "256MiB"}]
        extras.append(extra)
    job = "e2e.vllm_jobs:serve_shared"
    a = h.start_fresh_process(job, str(model_dir), extras[0], A_SETS, str(hold))
    try:
        _wait_for(hold / "ready", a, 240)
        names = sorted(p.name[: len("kvtier-pool-fs-")] for p in shm_dir.iterdir())
        assert names == ["kvtier-pool-fs-", "kvtier-pool-sha"]  # the pool and the tier's index
        b = h.run_in_fresh_process(job, str(model_dir), extras[1], B_SETS, timeout=240)
    finally:
        (hold / "release").touch()
        result_a = h.finish_fresh_process(a, timeout=120)
    assert result_a["outputs"] == [reference[name] for name in A_SETS]
    assert b["outputs"] == [reference[name] for name in B_SETS]

    prefix_blocks = len(jobs.SHARED_PREFIX) // jobs.BLOCK_TOKENS  # 8
    fs_a, fs_b = result_a["stats"]["tiers"]["fs"], b["stats"]["tiers"]["fs"]
    assert b["stats"]["promoted"]["fs"] >= prefix_blocks, b["stats"]
    assert fs_b["read_blocks"] >= prefix_blocks and fs_b["corrupt"] == 0, fs_b
    assert b["stats"]["cache"]["loaded_blocks"] >= prefix_blocks, b["stats"]["cache"]
    files = [p for p in fs.rglob("*.kvb") if p.is_file()]
    assert len(files) == fs_a["write_blocks"] + fs_b["write_blocks"]  # none written twice
    assert not list(fs.rglob("*.tmp"))
    assert _wait_empty(shm_dir) == []  # the pool's file and the tier index's: both gone
