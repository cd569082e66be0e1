"""``hinted`` under pressure in the order an engine calls the cache (issue 24, vLLM at 16
conversations in flight x 2 GiB: the pool cached 1.8% of the reusable tokens where the replay of
the same sequence kept a stable subset).

What differs from ``kvtier simulate``'s replay, each reproduced here through the real
``TieredCache``: the requests in flight store their blocks before any of them is hinted (a hint
comes when a request finished, two requests later here), so those stores alone take most of the
pool; the engine's own prefix cache sits in front and its hits are part of ``hit_blocks`` (here:
requests whose blocks the engine held itself, as after a preemption); warm-up requests come back
after 3 requests, the conversations after 16. And vLLM's own recorded calls (``RECORDED``),
replayed by ``benchmarks/pressure_bench.py``.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path
from types import ModuleType

import pytest
from support.scripts import load_script

from kvtier.cache.manager import TieredCache
from kvtier.policies import HintedPolicy, LRUPolicy, RequestHint
from kvtier.policies.pressure import PressureGauge
from kvtier.pool import HostPool
from kvtier.sim.optimal import optimal_hit_ratio

CONVERSATIONS = 16
IN_FLIGHT = 3
POOL = 120
RECORDED = {
    "16x2": Path(__file__).with_name("vllm_16x2_calls.json.gz"),
    "32x2": Path(__file__).with_name("vllm_32x2_calls.json.gz"),
}
"""vLLM's own cache calls at the ratios of the H100 grid points 16x2 and 32x2
(``benchmarks/pressure_bench.py --record FILE --concurrency 16 --requests 240`` and ``32 320``:
vLLM's CPU build 0.32, its tiny model, the engine benchmark's conversations widened 4x, pool and
KV cache of 512 blocks of 32 tokens, requests of about 160 blocks, 16,384 tokens a step). 16x2
was recorded with ``hinted`` at 2d21f2f (the pool cached 7.1% of the prompt tokens, 8.1% on the
H100), 32x2 with this one: the engine's calls come in the same order whatever the pool finds
(the replay of either recording of 16x2 gives the same figures)."""


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    """``benchmarks/pressure_bench.py``: the recorded calls' reader and replay."""
    return load_script("benchmarks/pressure_bench.py")


def key(conversation: int, block: int) -> bytes:
    return conversation.to_bytes(8, "little") + block.to_bytes(8, "little")


def engine_sequence() -> list[tuple[list[bytes], int]]:
    """(blocks, leading blocks the engine's own cache holds): 4 warm-up requests that come back
    after 3, then 16 conversations of 5 turns round robin (36 blocks, 3 more each turn); for
    every fifth request the engine still holds the conversation's previous turn."""
    out: list[tuple[list[bytes], int]] = []
    for again in range(2):
        for w in range(3):
            out.append(([key(1000 + w, b) for b in range(4)], 0))
        if again:
            out.append(([key(1000, b) for b in range(5)], 0))
    for wave in range(2):
        for turn in range(5):
            for c in range(CONVERSATIONS):
                keys = [key(wave * CONVERSATIONS + c, b) for b in range(36 + 3 * turn)]
                engine = 36 + 3 * (turn - 1) if turn and len(out) % 5 == 0 else 0
                out.append((keys, engine))
    return out


def reusable_blocks() -> int:
    """Leading blocks of each request that an earlier request had, less the engine's."""
    seen: set[bytes] = set()
    total = 0
    for keys, engine in engine_sequence():
        run = 0
        while run < len(keys) and keys[run] in seen:
            run += 1
        total += run - engine
        seen.update(keys)
    return total


def run_engine_order(cache: TieredCache) -> int:
    """Blocks the pool served: per request a lookup of what the engine does not hold, a load of
    the hits, its stores in two chunks, each settled a step later, and the hint of the request
    ``IN_FLIGHT - 1`` requests earlier (it finished meanwhile)."""
    served = 0
    finished: deque[tuple[list[bytes], RequestHint]] = deque()
    for keys, engine in engine_sequence():
        hits = 0
        if engine < len(keys):
            hits = cache.lookup(keys[engine:]).hits
            loaded = keys[engine : engine + hits]
            slots = cache.prepare_load(loaded)
            served += len(slots)
            half = len(keys) // 2
            first = cache.prepare_store(keys[:half])
            cache.complete_load(loaded[: len(slots)])
            cache.complete_store(first.keys)
            second = cache.prepare_store(keys[half:])
            cache.complete_store(second.keys)
        finished.append((keys, RequestHint(engine + hits, 64, engine)))
        if len(finished) >= IN_FLIGHT:
            cache.hint_request(*finished.popleft())
    return served


