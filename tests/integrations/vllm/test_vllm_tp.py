"""Tensor parallelism (TP=2) in the vLLM connector, without a vLLM engine.

One scheduler-role ``KVTierConnector`` and one worker-role ``KVTierConnector`` per rank, wired as
vLLM's multiprocess executor wires them: every rank gets the same pickled scheduler metadata, and
the ranks' outputs are merged by vLLM's own ``KVOutputAggregator`` before the scheduler sees them.
Each rank has its own CPU KV tensors (different random contents, so a rank reading the other
rank's part of a slot is caught) and all ranks share the scheduler's host pool.

Real vLLM objects: ``Request``, ``SamplingParams``, ``KVConnectorOutput``, ``KVOutputAggregator``,
``KVConnectorRole``. Small fakes, with only the attributes the connector reads:

* ``vllm_config`` / ``kv_cache_config`` (SimpleNamespace): ``kv_transfer_config.
  kv_connector_extra_config``, ``model_config.{model, dtype, revision, get_head_size}``,
  ``cache_config.{block_size, cache_dtype}``, ``parallel_config.{*_parallel_size,
  distributed_executor_backend}``, and one KV
  cache group with ``kv_cache_spec.page_size_bytes`` and ``layer_names``;
* ``FakeSchedulerOutput``: ``num_scheduled_tokens`` and the block tables
  (``scheduled_new_reqs[].block_ids``, ``scheduled_cached_reqs.new_block_ids``);
* ``FakeBlocks``: ``get_block_ids()``;
* the worker's TP rank: ``vllm.distributed.parallel_state.get_tensor_model_parallel_rank`` is
  patched per worker (no process group in one process).
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support import require

torch = require.importorskip("torch", "vllm")
require.importorskip("vllm", "vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.distributed import parallel_state  # noqa: E402
from vllm.distributed.kv_events import BlockStored  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations.vllm import KVTierConnector, compat  # noqa: E402
from kvtier.integrations.vllm import scheduler as scheduler_side  # noqa: E402
from kvtier.integrations.vllm.metadata import KVTierMetadata  # noqa: E402
from kvtier.integrations.vllm.worker import FAULT_ENV  # noqa: E402
from kvtier.pool import HostPool  # noqa: E402

TP = 2
BS = 4  # tokens per engine block
BPS = 2  # engine blocks per kvtier block
BLOCK_TOKENS = BS * BPS
LAYERS = 2
HEAD_DIM = 8
NUM_BLOCKS = 24
# One KV head per rank: [K|V] x 1 head x BS tokens x HEAD_DIM float32.
PAGE = 2 * 1 * BS * HEAD_DIM * 4
PART = LAYERS * BPS * PAGE
POOL_SLOTS = 8

PROMPT = list(range(3, 3 + 3 * BLOCK_TOKENS + 2))  # 3 whole kvtier blocks + 2 tokens
OTHER = list(range(100, 100 + 3 * BLOCK_TOKENS + 2))
A_BLOCKS = list(range(0, 7))  # 26 tokens -> 7 engine blocks
B_BLOCKS = list(range(8, 15))
C_BLOCKS = list(range(16, 23))


class FakeSchedulerOutput:
    """A step's scheduled tokens, and block tables as vLLM's output carries them: a request's
    first step brings its whole table, later steps the blocks added since."""

    def __init__(
        self, scheduled: dict[str, int], tables: dict[str, list[int]], sent: dict[str, int]
    ) -> None:
        self.num_scheduled_tokens = scheduled
        self.scheduled_new_reqs = []
        cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())
        for req_id in scheduled:
            table = tables.get(req_id, [])
            if req_id not in sent:
                self.scheduled_new_reqs.append(SimpleNamespace(req_id=req_id, block_ids=(table,)))
            else:
                cached.req_ids.append(req_id)
                cached.new_block_ids.append((table[sent[req_id] :],))
            sent[req_id] = len(table)
        self.scheduled_cached_reqs = cached


class FakeBlocks:
    def __init__(self, ids: Sequence[int]) -> None:
        self._ids = list(ids)

    def get_block_ids(self) -> tuple[list[int]]:
        return (self._ids,)


def vllm_config(
    extra: dict[str, Any],
    *,
    pcp: int = 1,
    dcp: int = 1,
    backend: str | None = "mp",
    kv_events: bool = False,
) -> Any:
    return SimpleNamespace(
        kv_events_config=SimpleNamespace(enable_kv_cache_events=kv_events),
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra),
        model_config=SimpleNamespace(
            model="tiny-tp-test", dtype="float32", revision=None, get_head_size=lambda: HEAD_DIM
        ),
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"),
        parallel_config=SimpleNamespace(
            tensor_parallel_size=TP,
            pipeline_parallel_size=1,
            prefill_context_parallel_size=pcp,
            decode_context_parallel_size=dcp,
            distributed_executor_backend=backend,
        ),
    )


def kv_cache_config() -> Any:
    spec = SimpleNamespace(page_size_bytes=PAGE)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    return SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=layers)]
    )


def page_bytes(t: Any, block: int) -> bytes:
    return bytes(t[block].contiguous().view(torch.uint8).numpy().tobytes())


class Rig:
    """The connector halves of one TP=2 engine, driven step by step like vLLM drives them."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        shm_dir: Path,
        *,
        fail_loads_rank: int | None = None,
        rank_blocks: dict[int, int] | None = None,
        pool_slots: int = POOL_SLOTS,
        tiers: list[dict[str, Any]] | None = None,
        vllm: dict[str, Any] | None = None,
        kv_events: bool = False,
    ) -> None:
        extra = {
            # Pools of a few slots: promotions for the one waiting request may take them all.
            "pool": {
                "size": pool_slots * TP * PART,
                "shm_dir": str(shm_dir),
                "promotion_budget": 1.0,
            },
            "tiers": tiers or [],
            # The rig copies a step's loads before its forward pass: synchronous, unless a
            # test asks otherwise (a pool alone defaults to "auto").
            "vllm": {"blocks_per_slot": BPS, "async_loads": False, **(vllm or {})},
        }
        self.step_stats: list[Any] = []
        """Per step: the merged ``KVConnectorStats`` vLLM's scheduler would hand its loggers
        (every step's: the interval between the scheduler half's payloads is off)."""
        monkeypatch.setattr(scheduler_side, "STATS_INTERVAL_S", 0.0)
        self.tables: dict[str, list[int]] = {}
        self.sent: dict[str, int] = {}
        self.requests: dict[str, Request] = {}
        self.scheduler = KVTierConnector(
            vllm_config(extra, kv_events=kv_events), KVConnectorRole.SCHEDULER, kv_cache_config()
        )
        self.workers: list[KVTierConnector] = []
        self.kv: list[list[Any]] = []
        for rank in range(TP):
            monkeypatch.setattr(
                parallel_state, "get_tensor_model_parallel_rank", lambda rank=rank: rank
            )
            # The fault hook is read when the worker half is built: set it for one rank only.
            if rank == fail_loads_rank:
                monkeypatch.setenv(FAULT_ENV, "1")
            else:
                monkeypatch.delenv(FAULT_ENV, raising=False)
            worker = KVTierConnector(vllm_config(extra), KVConnectorRole.WORKER, None)
            gen = torch.Generator().manual_seed(1000 + rank)
            blocks = (rank_blocks or {}).get(rank, NUM_BLOCKS)
            kv = [torch.randn(blocks, 2, 1, BS, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
            worker.register_kv_caches(
                {f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(kv)}
            )
            self.workers.append(worker)
            self.kv.append(kv)
        monkeypatch.delenv(FAULT_ENV, raising=False)

    # -- vLLM's scheduler -------------------------------------------------------------------------

    def add(self, req_id: str, tokens: list[int]) -> Request:
        request = Request(req_id, tokens, SamplingParams(max_tokens=1), None)
        self.requests[req_id] = request
        self.scheduler.on_new_request(request)
        return request

    def matched(self, req_id: str) -> int | None:
        external, is_async = self.scheduler.get_num_new_matched_tokens(self.requests[req_id], 0)
        assert not is_async
        return external

    def admit(self, req_id: str, block_ids: list[int], external: int | None = None) -> int:
        """Lookup, allocation and ``update_state_after_alloc``, as vLLM admits a waiting
        request; ``external`` overrides the token count vLLM allocates for (a stale plan)."""
        found = self.matched(req_id)
        assert found is not None
        if external is None:
            external = found
        self.tables[req_id] = block_ids
        request = self.requests[req_id]
        self.scheduler.update_state_after_alloc(request, FakeBlocks(block_ids), external)
        request.num_computed_tokens = external
        return external

    def finish(self, *req_ids: str) -> None:
        for req_id in req_ids:
            self.scheduler.request_finished(self.requests[req_id], self.tables.get(req_id, []))

    # -- one engine step --------------------------------------------------------------------------

    def step(self, scheduled: dict[str, int]) -> tuple[KVTierMetadata, list[KVConnectorOutput]]:
        output = FakeSchedulerOutput(scheduled, self.tables, self.sent)
        meta = self.scheduler.build_connector_meta(output)
        assert isinstance(meta, KVTierMetadata)
        for req_id, n in scheduled.items():
            self.requests[req_id].num_computed_tokens += n
        outputs = []
        for worker in self.workers:
            # Each rank gets its own unpickled copy, as over vLLM's message queue.
            worker.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
            worker.start_load_kv(None)
            worker.wait_for_save()
            out = KVConnectorOutput(
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
            )
            worker.clear_connector_metadata()
            outputs.append(pickle.loads(pickle.dumps(out)))
        return meta, outputs

    def report(self, outputs: list[KVConnectorOutput]) -> KVConnectorOutput:
        """Merge one step's per-rank outputs with vLLM's aggregator and hand them back."""
        runner_outputs = [SimpleNamespace(kv_connector_output=o) for o in outputs]
        merged = KVOutputAggregator(expected_finished_count=TP).aggregate(runner_outputs)
        assert merged is not None
        kv_out: KVConnectorOutput = merged.kv_connector_output
        self.scheduler.update_connector_output(kv_out)
        # As vLLM's scheduler: the workers' merged stats, then the scheduler half's.
        stats = kv_out.kv_connector_stats
        own = self.scheduler.get_kv_connector_stats()
        if own is not None and not own.is_empty():
            stats = stats.aggregate(own) if stats is not None else own
        self.step_stats.append(stats)
        return kv_out

    def run(self, scheduled: dict[str, int]) -> tuple[KVTierMetadata, KVConnectorOutput]:
        meta, outputs = self.step(scheduled)
        return meta, self.report(outputs)

    # -- inspection -------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return self.scheduler.stats_snapshot()

    def poison(self, block_ids: Sequence[int]) -> None:
        for kv in self.kv:
            for t in kv:
                t[list(block_ids)] = float("nan")

    def assert_no_leaks(self, stored: int) -> None:
        stats = self.stats()
        assert stats["pool_pinned"] == 0, stats
        assert stats["jobs_in_flight"] == 0 and stats["pinned_plans"] == 0, stats
        assert stats["pool_used"] == stored, stats

    def close(self) -> None:
        for worker in self.workers:
            worker.shutdown()
        self.scheduler.shutdown()


@pytest.fixture
def make_rig(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Any]:
    rigs: list[Rig] = []

    def make(**kwargs: Any) -> Rig:
        rig = Rig(monkeypatch, tmp_path, **kwargs)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.close()


def store_prompt(rig: Rig, req_id: str = "A", blocks: list[int] = A_BLOCKS) -> KVTierMetadata:
    rig.add(req_id, PROMPT)
    assert rig.admit(req_id, blocks) == 0
    meta, _ = rig.run({req_id: len(PROMPT)})
    return meta


def test_events_are_recorded_only_when_vllm_publishes_them(make_rig: Any) -> None:
    """vLLM takes the connector's events every step and drops them unless its KV events are on;
    before, kvtier recorded one per stored block anyway (scheduler time for nothing)."""
    quiet, loud = make_rig(), make_rig(kv_events=True)
    for rig in (quiet, loud):
        store_prompt(rig)
        rig.run({})
    assert list(quiet.scheduler.take_events()) == []
    stored = [e for e in loud.scheduler.take_events() if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == len(A_BLOCKS) // BPS


def test_a_cache_reset_makes_every_earlier_block_a_miss_for_this_engine(make_rig: Any) -> None:
    """vLLM's ``reset_prefix_cache(reset_connector=True)`` after a weight update: before,
    kvtier had no ``reset_cache`` (vLLM counts that a success) and served the old weights' KV."""
    rig = make_rig()
    store_prompt(rig)
    rig.finish("A")
    rig.add("W", PROMPT)  # known before the reset: what it stores stays in the old generation
    assert rig.scheduler.reset_cache() is True
    rig.add("B", PROMPT)
    assert rig.matched("B") == 0  # the same tokens: a miss now
    assert rig.matched("W") == 0
    assert rig.admit("B", B_BLOCKS) == 0
    rig.run({"B": len(PROMPT)})  # B computes and stores under the new generation
    rig.run({})
    rig.finish("B")
    rig.add("C", PROMPT)
    assert rig.matched("C") == 3 * BLOCK_TOKENS  # the new generation's blocks are hits
    assert rig.stats()["connector"]["resets"] == 1


def test_each_rank_writes_its_own_part_and_loads_it_back_bit_exact(make_rig: Any) -> None:
    rig = make_rig()
    assert page_bytes(rig.kv[0][0], 0) != page_bytes(rig.kv[1][0], 0)  # ranks differ
    meta = store_prompt(rig)
    assert meta.pool.slot_bytes == TP * PART
    (order,) = meta.stores
    assert order.engine_blocks == A_BLOCKS[:6] and len(order.slots) == 3
    assert rig.stats()["cache"]["stored_blocks"] == 3

    # Part r of each slot holds rank r's pages of the slot's engine blocks, layer by layer.
    pool = HostPool.attach(meta.pool)
    try:
        arr = pool.array()
        for i, slot in enumerate(order.slots):
            for rank in range(TP):
                want = b"".join(
                    page_bytes(rig.kv[rank][layer], block)
                    for layer in range(LAYERS)
                    for block in A_BLOCKS[i * BPS : (i + 1) * BPS]
                )
                got = arr[slot, rank * PART : (rank + 1) * PART].tobytes()
                assert got == want, (slot, rank)
    finally:
        pool.close()

    # Same prompt, other engine blocks (poisoned): loaded from kvtier on both ranks.
    rig.poison(B_BLOCKS)
    rig.add("B", PROMPT)
    assert rig.admit("B", B_BLOCKS) == 3 * BLOCK_TOKENS
    meta, merged = rig.run({"B": len(PROMPT) - 3 * BLOCK_TOKENS})
    (load,) = meta.loads
    assert load.engine_blocks == B_BLOCKS[:6]
    assert not merged.invalid_block_ids
    for rank in range(TP):
        for layer in range(LAYERS):
            t = rig.kv[rank][layer]
            for src, dst in zip(A_BLOCKS[:6], B_BLOCKS[:6], strict=True):
                assert page_bytes(t, dst) == page_bytes(t, src), (rank, layer, dst)
            assert torch.isnan(t[B_BLOCKS[6]]).all()  # not a kvtier block: left alone
    stats = rig.stats()
    assert stats["cache"]["loaded_blocks"] == 3
    assert stats["connector"]["hit_tokens"] == 3 * BLOCK_TOKENS
    rig.finish("A", "B")
    rig.assert_no_leaks(stored=3)


def test_a_job_settles_only_when_every_rank_reported(make_rig: Any) -> None:
    rig = make_rig()
    rig.add("A", PROMPT)
    rig.admit("A", A_BLOCKS)
    _, outputs = rig.step({"A": len(PROMPT)})
    assert all(o.kv_connector_worker_meta is not None for o in outputs)

    # Rank 1's report comes a step late (an asynchronous backend): rank 0's alone stores nothing.
    rig.report([outputs[0], KVConnectorOutput()])
    stats = rig.stats()
    assert stats["cache"]["stored_blocks"] == 0 and stats["jobs_in_flight"] == 1, stats
    rig.add("B", PROMPT)
    assert rig.matched("B") == 0  # reserved, not visible
    rig.report([KVConnectorOutput(), outputs[1]])
    stats = rig.stats()
    assert stats["cache"]["stored_blocks"] == 3 and stats["jobs_in_flight"] == 0, stats

    # Loads too: the blocks stay pinned (unevictable) until the last rank reported.
    assert rig.admit("B", B_BLOCKS) == 3 * BLOCK_TOKENS
    _, outputs = rig.step({"B": 2})
    rig.report([KVConnectorOutput(), outputs[1]])
    stats = rig.stats()
    assert stats["pool_pinned"] == 3 and stats["cache"]["loaded_blocks"] == 0, stats
    rig.report([outputs[0], KVConnectorOutput()])
    assert rig.stats()["cache"]["loaded_blocks"] == 3
    rig.finish("A", "B")
    rig.assert_no_leaks(stored=3)


def test_one_rank_failing_loads_fails_the_job_and_reports_its_blocks(make_rig: Any) -> None:
    rig = make_rig(fail_loads_rank=1)
    store_prompt(rig)
    rig.poison(B_BLOCKS)
    rig.add("B", PROMPT)
    assert rig.admit("B", B_BLOCKS) == 3 * BLOCK_TOKENS
    _, outputs = rig.step({"B": 2})
    assert outputs[0].invalid_block_ids == set()
    assert outputs[1].invalid_block_ids == set(B_BLOCKS[:6])
    merged = rig.report(outputs)
    # vLLM recomputes these blocks on every rank.
    assert merged.invalid_block_ids == set(B_BLOCKS[:6])
    # Rank 0 did copy its share; rank 1 left its blocks untouched.
    assert page_bytes(rig.kv[0][0], B_BLOCKS[0]) == page_bytes(rig.kv[0][0], A_BLOCKS[0])
    assert torch.isnan(rig.kv[1][0][B_BLOCKS[:6]]).all()
    stats = rig.stats()
    assert stats["connector"]["load_blocks_failed"] == 3, stats  # one job, counted once
    assert stats["cache"]["load_failed"] == 3 and stats["cache"]["loaded_blocks"] == 0
    rig.finish("A", "B")
    # A copy failure does not make the stored blocks bad: they stay, unpinned.
    rig.assert_no_leaks(stored=3)
    rig.add("C", PROMPT)
    assert rig.matched("C") == 3 * BLOCK_TOKENS
    rig.finish("C")
    rig.assert_no_leaks(stored=3)


def test_one_rank_failing_a_store_publishes_nothing_of_that_job(make_rig: Any) -> None:
    # Rank 1 has fewer engine blocks: C's ids are out of its range, A's are not.
    rig = make_rig(rank_blocks={1: 16})
    rig.add("A", PROMPT)
    rig.add("C", OTHER)
    rig.admit("A", A_BLOCKS)
    rig.admit("C", C_BLOCKS)
    meta, _ = rig.run({"A": len(PROMPT), "C": len(OTHER)})
    assert len(meta.stores) == 2
    stats = rig.stats()
    assert stats["cache"]["stored_blocks"] == 3, stats
    assert stats["connector"]["store_blocks_failed"] == 3, stats
    assert stats["cache"]["store_failed"] == 3
    rig.add("A2", PROMPT)
    rig.add("C2", OTHER)
    assert rig.matched("A2") == 3 * BLOCK_TOKENS
    assert rig.matched("C2") == 0
    rig.finish("A", "C", "A2", "C2")
    rig.assert_no_leaks(stored=3)  # C's slots went back to the pool


def test_a_rank_that_cannot_copy_fails_every_store(make_rig: Any) -> None:
    rig = make_rig()
    rig.workers[1].register_kv_caches({})  # rank 1 has no KV tensors: no copy backend
    store_prompt(rig)
    stats = rig.stats()
    assert stats["cache"]["stored_blocks"] == 0
    assert stats["connector"]["store_blocks_failed"] == 3
    rig.finish("A")
    rig.assert_no_leaks(stored=0)


@pytest.mark.parametrize(
    ("blocks", "external", "failed"),
    [
        # vLLM allocates for fewer external tokens than kvtier offered.
        (B_BLOCKS, 2 * BLOCK_TOKENS, B_BLOCKS[:6]),
        # A block table shorter than the plan's slots (4 engine blocks, the plan loads 6): it
        # raised IndexError in ``update_state_after_alloc`` before, stopping vLLM's scheduler.
        (B_BLOCKS[:4], None, B_BLOCKS[:4]),
    ],
    ids=["fewer-tokens", "fewer-blocks"],
)
def test_a_stale_plan_fails_once_with_both_ranks_reporting_it(
    make_rig: Any, blocks: list[int], external: int | None, failed: list[int]
) -> None:
    rig = make_rig()
    store_prompt(rig)
    rig.poison(B_BLOCKS)
    rig.add("B", PROMPT)
    loaded = rig.admit("B", blocks, external=external)
    _, outputs = rig.step({"B": len(PROMPT) - loaded})
    assert all(o.invalid_block_ids == set(failed) for o in outputs)  # recomputed by vLLM
    rig.report(outputs)
    assert all(torch.isnan(t[B_BLOCKS]).all() for kv in rig.kv for t in kv)  # nothing copied
    stats = rig.stats()
    assert stats["connector"]["stale_plans"] == 1
    assert stats["connector"]["load_blocks_failed"] == 3
    rig.finish("A", "B")
    rig.assert_no_leaks(stored=3)


@pytest.mark.parametrize(("pcp", "dcp"), [(2, 1), (1, 2)])
@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_context_parallelism_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, pcp: int, dcp: int, role: Any
) -> None:
    # With prefill CP each job gets TP x PCP reports and two workers write each slot part; with
    # decode CP a scheduler block spans BS x DCP tokens. Neither fits the slot layout.
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    extra = {"pool": {"size": POOL_SLOTS * TP * PART, "shm_dir": str(tmp_path)}}
    config = vllm_config(extra, pcp=pcp, dcp=dcp)
    with pytest.raises(ConfigError, match="context_parallel_size"):
        KVTierConnector(config, role, kv_cache_config())
    assert not list(tmp_path.iterdir())  # no pool left behind


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_tensor_parallel_with_an_external_launcher_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, role: Any
) -> None:
    # torchrun-style launchers run one engine per rank, each with its own scheduler that sees only
    # its own worker's report: jobs would wait for TP reports forever (slots reserved, blocks
    # pinned) and the ranks' pools, holding one part each, would write the same keys to a tier.
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    extra = {"pool": {"size": POOL_SLOTS * TP * PART, "shm_dir": str(tmp_path)}}
    config = vllm_config(extra, backend="external_launcher")
    with pytest.raises(ConfigError, match="distributed_executor_backend"):
        KVTierConnector(config, role, kv_cache_config())
    assert not list(tmp_path.iterdir())


def test_the_connector_asks_vllm_for_the_configured_kv_cache_layout(tmp_path: Path) -> None:
    pool = {"size": POOL_SLOTS * TP * PART, "shm_dir": str(tmp_path)}
    assert KVTierConnector.get_required_kvcache_layout(vllm_config({"pool": pool})) == "BLNHC"
    for value, asked in (("BLHNC", "BLHNC"), ("LBNHC", "LBNHC"), ("engine", None)):
        config = vllm_config({"pool": pool, "vllm": {"kv_cache_layout": value}})
        assert KVTierConnector.get_required_kvcache_layout(config) == asked
    bad = vllm_config({"pool": pool, "vllm": {"kv_cache_layout": "NHD"}})
    with pytest.raises(ConfigError, match=r"vllm\.kv_cache_layout"):
        KVTierConnector.get_required_kvcache_layout(bad)
    assert not list(tmp_path.iterdir())  # asking creates no pool


def test_vllm_takes_the_connector_layout_where_its_backends_allow_it() -> None:
    """vLLM's own resolution: the connector's layout is used where the attention backends have
    no objection (FlashAttention declares none) and dropped for one they refuse (the CPU
    backend takes only LBHNC)."""
    from vllm.v1.attention.backends import utils as attention_utils

    def resolve(supported: list[str]) -> str:
        config = SimpleNamespace(
            cache_config=SimpleNamespace(kv_cache_layout=None),
            model_config=SimpleNamespace(model="m"),
            kv_transfer_config=SimpleNamespace(
                kv_connector="KVTierConnector",
                kv_connector_module_path="kvtier.integrations.vllm.connector",
                kv_connector_extra_config={"model": "m", "pool": {"size": "64MiB"}},
            ),
        )
        return str(attention_utils.resolve_kv_cache_layout(config, [supported]).name)

    any_layout = ["LBNHC", "LBHNC", "BLNHC", "BLHNC", "BHLNC", "LHBNC"]
    assert resolve(any_layout) == "BLNHC"
    assert resolve(["LBHNC"]) == "LBHNC"


def test_the_namespace_names_the_page_order_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slots hold a page's bytes as they lie: pages of NHC and HNC order never share blocks,
    layer- and block-outermost layouts of one order do."""
    import vllm.platforms

    from kvtier.integrations.vllm import connector as connector_module

    monkeypatch.setattr(vllm.platforms, "current_platform", SimpleNamespace(device_type="cuda"))

    def layout_of(name: str) -> str:
        config = vllm_config({"pool": {"size": "64MiB"}})
        config.cache_config.kv_cache_layout = name
        kvtier_config, settings, _ = connector_module._load_config(config)
        order = compat.page_order(config, None, (0, 32, 0))
        bps = settings.planner.blocks_per_slot
        namespace = connector_module._namespace(config, kvtier_config, BS, LAYERS, PAGE, order, bps)
        return namespace.layout

    assert layout_of("LBNHC") == layout_of("BLNHC") == f"vllm/cuda-NHC/engine-block-{BS}"
    assert layout_of("LBHNC") == layout_of("BLHNC") != layout_of("LBNHC")


def test_sleep_hooks_drop_the_copy_backend_and_restore_it(make_rig: Any) -> None:
    """vLLM 0.33's sleep mode: after ``unregister_kv_caches`` no copy touches the engine's KV
    (a load is reported failed and recomputed, a store is dropped); after ``restore_kv_caches``
    blocks load again, bit-exact, from the pool kept through the sleep."""
    assert KVTierConnector.supports_sleep_mode(None)
    rig = make_rig()
    store_prompt(rig)
    for worker in rig.workers:
        worker.unregister_kv_caches()
        worker.unregister_kv_caches()  # idempotent
        assert worker._worker is not None and worker._worker._backend is None
    rig.poison(B_BLOCKS)
    rig.add("B", PROMPT)
    assert rig.admit("B", B_BLOCKS) == 3 * BLOCK_TOKENS
    _, merged = rig.run({"B": len(PROMPT) - 3 * BLOCK_TOKENS})
    assert merged.invalid_block_ids == set(B_BLOCKS[:6])
    assert torch.isnan(rig.kv[0][0][B_BLOCKS[0]]).all()  # not written while asleep
    rig.add("C", OTHER)
    assert rig.admit("C", C_BLOCKS) == 0
    rig.run({"C": len(OTHER)})
    assert rig.stats()["connector"]["store_blocks_failed"] == 3
    rig.finish("B", "C")

    for worker in rig.workers:
        worker.restore_kv_caches()
    rig.add("D", PROMPT)
    assert rig.admit("D", B_BLOCKS) == 3 * BLOCK_TOKENS
    _, merged = rig.run({"D": len(PROMPT) - 3 * BLOCK_TOKENS})
    assert not merged.invalid_block_ids
    for rank in range(TP):
        t = rig.kv[rank][1]
        assert page_bytes(t, B_BLOCKS[5]) == page_bytes(t, A_BLOCKS[5])
    rig.finish("A", "D")
    rig.assert_no_leaks(stored=3)


@pytest.mark.parametrize("queue", [1, 2])
def test_the_scheduler_side_knows_how_many_steps_vllm_queues(tmp_path: Path, queue: int) -> None:
    # The promotion cost rules time each step from the call after the one that scheduled it
    # under a batch queue of two (tests/engine/test_planner_compute_rate.py).
    config = vllm_config({"pool": {"size": POOL_SLOTS * TP * PART, "shm_dir": str(tmp_path)}})
    config.max_concurrent_batches = queue
    connector = KVTierConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config())
    try:
        assert connector._scheduler is not None
        assert connector._scheduler.settings.steps_in_flight == queue
    finally:
        connector.shutdown()
