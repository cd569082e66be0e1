"""A hybrid model's stats file (``vllm.stats_path``) holds what ``stats()`` returns: its groups'
kinds and counters. The file is written from ``stats_snapshot`` (a call the writer's thread
makes), which left them out before: an H100 run of the GPU hybrid test (vLLM 0.25.1, 2026-11-27)
read a stats file without ``groups`` from a tiny Gemma-2 that vLLM had given two groups."""

from __future__ import annotations

import json
from pathlib import Path

from support import require

torch = require.importorskip("torch", "vllm")

from support.toy_hybrid import BS, ToyHybridEngine  # noqa: E402

from engine.test_hybrid import FULL, WIN  # noqa: E402
from engine.test_planner import ToyRequest  # noqa: E402
from kvtier.engine.planner_settings import PlannerSettings  # noqa: E402


def test_the_stats_file_names_the_groups_and_their_counters(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    engine = ToyHybridEngine(
        tmp_path,
        [WIN, FULL],
        blocks=64,
        pool_blocks=64,
        boundary_blocks=4,
        seed=5,
        settings=PlannerSettings(stats_path=str(path)),
    )
    try:
        prompt = list(range(100, 141))  # 10 blocks and a token
        request = ToyRequest("a", prompt)
        assert engine.planner.matched_tokens(request, 0) == (0, False)
        n = -(-len(prompt) // BS)
        engine.tables.tables["a"] = [engine.alloc(n), engine.alloc(n)]
        engine.step({"a": len(prompt)})
        expected = engine.planner.stats()
    finally:
        engine.close()
    written = json.loads(path.read_text())
    assert written["groups"] == expected["groups"]
    assert written["groups"]["1"]["stored_blocks"] == 10
    assert written["groups"]["0"]["kind"] == "window"
    assert written["groups_refused"] is None and written["block_tokens"] == BS
