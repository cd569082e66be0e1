"""A second engine adapter is a translation: a toy engine with its own request type drives the
engine-neutral ``Planner`` and two ranks' ``Copier`` over a real host pool, and a prompt stored by
one request is loaded, byte for byte on every rank, into another's blocks."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from support import require

torch = require.importorskip("torch", "vllm")

from kvtier.config import load_config  # noqa: E402
from kvtier.engine.copier import Copier  # noqa: E402
from kvtier.engine.orders import SKIP, RankReport, StepOrders  # noqa: E402
from kvtier.engine.planner import PLAIN, KeyScope, Planner  # noqa: E402
from kvtier.engine.planner_settings import PlannerSettings  # noqa: E402
from kvtier.keys import Namespace, chain_keys, chain_root  # noqa: E402

RANKS, LAYERS, BLOCKS, PAGE = 2, 2, 32, 64
BS, BPS = 2, 2  # engine block size, engine blocks per kvtier block
BLOCK_TOKENS = BS * BPS


@dataclass
class ToyRequest:
    """The toy engine's request: other names than vLLM's, translated by ``ToyPlanner``."""

    rid: str
    tokens: list[int]
    tenant_salt: str | None = None
    computed: int = 0
    blocks: list[int] = field(default_factory=list)

    # The attributes the planner reads (``EngineRequest``).
    @property
    def request_id(self) -> str:
        return self.rid

    @property
    def all_token_ids(self) -> list[int]:
        return self.tokens

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.tokens)

    @property
    def num_computed_tokens(self) -> int:
        return self.computed


class ToyPlanner(Planner):
    def key_scope(self, request: ToyRequest) -> KeyScope | None:  # type: ignore[override]
        return PLAIN if request.tenant_salt is None else KeyScope(salt=request.tenant_salt)


class Tables(dict[str, list[int]]):
    def get(self, req_id: str) -> list[int]:  # type: ignore[override]
        return super().get(req_id, [])


def _engine(tmp_path: Path) -> tuple[ToyPlanner, list[Copier], list[list[torch.Tensor]]]:
    config = load_config({"model": "toy", "pool": {"size": 64 * 1024, "shm_dir": str(tmp_path)}})
    ns = Namespace(model="toy", dtype="uint8", block_tokens=BLOCK_TOKENS, tp_size=RANKS)
    slot_bytes = RANKS * LAYERS * BPS * PAGE
    planner = ToyPlanner(config, PlannerSettings(blocks_per_slot=BPS), ns, slot_bytes, BS, RANKS)
    gen = torch.Generator().manual_seed(3)
    kv = [
        [
            torch.randint(0, 255, (BLOCKS, PAGE), dtype=torch.uint8, generator=gen)
            for _ in range(LAYERS)
        ]
        for _ in range(RANKS)
    ]
    copiers = []
    for rank in range(RANKS):
        copier = Copier(BPS, rank, RANKS)
        copier.register(kv[rank])
        copiers.append(copier)
    return planner, copiers, kv


def _run_step(
    planner: Planner, copiers: list[Copier], scheduled: dict[str, int], tables: Tables
) -> StepOrders:
    orders = planner.plan_step(scheduled, tables, None)
    report = RankReport()
    for copier in copiers:
        copier.start_load(orders)
        copier.save(orders)
        rank = copier.take_report()
        if rank is not None:
            report = report.merged(rank)
    planner.on_report(report)
    return orders


def test_a_toy_engine_stores_and_loads_through_the_engine_layer(tmp_path: Path) -> None:
    planner, copiers, kv = _engine(tmp_path)
    tables = Tables()
    try:
        prompt = list(range(100, 117))  # 4 full kvtier blocks and a token to compute
        first = ToyRequest("a", prompt, blocks=list(range(9)))
        tables["a"] = first.blocks
        assert planner.matched_tokens(first, 0) == (0, False)
        stored = _run_step(planner, copiers, {"a": len(prompt)}, tables)
        (store,) = stored.stores
        assert store.engine_blocks == list(range(8))
        assert planner.stats()["jobs_in_flight"] == 0  # both ranks reported: settled
        planner.request_finished(first)

        # The same prompt under a salt is another key chain: nothing to load.
        salted = ToyRequest("s", prompt, tenant_salt="other")
        assert planner.matched_tokens(salted, 0) == (0, False)
        expected = chain_keys(
            planner.namespace, prompt, chain_root(planner.namespace, salt="other")
        )
        assert planner._request_keys(salted) == expected[:4]
        planner.request_finished(salted)

        # Another request with the prompt: 2 tokens are in the engine's own cache already.
        second = ToyRequest("b", prompt, blocks=list(range(20, 29)))
        tables["b"] = second.blocks
        assert planner.matched_tokens(second, 2) == (14, False)
        planner.after_alloc(second, second.blocks, 14)
        second.computed = 16
        loaded = _run_step(planner, copiers, {"b": 1}, tables)
        (load,) = loaded.loads
        assert load.engine_blocks == [SKIP, *range(21, 28)]  # the engine's block is skipped
        for rank in range(RANKS):
            for layer in kv[rank]:
                assert torch.equal(layer[21:28], layer[1:8])
        stats = planner.stats()
        assert stats["connector"]["hit_tokens"] == 14 and stats["jobs_in_flight"] == 0
        assert stats["pool_pinned"] == 0
    finally:
        planner.close()
        for copier in copiers:
            copier.close()


def test_a_rank_that_fails_a_store_fails_the_job(tmp_path: Path) -> None:
    planner, copiers, _ = _engine(tmp_path)
    try:
        request = ToyRequest("a", list(range(9)), blocks=list(range(5)))
        assert planner.matched_tokens(request, 0) == (0, False)
        orders = planner.plan_step({"a": 9}, Tables(a=request.blocks), None)
        (store,) = orders.stores
        planner.on_report(RankReport({store.job_id: 1}))
        assert planner.stats()["jobs_in_flight"] == 1  # one rank of two
        planner.on_report(RankReport({}, {store.job_id: 1}))
        stats = planner.stats()
        assert stats["jobs_in_flight"] == 0
        assert stats["connector"]["store_blocks_failed"] == 2
        # The failed blocks were not kept: a new request with the prompt finds nothing.
        again = ToyRequest("b", list(range(9)))
        assert planner.matched_tokens(again, 0) == (0, False)
    finally:
        planner.close()
        for copier in copiers:
            copier.close()


def test_the_next_turn_of_a_conversation_reuses_the_earlier_prompts_keys(tmp_path: Path) -> None:
    planner, copiers, _ = _engine(tmp_path)
    try:
        ns = planner.namespace
        turn1 = ToyRequest("t1", list(range(100, 117)))
        planner.matched_tokens(turn1, 0)
        turn1.tokens = [*turn1.tokens, *range(500, 506)]  # generated tokens: the chain extends
        assert planner._request_keys(turn1) == chain_keys(ns, turn1.tokens)
        planner.request_finished(turn1)
        turn2 = ToyRequest("t2", [*turn1.tokens, *range(900, 910)])
        planner.matched_tokens(turn2, 0)
        assert planner._request_keys(turn2) == chain_keys(ns, turn2.tokens)
        assert planner._prefixes.reused_blocks == 4  # turn 1's prompt, not its output
        other = ToyRequest("o", [*turn1.tokens[:9], 7, *turn1.tokens[10:]], tenant_salt="x")
        planner.matched_tokens(other, 0)
        root = chain_root(ns, salt="x")
        assert planner._request_keys(other) == chain_keys(ns, other.tokens, root)
        assert planner._prefixes.reused_blocks == 4
    finally:
        planner.close()
        for copier in copiers:
            copier.close()


def test_a_store_after_stored_leading_blocks_copies_only_the_new_tail(tmp_path: Path) -> None:
    planner, copiers, _ = _engine(tmp_path)
    tables = Tables()
    try:
        prompt = list(range(100, 117))
        first = ToyRequest("a", prompt, blocks=list(range(9)))
        tables["a"] = first.blocks
        planner.on_new_request(first)
        _run_step(planner, copiers, {"a": len(prompt)}, tables)
        planner.request_finished(first)
        # The next turn: its first 4 kvtier blocks are the pool's, 2 new ones follow.
        turn = ToyRequest("c", [*prompt[:16], *range(600, 609)], blocks=list(range(12, 25)))
        tables["c"] = turn.blocks
        planner.on_new_request(turn)
        (store,) = _run_step(planner, copiers, {"c": len(turn.tokens)}, tables).stores
        assert store.engine_blocks == turn.blocks[8:12]  # kvtier blocks 4 and 5, BPS each
        assert len(store.slots) == 2
    finally:
        planner.close()
        for copier in copiers:
            copier.close()
