"""The connector's worker half with an asynchronous copy backend (as the CUDA one is): stores are
never waited for on the host, the next step is fenced behind the stores still in flight, results
reach the scheduler once, and the CUDA layout is recognised from vLLM's tensor shapes."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from support import require

require.importorskip("vllm", "vllm")

from kvtier.copy.base import BackendSetup, CopyBackend, CopyJob, CopyResults, Direction  # noqa: E402
from kvtier.copy.cuda.plan import KVLayout, cuda_layout  # noqa: E402
from kvtier.integrations.vllm import worker as worker_module  # noqa: E402
from kvtier.integrations.vllm.metadata import CopyOrder, KVTierMetadata  # noqa: E402
from kvtier.integrations.vllm.worker import WorkerSide  # noqa: E402
from kvtier.pool import HostPool  # noqa: E402


class AsyncBackend(CopyBackend):
    """Jobs finish only when the test says so; records what the worker asked for."""

    @classmethod
    def create(cls, kv_caches: Sequence[Any], setup: BackendSetup) -> AsyncBackend:
        return cls()

    def __init__(self) -> None:
        self.submitted: list[CopyJob] = []
        self.running: set[int] = set()
        self.finished: list[int] = []
        self.broken: list[int] = []
        self.fenced: list[list[int]] = []
        self.waited: list[list[int]] = []
        self.closed = False

    def submit(self, job: CopyJob) -> None:
        self.submitted.append(job)
        self.running.add(job.job_id)

    def finish(self, job_id: int, ok: bool = True) -> None:
        self.running.remove(job_id)
        (self.finished if ok else self.broken).append(job_id)

    def poll(self) -> CopyResults:
        out = CopyResults(self.finished, self.broken)
        self.finished, self.broken = [], []
        return out

    def wait(self, job_ids: Sequence[int]) -> None:
        self.waited.append(list(job_ids))
        for job_id in job_ids:
            if job_id in self.running:
                self.finish(job_id)

    def fence(self, job_ids: Sequence[int]) -> None:
        self.fenced.append(list(job_ids))

    def close(self) -> None:
        self.closed = True

    @property
    def slot_part_bytes(self) -> int:
        return 0


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[HostPool]:
    with HostPool.create(8, 4096, shm_dir=str(tmp_path)) as p:
        yield p


@pytest.fixture
def side(
    pool: HostPool, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[WorkerSide, AsyncBackend]]:
    backend = AsyncBackend()
    monkeypatch.setattr(worker_module, "make_backend", lambda *args: backend)
    worker = WorkerSide(blocks_per_slot=1, tp_rank=0, tp_size=1)
    worker.register([object()])
    yield worker, backend
    worker.close()


def meta(
    pool: HostPool, loads: list[CopyOrder] | None = None, stores: list[CopyOrder] | None = None
) -> KVTierMetadata:
    return KVTierMetadata(pool.handle, loads or [], stores or [])


def test_stores_are_not_waited_for_and_fence_the_next_step(
    side: tuple[WorkerSide, AsyncBackend], pool: HostPool
) -> None:
    worker, backend = side
    worker.save(meta(pool, stores=[CopyOrder(1, [0], [5]), CopyOrder(2, [1], [6])]))
    assert [j.job_id for j in backend.submitted] == [1, 2]
    assert backend.waited == []  # the step goes on
    assert worker.take_meta() is None  # nothing finished yet

    worker.fence(None)  # next step, blocks it writes unknown: it waits for both stores
    assert backend.fenced == [[1, 2]]
    backend.finish(1)
    worker.fence(None)  # job 1 is seen done first: only job 2 still fences
    assert backend.fenced[-1] == [2]
    meta_out = worker.take_meta()
    assert meta_out is not None and meta_out.done == {1: 1} and meta_out.failed == {}

    backend.finish(2, ok=False)
    worker.fence(None)
    assert len(backend.fenced) == 2  # nothing in flight: no fence
    meta_out = worker.take_meta()
    assert meta_out is not None and meta_out.done == {} and meta_out.failed == {2: 1}
    assert worker.take_meta() is None  # each result is reported once


def test_only_stores_of_fresh_blocks_fence_the_step(
    side: tuple[WorkerSide, AsyncBackend], pool: HostPool
) -> None:
    worker, backend = side
    stores = [CopyOrder(1, [0], [5]), CopyOrder(2, [1], [6]), CopyOrder(3, [2], [7])]
    worker.save(meta(pool, stores=stores))
    step = meta(pool)
    step.fresh_blocks = [9, 10]  # none of the stored blocks was handed out again
    worker.fence(step)
    assert backend.fenced == []  # the stores go on overlapping this step
    step.fresh_blocks = [10, 6]  # block 6 (store 2) went to another request
    worker.fence(step)
    assert backend.fenced == [[2]]
    step.fresh_blocks = []
    step.loads = [CopyOrder(4, [3], [7])]  # a load into block 7 (store 3)
    worker.fence(step)
    assert backend.fenced[-1] == [3]


def test_loads_wait_and_come_after_the_fence(
    side: tuple[WorkerSide, AsyncBackend], pool: HostPool
) -> None:
    worker, backend = side
    worker.save(meta(pool, stores=[CopyOrder(1, [0], [5])]))
    worker.start_load(meta(pool, loads=[CopyOrder(2, [3], [7]), CopyOrder(3, [4], [9])]))
    # The fence for store 1 was issued before the loads were submitted.
    assert backend.fenced == [[1]]
    assert [j.direction for j in backend.submitted] == [Direction.STORE] + [Direction.LOAD] * 2
    assert backend.waited == [[2, 3]]  # loads finish before the forward pass
    assert worker.take_load_errors() == set()
    out = worker.take_meta()
    assert out is not None and out.done == {2: 1, 3: 1}
    assert 1 in backend.running  # the store is still in flight


def test_failed_load_reports_its_blocks(
    side: tuple[WorkerSide, AsyncBackend], pool: HostPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker, backend = side

    def wait_and_fail(job_ids: Sequence[int]) -> None:
        for job_id in job_ids:
            backend.finish(job_id, ok=False)

    monkeypatch.setattr(backend, "wait", wait_and_fail)
    worker.start_load(meta(pool, loads=[CopyOrder(4, [2, 3], [10, -1])]))
    assert worker.take_load_errors() == {10}
    out = worker.take_meta()
    assert out is not None and out.failed == {4: 1}


def test_close_waits_for_stores_in_flight(
    side: tuple[WorkerSide, AsyncBackend], pool: HostPool
) -> None:
    worker, backend = side
    worker.save(meta(pool, stores=[CopyOrder(7, [0], [1])]))
    worker.close()
    assert backend.waited == [[7]] and backend.closed


def _shaped(*shape: int) -> Any:
    return SimpleNamespace(shape=shape)


def test_cuda_layout_from_vllm_shapes() -> None:
    # vLLM 0.32: [num_blocks, kv_heads, block_size, K + V] per layer, whatever the KV layout.
    assert cuda_layout([_shaped(100, 8, 16, 256)] * 3) is KVLayout.LAYER_BLOCKS_FIRST
    assert cuda_layout([_shaped(2, 8, 16, 256)] * 3) is KVLayout.LAYER_BLOCKS_FIRST
    # Older FlashAttention: [2, num_blocks, block_size, kv_heads, head_dim] per layer.
    assert cuda_layout([_shaped(2, 100, 16, 8, 128)] * 3) is KVLayout.LAYER_KV_FIRST
    # Older FlashInfer: [num_blocks, 2, block_size, kv_heads, head_dim].
    assert cuda_layout([_shaped(100, 2, 16, 8, 128)] * 3) is KVLayout.LAYER_BLOCKS_FIRST
    with pytest.raises(ValueError, match="unrecognised"):
        cuda_layout([_shaped(2, 2, 16, 8, 128)])  # two blocks: ambiguous
    with pytest.raises(ValueError, match="unrecognised"):
        cuda_layout([_shaped(100, 4096)])
    with pytest.raises(ValueError, match="different shapes"):
        cuda_layout([_shaped(2, 100, 16, 8, 128), _shaped(2, 99, 16, 8, 128)])


LAYOUT_NAMES = ["LBNHC", "LBHNC", "BLNHC", "BLHNC"]


def vllm_views(layout_name: str, layers: int, blocks: int) -> tuple[Any, list[Any], int]:
    """vLLM 0.32's own per-layer KV views over one CPU allocation (placed as its KVCacheTensor
    documents: layer-outermost layouts a run of blocks per layer, block-outermost ones a block
    of all layers' pages); the allocation, the views and the page size."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    layout = KVCacheLayout[layout_name]
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    page = spec.page_size_bytes
    outer = layout.is_block_outermost
    placement = KVCacheTensor(
        size=layers * blocks * page,
        layers=[f"layer.{i}" for i in range(layers)],
        layer_stride=page if outer else page * blocks,
        block_stride=page * layers if outer else page,
    )
    raw = torch.zeros(layers * blocks * page, dtype=torch.int8)
    return raw, create_kv_cache_views(raw, spec, blocks, layout, placement), page


