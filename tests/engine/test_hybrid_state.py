"""A state group (Mamba, linear attention) through the engine layer, kept as vLLM's
``mamba_cache_mode`` ``all`` keeps it: block ``b`` of the group's table holds the state after the
tokens of blocks ``0..b``, a running request's table lists every block it was given (the engine
frees those before its last computed token without a word), and a resumed request's table holds
the null block everywhere but at the block ending at its resume boundary.

A toy engine drives ``HybridPlanner`` and a ``Copier`` over CPU tensors; a resume loads the
full-attention blocks and the one state page ending at the boundary, byte for byte, and a
boundary without its state is never served."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import require

torch = require.importorskip("torch", "vllm")

from support.toy_hybrid import BS, NULL, PAGE, ToyHybridEngine  # noqa: E402

from engine.test_planner import ToyRequest  # noqa: E402
from kvtier.engine.groups import CacheGroup, GroupKind  # noqa: E402
from kvtier.engine.orders import SKIP  # noqa: E402
from kvtier.engine.planner_settings import PlannerSettings  # noqa: E402

BLOCKS = 96
STATE = CacheGroup(0, GroupKind.STATE, ("m0", "m2"), PAGE, BS)
FULL = CacheGroup(1, GroupKind.FULL, ("a1", "a3"), PAGE, BS)
PROMPT = list(range(100, 141))  # 10 whole blocks and one token


class Engine(ToyHybridEngine):
    """The toy engine with a state group and a full-attention group."""

    def __init__(self, tmp_path: Path, boundary_blocks: int = 4, **settings: int) -> None:
        super().__init__(
            tmp_path,
            [STATE, FULL],
            blocks=BLOCKS,
            pool_blocks=128,
            boundary_blocks=boundary_blocks,
            seed=7,
            settings=PlannerSettings(**settings),
        )

    def prefill(self, rid: str, prompt: list[int]) -> ToyRequest:
        request = ToyRequest(rid, prompt)
        assert self.planner.matched_tokens(request, 0) == (0, False)
        n = -(-len(prompt) // BS)
        self.tables.tables[rid] = [self.alloc(n), self.alloc(n)]  # a state per block
        self.step({rid: len(prompt)})
        request.computed = len(prompt)
        self.planner.request_finished(request)
        return request

    def resume(self, rid: str, prompt: list[int], tokens: int) -> tuple[ToyRequest, list[int]]:
        """vLLM's allocation for a hit of ``tokens``: fresh full-attention blocks, and for the
        state group null blocks but one, at the block ending at the boundary."""
        request = ToyRequest(rid, prompt)
        n = -(-len(prompt) // BS)
        end = tokens // BS
        state = [NULL] * (end - 1) + self.alloc(n - end + 1)
        full = self.alloc(n)
        self.tables.tables[rid] = [state, full]
        self.planner.alloc_tables = (state, full)
        self.planner.after_alloc(request, state, tokens)
        self.planner.alloc_tables = ()
        return request, self.tables.tables[rid][0]

    def same(self, group: int, ours: list[int], theirs: list[int]) -> bool:
        return all(torch.equal(kv[ours], kv[theirs]) for kv in self.kv[group])


@pytest.fixture
def engine(tmp_path: Path):  # type: ignore[no-untyped-def]
    e = Engine(tmp_path)
    yield e
    e.close()


def test_the_state_is_stored_at_the_end_and_every_nth_boundary(engine: Engine) -> None:
    engine.prefill("a", PROMPT)
    groups = engine.planner.stats()["groups"]
    assert groups["1"]["stored_blocks"] == 10
    # States after 4, 8 and 10 blocks (41 tokens: no lookup of this prompt stops at 9).
    assert groups["0"]["stored_blocks"] == 3
    assert sorted(engine.planner._group_keys.get("a", {}).get(0, {})) == []  # forgotten
    assert groups["0"]["kind"] == "state"


def test_a_resume_loads_the_full_blocks_and_the_state_ending_at_the_boundary(
    engine: Engine,
) -> None:
    engine.prefill("a", PROMPT)
    a_state, a_full = engine.tables.tables["a"]
    request = ToyRequest("b", PROMPT)
    assert engine.planner.matched_tokens(request, 0) == (40, False)
    request, state = engine.resume("b", PROMPT, 40)
    (load,) = engine.step({"b": 1}).loads
    full = engine.tables.tables["b"][1]
    assert load.groups == [1] * 10 + [0]
    assert load.engine_blocks == [*full[:10], state[9]]
    assert engine.same(1, full[:10], a_full[:10])
    assert engine.same(0, [state[9]], [a_state[9]])
    groups = engine.planner.stats()["groups"]
    assert groups["1"]["hit_blocks"] == 10 and groups["0"]["hit_blocks"] == 1
    assert engine.planner.stats()["pool_pinned"] == 0


def test_a_shared_prefix_resumes_at_the_last_boundary_with_a_state(engine: Engine) -> None:
    engine.prefill("a", PROMPT)
    a_state = engine.tables.tables["a"][0]
    # Shares 6 blocks: the full group has them all, a state only after 4.
    other = PROMPT[:24] + [7] * 17
    request = ToyRequest("b", other)
    assert engine.planner.matched_tokens(request, 0) == (16, False)
    # The engine's own cache holds 8 tokens: the same boundary, less to load.
    assert engine.planner.matched_tokens(request, 8) == (8, False)
    assert engine.planner.matched_tokens(request, 0) == (16, False)
    request, state = engine.resume("b", other, 16)
    (load,) = engine.step({"b": 1}).loads
    assert load.groups == [1] * 4 + [0] and load.engine_blocks[-1] == state[3]
    assert engine.same(0, [state[3]], [a_state[3]])


def test_no_state_at_any_boundary_is_a_miss_never_the_full_blocks_alone(tmp_path: Path) -> None:
    engine = Engine(tmp_path, boundary_blocks=16)  # states only at the end (10)
    try:
        engine.prefill("a", PROMPT)
        request = ToyRequest("b", PROMPT[:32] + [9] * 9)  # shares 8 blocks
        assert engine.planner.matched_tokens(request, 0) == (0, False)
        assert engine.planner.stats()["pool_pinned"] == 0
        assert engine.planner.stats()["groups"]["1"]["hit_blocks"] == 0
    finally:
        engine.close()


def test_an_allocation_without_a_block_for_the_state_fails_the_load(engine: Engine) -> None:
    engine.prefill("a", PROMPT)
    request = ToyRequest("b", PROMPT)
    assert engine.planner.matched_tokens(request, 0) == (40, False)
    state, full = [NULL] * 11, engine.alloc(11)
    engine.planner.alloc_tables = (state, full)
    engine.planner.after_alloc(request, state, 40)
    engine.planner.alloc_tables = ()
    (load,) = engine.planner.plan_step({}, engine.tables, None).loads
    assert load.fail and load.engine_blocks[-1] == SKIP  # reported failed: vLLM recomputes


def test_a_state_the_engine_freed_is_never_read(engine: Engine) -> None:
    """After a resume at 6 blocks, the table still lists ids before it (vLLM frees them without
    a word); the state after 4 blocks is not the request's any more and is not stored."""
    request = ToyRequest("a", PROMPT)
    assert engine.planner.matched_tokens(request, 24) == (0, False)  # the engine had 6 blocks
    engine.tables.tables["a"] = [engine.alloc(11), engine.alloc(11)]
    request.computed = 24
    engine.step({"a": len(PROMPT) - 24})
    stored = engine.planner.stats()["groups"]["0"]["stored_blocks"]
    assert stored == 2  # the states after 8 and 10 blocks; not after 4 (block 3 < block 5)


def test_state_groups_under_several_engine_blocks_per_kvtier_block_are_not_served(
    tmp_path: Path,
) -> None:
    engine = Engine(tmp_path, blocks_per_slot=2)
    try:
        assert engine.planner.refused is not None and "blocks_per_slot" in engine.planner.refused
        request = ToyRequest("a", PROMPT)
        assert engine.planner.matched_tokens(request, 0) == (0, False)
    finally:
        engine.close()
