"""Engines in separate processes sharing a pool: hits across processes with identical bytes, and
the chaos run (one engine SIGKILLed at random points of its loads and stores, 20 times, while
another keeps serving).

The engines are ``support.shared_engine`` (the kvtier API as a planner drives it; blocks whose
bytes are a function of their key, written in chunks so kills land mid-write)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from support.shared_engine import Served, open_cache, payload, prompt_keys, serve

TESTS = Path(__file__).resolve().parents[1]
SLOTS = 48


def _env() -> dict[str, str]:
    """The environment of an engine process: ``support`` importable, and kvtier from where this
    process imports it (a checkout's ``src`` on ``PYTHONPATH`` wins over an installed copy)."""
    return {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _engine(shm_dir: Path, seconds: float, seed: str) -> subprocess.Popen[str]:
    env = _env()
    args = [str(shm_dir), str(SLOTS), str(seconds), seed]
    proc = subprocess.Popen(
        [sys.executable, "-m", "support.shared_engine", *args],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "running"
    return proc


def _wait_empty(shm_dir: Path, seconds: float = 10.0) -> list[str]:
    end = time.monotonic() + seconds
    while time.monotonic() < end and any(shm_dir.iterdir()):
        time.sleep(0.05)
    return [p.name for p in shm_dir.iterdir()]


def test_a_second_process_hits_what_the_first_stored_with_identical_bytes(tmp_path):
    pool, cache = open_cache(str(tmp_path), SLOTS)
    served = Served()
    for prompt in range(4):
        serve(pool, cache, prompt, 6, served)
    code = (
        "import sys; from support.shared_engine import *\n"
        "pool, cache = open_cache(sys.argv[1], 48)\n"
        "s = Served()\n"
        "for prompt in range(4): serve(pool, cache, prompt, 8, s)\n"
        "print(s.hit_blocks, s.stored_blocks, s.wrong, cache.engine_share().hits_others)\n"
        "cache.close(); pool.close()\n"
    )
    env = _env()
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
        timeout=120, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["24", "8", "0", "24"]  # hits, stored, wrong, others' hits
    keys = prompt_keys(0, 8)
    slots = cache.prepare_load(keys)
    assert len(slots) == 8  # the blocks the other process stored are hits here too
    assert all(bytes(pool.view(s)) == payload(k) for k, s in zip(keys, slots, strict=True))
    cache.complete_load(keys)
    cache.check_invariants(settled=True)
    cache.close()
    pool.close()
    assert _wait_empty(tmp_path) == []


def test_chaos_an_engine_killed_at_random_points_never_harms_the_other(tmp_path):
    """A is SIGKILLed 20 times mid-request while B serves: no wrong payload, no hang, nothing
    leaked once the dead are reaped, and no file left when everyone is gone."""
    rng = random.Random(26)
    watcher_pool, watcher = open_cache(str(tmp_path), SLOTS)  # checks the index at the end
    b = _engine(tmp_path, 60.0, "b")
    for kill in range(20):
        a = _engine(tmp_path, 60.0, f"a{kill}")
        time.sleep(rng.uniform(0.05, 0.5))
        a.send_signal(signal.SIGKILL)
        assert a.wait(timeout=10) == -signal.SIGKILL
    b.send_signal(signal.SIGKILL)  # B too, at a random point
    b.wait(timeout=10)
    watcher.check_invariants(settled=True)  # the dead engines' pins and half-written slots: gone
    assert watcher.index.reap_dead() == 0
    served = Served()
    for prompt in [*range(24), *range(20, 24)]:  # the pool works on: the last four hit
        serve(watcher_pool, watcher, prompt, 8, served)
    assert served.wrong == 0 and served.hit_blocks >= 32
    watcher.close()
    watcher_pool.close()
    assert _wait_empty(tmp_path) == []


def test_chaos_the_serving_engine_sees_no_wrong_payload_and_never_waits_long(tmp_path):
    rng = random.Random(7)
    b = _engine(tmp_path, 120.0, "b")
    for kill in range(20):  # each engine start takes about a second on a loaded 2-core machine
        a = _engine(tmp_path, 60.0, f"a{kill}")
        time.sleep(rng.uniform(0.02, 0.3))
        a.send_signal(signal.SIGKILL)
        assert a.wait(timeout=10) == -signal.SIGKILL
    assert b.poll() is None
    b.send_signal(signal.SIGTERM)  # B ends its request and reports
    out, _ = b.communicate(timeout=120)
    assert b.returncode == 0
    record = json.loads(out.strip().splitlines()[-1])
    assert record["wrong"] == 0
    assert record["requests"] > 20 and record["hit_blocks"] > 0
    assert record["slowest_s"] < 2.0  # bounded: a dead or busy lock holder costs a miss
    assert _wait_empty(tmp_path) == []