@pytest.mark.parametrize("layout_name", LAYOUT_NAMES)
def test_vllm_032_views_map_to_their_pages(layout_name: str) -> None:
    """Each (layer, block) region is exactly the bytes of that view's block, the regions tile the
    allocation, and a block-outermost layout moves a block as one copy."""
    import ctypes

    import torch

    from kvtier.copy.cuda.plan import describe_kv, merge_regions

    layers, blocks = 3, 5
    raw, views, page = vllm_views(layout_name, layers, blocks)
    for layer, view in enumerate(views):
        for block in range(blocks):
            # through vLLM's (permuted) view, as 16-bit integers
            view[block].view(torch.int16).fill_(layer * blocks + block + 1)
    layout = cuda_layout(views)
    geo = describe_kv(views, layout)
    assert (geo.num_layers, geo.num_blocks, geo.piece_bytes) == (layers, blocks, page)
    spans = []
    for region in geo.regions:
        for block in range(blocks):
            start = region.base + block * region.stride
            got = ctypes.string_at(start, region.nbytes)
            value = (region.layer * blocks + block + 1).to_bytes(2, "little")
            assert got == value * (page // 2), (region.layer, block)
            spans.append((start - raw.data_ptr(), region.nbytes))
    assert sorted(spans) == [(i * page, page) for i in range(layers * blocks)]
    merged = merge_regions(geo.regions)
    if layout_name.startswith("BL"):
        assert [r.nbytes for r in merged] == [layers * page]
    else:
        assert len(merged) == layers
