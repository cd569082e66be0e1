"""Engines in separate processes sharing a pool and the fs tier behind it (one directory, one
budget, one index): a block one engine stored and the pool evicted is a hit for another from the
fs tier with the right bytes; the budget holds with every engine writing; an engine SIGKILLed at
random points (its block files written in chunks, so kills land mid-write) leaves no half-written
visible file and nothing counted that is not there once the next engine reaped it; the chaos run
with the fs tier: no wrong payload.

The engines are ``support.shared_engine`` (the kvtier API as a planner drives it; blocks whose
bytes are a function of their key)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.drivers import wait_for
from support.shared_engine import (
    FILE_BYTES,
    Served,
    open_cache,
    payload,
    prompt_keys,
    serve,
)

from kvtier.cache.shared import SharedTieredCache
from kvtier.shared_pool.layout import WRITING
from kvtier.tiers.fs.share_index import DELETING
from kvtier.tiers.fs.shared import SharedFsTier
from kvtier.tiers.payload import HEADER_BYTES

TESTS = Path(__file__).resolve().parents[1]
SLOTS = 16
FS_FILES = 40


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    shm = tmp_path / "shm"
    shm.mkdir()
    return shm, tmp_path / "fs"


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _engine(
    shm: Path, fs: Path, seconds: float, seed: str, prompts: int = 24
) -> subprocess.Popen[str]:
    args = [str(shm), str(SLOTS), str(seconds), seed, str(prompts), str(fs), str(FS_FILES)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "support.shared_engine", *args],
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "running"
    return proc


def _tier(cache: SharedTieredCache) -> SharedFsTier:
    tier = cache._tiers[0]
    assert isinstance(tier, SharedFsTier)
    return tier


def _files(fs: Path, suffix: str = ".kvb") -> list[Path]:
    return [p for p in fs.glob(f"*/*/*{suffix}") if p.is_file()]


def _settled(cache: SharedTieredCache) -> None:
    """Reap the dead and wait until what they left is cleaned up."""
    tier = _tier(cache)
    index = tier.share_index

    def clean() -> bool:
        cache.step()
        index.reap_dead()
        return not index.orphans and not index.holds_entries() and not cache.jobs_in_flight

    wait_for(clean, what="the dead engines' entries cleaned up")


def _check_directory(cache: SharedTieredCache, fs: Path) -> None:
    """No temp file, every block file whole and right, counted exactly once."""
    tier = _tier(cache)
    assert _files(fs, ".tmp") == []
    block_files = _files(fs)
    for path in block_files:
        key = bytes.fromhex(path.name.removesuffix(".kvb"))
        data = path.read_bytes()
        assert len(data) == FILE_BYTES and data[HEADER_BYTES:] == payload(key), path
    assert len(block_files) == tier.used_bytes // FILE_BYTES <= FS_FILES
    tier.check_invariants(settled=True)


def _stopped(pid: int) -> bool:
    """Every thread of the process is stopped (a signal is delivered some time after it is sent)."""
    tasks = Path(f"/proc/{pid}/task")
    states = [(t / "stat").read_text().rsplit(")", 1)[1].split()[0] for t in tasks.iterdir()]
    return all(state in "tT" for state in states)


def _wait_empty(shm: Path, seconds: float = 10.0) -> list[str]:
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(shm.iterdir()):
        time.sleep(0.05)
    return [p.name for p in shm.iterdir()]


def test_a_block_another_process_stored_is_a_hit_from_the_fs_tier(dirs):
    shm, fs = dirs
    pool, cache = open_cache(str(shm), SLOTS, fs_path=str(fs), fs_files=FS_FILES)
    served = Served()
    for prompt, blocks in ((0, 6), (1, 8), (2, 8), (3, 8), (4, 8)):  # 0 leaves the 16-slot pool
        serve(pool, cache, prompt, blocks, served)
        wait_for(lambda: cache.step() >= 0 and not cache.jobs_in_flight, what="the writes")
    assert served.stored_blocks == 6 + 4 * 8
    keys = prompt_keys(0, 6)
    assert cache.index.leading_hits(keys) == 0 and _tier(cache).lookup(keys) == [True] * 6
    code = (
        "import sys; from support.shared_engine import *\n"
        "pool, cache = open_cache(sys.argv[1], 16, fs_path=sys.argv[2], fs_files=40)\n"
        "s = Served()\n"
        "serve(pool, cache, 0, 6, s)\n"
        "st = cache.stats()\n"
        "print(s.hit_blocks, s.wrong, st.promoted['fs'], st.tiers['fs'].write_blocks)\n"
        "cache.close(); pool.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(shm), str(fs)], capture_output=True, text=True,
        env=_env(), timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["6", "0", "6", "0"]  # hits, wrong, promoted, files written
    assert cache.index.leading_hits(keys) == 6  # promoted by the other: in the pool for all
    _check_directory(cache, fs)
    cache.close()
    pool.close()
    assert _wait_empty(shm) == []
    assert len(_files(fs)) == 6 + 4 * 8  # the files stay for the next start


def test_the_budget_holds_with_every_engine_writing(dirs):
    """Two engines store distinct prompts as fast as they can; at 20 random instants both are
    stopped and the directory counted: never more than the budget, temp files included."""
    shm, fs = dirs
    pool, watcher = open_cache(str(shm), SLOTS, fs_path=str(fs), fs_files=FS_FILES)
    engines = [_engine(shm, fs, 6.0, seed, prompts=10_000) for seed in ("a", "b")]
    rng = random.Random(3)
    most = 0
    for _ in range(20):
        time.sleep(rng.uniform(0.05, 0.2))
        for engine in engines:
            engine.send_signal(signal.SIGSTOP)
        for engine in engines:
            wait_for(lambda pid=engine.pid: _stopped(pid), what="the engine stopped")
        most = max(most, len(_files(fs)) + len(_files(fs, ".tmp")))
        for engine in engines:
            engine.send_signal(signal.SIGCONT)
    records = [json.loads(e.communicate(timeout=120)[0].splitlines()[-1]) for e in engines]
    assert all(e.returncode == 0 for e in engines)
    assert FS_FILES // 2 < most <= FS_FILES
    assert sum(r["stored_blocks"] for r in records) > 3 * FS_FILES  # well past the budget
    tier = _tier(watcher)
    assert tier.counters.evictions == 0  # the writers evicted for each other
    _settled(watcher)
    _check_directory(watcher, fs)
    assert len(_files(fs)) == FS_FILES
    watcher.close()
    pool.close()
    assert _wait_empty(shm) == []


def test_a_process_killed_while_writing_leaves_nothing_wrong(dirs):
    shm, fs = dirs
    pool, watcher = open_cache(str(shm), SLOTS, fs_path=str(fs), fs_files=FS_FILES)
    index = _tier(watcher).share_index
    rng = random.Random(11)
    left = 0
    for kill in range(15):
        engine = _engine(shm, fs, 60.0, f"k{kill}", prompts=10_000)
        before = {p.name for p in _files(fs)}
        wait_for(lambda old=before: {p.name for p in _files(fs)} != old, what="its first write")
        time.sleep(rng.uniform(0.0, 0.2))
        engine.send_signal(signal.SIGKILL)
        assert engine.wait(timeout=10) == -signal.SIGKILL
        held = (index.a.state == WRITING) | (index.a.state == DELETING)
        left += bool(held.any() or _files(fs, ".tmp"))  # the kill landed mid-write
        _settled(watcher)
        _check_directory(watcher, fs)
        watcher.check_invariants(settled=True)
    assert left >= 8  # of 15: most kills landed mid-write (14 or 15 in three runs)
    served = Served()
    for prompt in range(4):  # the tier works on
        serve(pool, watcher, 10_000 + prompt, 8, served)
    assert served.wrong == 0
    watcher.close()
    pool.close()
    assert _wait_empty(shm) == []


def test_chaos_with_the_fs_tier_no_engine_sees_a_wrong_payload(dirs):
    """B serves prompts that outgrow the pool (hits come from the fs tier too) while A, on the
    same prompts, is SIGKILLed 20 times mid-request."""
    shm, fs = dirs
    rng = random.Random(26)
    b = _engine(shm, fs, 120.0, "b")
    for kill in range(20):
        a = _engine(shm, fs, 60.0, f"a{kill}")
        time.sleep(rng.uniform(0.05, 0.4))
        a.send_signal(signal.SIGKILL)
        assert a.wait(timeout=10) == -signal.SIGKILL
    assert b.poll() is None
    b.send_signal(signal.SIGTERM)
    out, _ = b.communicate(timeout=120)
    assert b.returncode == 0
    record = json.loads(out.strip().splitlines()[-1])
    assert record["wrong"] == 0
    assert record["requests"] > 20 and record["hit_blocks"] > 0
    assert record["slowest_s"] < 2.0
    assert _wait_empty(shm) == []
    pool, cache = open_cache(str(shm), SLOTS, fs_path=str(fs), fs_files=FS_FILES)
    _check_directory(cache, fs)  # a new index, from the directory as the engines left it
    served = Served()
    tier = _tier(cache)
    for prompt in [p for p in range(24) if tier.lookup(prompt_keys(p, 1)) == [True]]:
        serve(pool, cache, prompt, 8, served)
    assert served.wrong == 0 and cache.stats().promoted["fs"] > 0
    cache.close()
    pool.close()