def test_hinted_keeps_conversations_in_the_engines_order(tmp_path: Path) -> None:
    with HostPool.create(POOL, 64, str(tmp_path)) as pool:
        policy = HintedPolicy(POOL)
        cache = TieredCache(pool, policy, record_events=False)
        served = run_engine_order(cache)
        cache.close()
    assert policy.pressure
    # Three conversations of 36-48 blocks fit in 120: holding two for their turns 2-5 serves
    # about 2 x 4 x 40 of every 16 x 4 x 40 reusable blocks, 1/8. Before the pool asked
    # admit_store the stores in flight evicted them all (0.01).
    assert served > reusable_blocks() / 10


def test_engine_hits_do_not_count_as_the_pools() -> None:
    """The gauge compares the stable shadow with what the pool found: blocks the engine's own
    cache held (vLLM's GPU prefix cache; a preempted request scheduled again) are not the
    pool's. Counted in, they kept the stable mode off."""
    policy = HintedPolicy(100)
    for i in range(200):
        keys = [key(i % 16, b) for b in range(40)]
        policy.on_request(keys, RequestHint(40, 64, 40))  # the engine held all of it
    assert policy.gauge.baseline == 0.0
    assert policy.pressure


def test_hint_clamps_engine_blocks() -> None:
    assert RequestHint(5, None, 9).engine_blocks == 5
    assert RequestHint(5, None, -1).engine_blocks == 0
    assert RequestHint(5, None, "x").served_blocks == 5  # type: ignore[arg-type]
    assert RequestHint(5, None, 2).served_blocks == 3


def test_gap_forgets_warm_up_requests_soon() -> None:
    """A mean gap of 3 from warm-up requests, then conversations back after 16: a plain mean
    of the first gaps follows within two rounds (a moving mean from the first gap took
    about 60 requests)."""
    gauge = PressureGauge(100)
    for _ in range(2):
        for w in range(3):
            gauge.request(key(1000 + w, 0), 4)
    for i in range(2 * CONVERSATIONS):
        gauge.request(key(i % CONVERSATIONS, 0), 40)
    assert gauge.mean_gap > 12


@pytest.mark.parametrize("point", ["16x2", "32x2"])
def test_vllm_recorded_order_serves_half_the_optimum(bench: ModuleType, point: str) -> None:
    """Issue 24's acceptance, in the order vLLM called the cache (``RECORDED``): the pool serves
    at least half the offline optimum of the same requests, where at 2d21f2f it served 0.35 and
    0.45 of it (16x2: recorded at 2,453 blocks loaded, replayed at 2,462 of an optimum of 7,005).
    There the blocks of a conversation that ended just before the stable mode turned on stayed
    in the LRU order for the rest of the run (a third of the pool), and the stores of the
    requests in flight were admitted whenever the pool did well (GATE_HOLD), evicting the
    conversations held. Now 0.59 and 0.56."""
    data = bench.read_calls(RECORDED[point])
    events, blocks = data["events"], int(data["pool_blocks"])
    optimum = optimal_hit_ratio(bench.calls_requests(events), blocks).hit_blocks
    served = bench.replay_calls(events, HintedPolicy(blocks), blocks)
    assert served >= optimum / 2
    assert bench.replay_calls(events, LRUPolicy(), blocks) < optimum / 20


def test_benchmark_sequence_is_the_grids(bench: ModuleType, tmp_path: Path) -> None:
    """The sequence whose offline optimum the grid's thrash-regime check compares with is the
    one the grid sends: at 32 in flight the grid leaves out a conversation whose last prompt
    exceeds the engine's length (318 requests of 320), and so must the optimum's sequence."""
    eng = load_script("benchmarks/vllm_bench_engine.py")
    settings = eng.Settings(5, 40, 4, 64, 16384, None, tmp_path)
    prompts, summary = eng.build_point(settings, eng.make_model("llama8b", tmp_path), 32, 320)
    assert summary["dropped_conversations"] == 1
    sequence = bench.benchmark_sequence(32, 320, 5, 40, 4)
    assert len(sequence) == summary["requests"] == 318
    assert sorted(r.input_length for r in sequence) == sorted(len(p) for p in prompts.all())
