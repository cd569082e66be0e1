"""The CPU copy backend: random pages in, poisoned destinations, every byte checked."""

from __future__ import annotations

import pytest
from support import require

torch = require.importorskip("torch", "vllm")

from kvtier.copy.base import SKIP, CopyJob, Direction  # noqa: E402
from kvtier.copy.cpu import CpuCopyBackend  # noqa: E402
from kvtier.pool import HostPool  # noqa: E402

LAYERS, BLOCKS, HEADS, BS, HD = 3, 10, 2, 4, 8


def make_kv(seed: int) -> list[object]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(BLOCKS, HEADS, BS, 2 * HD, generator=gen) for _ in range(LAYERS)]


@pytest.mark.parametrize(("bps", "tp_size"), [(1, 1), (2, 1), (2, 2)])
def test_store_then_load_round_trips_into_poisoned_blocks(bps, tp_size):
    page = HEADS * BS * 2 * HD * 4
    pool = HostPool.create(6, tp_size * LAYERS * bps * page)
    try:
        src, dst = make_kv(1), make_kv(2)
        for t in dst:
            t.fill_(float("nan"))
        backends = [
            CpuCopyBackend(src, pool, blocks_per_slot=bps, tp_rank=r, tp_size=tp_size)
            for r in range(tp_size)
        ]
        slots = [4, 1]
        engine = [7, 2, 5, 0][: len(slots) * bps]
        pool.array()[:] = 0xAB
        for i, b in enumerate(backends):
            b.submit(CopyJob(i, Direction.STORE, engine, slots))
            assert b.poll().done == [i]
        loader = CpuCopyBackend(dst, pool, blocks_per_slot=bps, tp_rank=0, tp_size=tp_size)
        target = [3, 9, 6, 8][: len(slots) * bps]
        loader.submit(CopyJob(9, Direction.LOAD, target, slots))
        assert loader.poll().done == [9]
        for layer in range(LAYERS):
            for e, t in zip(engine, target, strict=True):
                assert torch.equal(dst[layer][t], src[layer][e])
            untouched = [b for b in range(BLOCKS) if b not in target]
            assert torch.isnan(dst[layer][untouched]).all()
        # Bytes outside every rank's part of the used slots stay poison.
        arr = pool.array()
        assert (arr[[0, 2, 3, 5]] == 0xAB).all()
    finally:
        pool.close()


def test_load_skips_blocks_the_engine_already_has_and_bad_jobs_fail():
    page = HEADS * BS * 2 * HD * 4
    pool = HostPool.create(2, LAYERS * 2 * page)
    try:
        src, dst = make_kv(3), make_kv(4)
        backend = CpuCopyBackend(src, pool, blocks_per_slot=2)
        backend.submit(CopyJob(0, Direction.STORE, [1, 2], [0]))
        before = [t[5].clone() for t in dst]
        loader = CpuCopyBackend(dst, pool, blocks_per_slot=2)
        loader.submit(CopyJob(1, Direction.LOAD, [SKIP, 6], [0]))
        loader.submit(CopyJob(2, Direction.LOAD, [1, 2], [7]))  # slot out of range
        loader.submit(CopyJob(3, Direction.LOAD, [1], [0]))  # wrong block count
        loader.submit(CopyJob(4, Direction.LOAD, [SKIP, SKIP], [0]))  # nothing to copy
        loader.submit(CopyJob(5, Direction.STORE, [SKIP, 6], [1]))  # SKIP only in a LOAD
        results = loader.poll()
        assert results.done == [1, 4] and results.failed == [2, 3, 5]
        for layer in range(LAYERS):
            assert torch.equal(dst[layer][6], src[layer][2])
            assert torch.equal(dst[layer][5], before[layer])
    finally:
        pool.close()


def test_pool_too_small_for_the_geometry_is_refused():
    pool = HostPool.create(2, 64)
    try:
        with pytest.raises(ValueError, match="cannot hold"):
            CpuCopyBackend(make_kv(0), pool)
    finally:
        pool.close()
