"""A hybrid model through the engine layer: a toy engine with a sliding-window group and a
full-attention group drives ``HybridPlanner`` and a ``Copier`` whose backend is a
``GroupedCopyBackend`` over two CPU backends; pages move byte for byte into each group's own
blocks, and a group that lacks a block makes the lookup step back or miss, never load in part."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import require

torch = require.importorskip("torch", "vllm")

from support.toy_hybrid import BS, LAYERS, NULL, PAGE, ToyHybridEngine  # noqa: E402

from engine.test_planner import ToyRequest  # noqa: E402
from kvtier.copy.base import CopyJob, Direction  # noqa: E402
from kvtier.copy.cpu import CpuCopyBackend  # noqa: E402
from kvtier.copy.grouped import GroupedCopyBackend  # noqa: E402
from kvtier.engine.groups import CacheGroup, GroupKind  # noqa: E402
from kvtier.engine.orders import SKIP  # noqa: E402
from kvtier.pool import HostPool  # noqa: E402

BLOCKS = 64
WINDOW = 9  # the next token attends to 8 tokens before it: 2 blocks
WIN = CacheGroup(0, GroupKind.WINDOW, ("l0", "l2"), PAGE, BS, WINDOW)
FULL = CacheGroup(1, GroupKind.FULL, ("l1", "l3"), PAGE, BS)


class Engine(ToyHybridEngine):
    """The toy engine with a sliding-window group and a full-attention group."""

    def __init__(self, tmp_path: Path, boundary_blocks: int = 4, pool_blocks: int = 64) -> None:
        super().__init__(
            tmp_path,
            [WIN, FULL],
            blocks=BLOCKS,
            pool_blocks=pool_blocks,
            boundary_blocks=boundary_blocks,
            seed=5,
        )

    def prefill(self, rid: str, prompt: list[int]) -> ToyRequest:
        """A request computed by the engine in one step, every block stored as planned."""
        request = ToyRequest(rid, prompt)
        assert self.planner.matched_tokens(request, 0) == (0, False)
        n = -(-len(prompt) // BS)
        self.tables.tables[rid] = [self.alloc(n), self.alloc(n)]
        self.step({rid: len(prompt)})
        request.computed = len(prompt)
        return request


@pytest.fixture
def engine(tmp_path: Path):  # type: ignore[no-untyped-def]
    e = Engine(tmp_path)
    yield e
    e.close()


def test_grouped_backend_moves_each_slot_with_its_groups_layers(tmp_path: Path) -> None:
    pool = HostPool.create(4, LAYERS * PAGE, shm_dir=str(tmp_path))
    try:
        gen = torch.Generator().manual_seed(1)
        kv = {
            g: [
                torch.randint(0, 255, (8, PAGE), dtype=torch.uint8, generator=gen)
                for _ in range(LAYERS)
            ]
            for g in (0, 1)
        }
        backend = GroupedCopyBackend(
            {g: CpuCopyBackend(kv[g], pool) for g in (0, 1)}, blocks_per_slot=1
        )
        backend.submit(CopyJob(7, Direction.STORE, [3, 5], [0, 1], [0, 1]))
        assert backend.poll().done == [7]
        for layer in range(LAYERS):
            assert bytes(pool.view(0)[layer * PAGE : (layer + 1) * PAGE]) == bytes(
                kv[0][layer][3].numpy()
            )
            assert bytes(pool.view(1)[layer * PAGE : (layer + 1) * PAGE]) == bytes(
                kv[1][layer][5].numpy()
            )
        backend.submit(CopyJob(8, Direction.LOAD, [6, 2], [1, 0], [1, 0]))
        assert backend.poll().done == [8]
        assert all(torch.equal(kv[1][i][6], kv[1][i][5]) for i in range(LAYERS))
        assert all(torch.equal(kv[0][i][2], kv[0][i][3]) for i in range(LAYERS))
        # A job without groups, or naming a group without a backend, fails whole.
        backend.submit(CopyJob(9, Direction.STORE, [1], [2]))
        backend.submit(CopyJob(10, Direction.STORE, [1, 2], [2, 3], [0, 4]))
        assert backend.poll().failed == [9, 10]
        # A part that fails fails its job, once, when the other part ended too.
        backend.submit(CopyJob(11, Direction.STORE, [1, 99], [2, 3], [0, 1]))
        assert backend.poll().failed == [11]
        backend.close()
    finally:
        pool.close()


def test_a_hybrid_prompt_loads_every_group_into_its_own_blocks(engine: Engine) -> None:
    prompt = list(range(100, 141))  # 10 whole blocks and one token
    first = engine.prefill("a", prompt)
    stats = engine.planner.stats()["groups"]
    # Full attention: all 10 blocks. Window (2 blocks, boundaries every 4): before 4, 8, 9, 10.
    assert stats["1"]["stored_blocks"] == 10
    assert stats["0"]["stored_blocks"] == len({2, 3, 6, 7, 8, 9})
    engine.planner.request_finished(first)

    second = ToyRequest("b", prompt)
    assert engine.planner.matched_tokens(second, 0) == (40, False)
    win, full = engine.alloc(11), engine.alloc(11)
    win[:8] = [NULL] * 8  # what vLLM's window group holds after a 40-token hit: blocks 8, 9, 10
    engine.tables.tables["b"] = [win, full]
    engine.planner.alloc_tables = (win, full)
    engine.planner.after_alloc(second, full, 40)
    engine.planner.alloc_tables = ()
    second.computed = 40
    orders = engine.step({"b": 1})
    (load,) = orders.loads  # type: ignore[attr-defined]
    assert load.groups == [1] * 10 + [0, 0]
    assert load.engine_blocks == full[:10] + win[8:10]
    a_win, a_full = engine.tables.tables["a"]
    for i in range(LAYERS):
        assert torch.equal(engine.kv[1][i][full[:10]], engine.kv[1][i][a_full[:10]])
        assert torch.equal(engine.kv[0][i][win[8:10]], engine.kv[0][i][a_win[8:10]])
    groups = engine.planner.stats()["groups"]
    assert groups["1"]["hit_blocks"] == 10 and groups["0"]["hit_blocks"] == 2
    assert engine.planner.stats()["pool_pinned"] == 0


def test_a_window_null_in_the_allocation_is_skipped(engine: Engine) -> None:
    engine.planner.request_finished(engine.prefill("a", list(range(100, 141))))
    second = ToyRequest("b", list(range(100, 141)))
    assert engine.planner.matched_tokens(second, 0) == (40, False)
    win, full = engine.alloc(11), engine.alloc(11)
    win[:9] = [NULL] * 9  # a window group that holds less than kvtier planned for
    engine.planner.alloc_tables = (win, full)
    engine.planner.after_alloc(second, full, 40)
    (load,) = engine.planner.plan_step({}, engine.tables, None).loads
    assert load.engine_blocks[-2:] == [SKIP, win[9]]


def test_a_missing_window_block_steps_back_to_a_boundary_every_group_has(engine: Engine) -> None:
    engine.planner.request_finished(engine.prefill("a", list(range(100, 141))))
    # Shares 7 blocks: the full group has them, the window group only before block 4.
    other = list(range(100, 128)) + [7] * 13
    request = ToyRequest("b", other)
    assert engine.planner.matched_tokens(request, 0) == (16, False)
    # The engine's own cache holds 8 tokens: the same boundary, less to load.
    assert engine.planner.matched_tokens(request, 8) == (8, False)
    engine.planner.request_finished(request)


def test_a_group_without_its_blocks_is_a_miss_never_a_partial_load(tmp_path: Path) -> None:
    # Boundaries every 16 blocks: a 10-block prompt stores the window only before 9 and 10.
    engine = Engine(tmp_path, boundary_blocks=16)
    try:
        engine.planner.request_finished(engine.prefill("a", list(range(100, 141))))
        shorter = ToyRequest("b", list(range(100, 132)) + [9] * 9)  # shares 8 blocks
        assert engine.planner.matched_tokens(shorter, 0) == (0, False)
        assert engine.planner.stats()["pool_pinned"] == 0
        assert engine.planner.stats()["groups"]["1"]["hit_blocks"] == 0
    finally:
        engine.close()


def test_a_model_with_a_group_kvtier_cannot_store_is_never_served(tmp_path: Path) -> None:
    engine = Engine(tmp_path)
    try:
        chunked = CacheGroup(0, GroupKind.OTHER, ("c0",), PAGE, BS)
        engine.planner.set_groups([chunked, FULL], 0, NULL)
        prompt = list(range(100, 141))
        request = ToyRequest("a", prompt)
        assert engine.planner.matched_tokens(request, 0) == (0, False)
        engine.tables.tables["a"] = [engine.alloc(11), engine.alloc(11)]
        assert engine.step({"a": len(prompt)}).stores == []  # type: ignore[attr-defined]
        assert engine.planner.stats()["groups_refused"].startswith("group 0 is other")
    finally:
        engine.close()


def test_a_window_group_makes_only_the_keys_it_needs(engine: Engine) -> None:
    """A window group's lookups and stores touch the blocks before a boundary, so only those
    get keys: hashing every block of every group was most of a hybrid lookup's time."""
    prompt = list(range(100, 141))  # 10 blocks
    first = engine.prefill("a", prompt)
    made = engine.planner._group_keys["a"]
    assert sorted(made[0]) == [2, 3, 6, 7, 8, 9] and sorted(made[1]) == list(range(10))
    engine.planner.request_finished(first)


def test_one_full_attention_group_is_the_plain_planner(tmp_path: Path) -> None:
    engine = Engine(tmp_path)
    try:
        engine.planner.set_groups([FULL], 0, NULL)
        assert engine.planner.groups == []
        assert "groups" not in engine.planner.stats()
    finally:
        engine.close()
