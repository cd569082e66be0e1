"""The CUDA backend's index arithmetic, on the CPU: regions, slot arrangement, copy lists and the
kernel's parameter packing (through its CPU emulation)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from support.emulated_cuda import FakeTensor
from support.kv_reference import block_bytes, engine_arrays, logical_blocks

from kvtier.copy.cuda.plan import (
    KVLayout,
    check_job,
    copy_list,
    describe_kv,
    emulate_kernel,
    host_block_addresses,
    merge_regions,
    pack_params,
    param_bytes,
    pick_capacity,
    region_table,
    with_region_begins,
)

LAYOUTS = list(KVLayout)


def _tensors(arrays: list[np.ndarray]) -> list[FakeTensor]:
    return [FakeTensor(a) for a in arrays]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_regions_give_the_same_slot_bytes_for_every_layout(layout: KVLayout) -> None:
    rng = np.random.default_rng(1)
    logical = logical_blocks(rng, 5)
    arrays = engine_arrays(logical, layout)
    geo = describe_kv(_tensors(arrays), layout)
    assert geo.num_blocks == 5 and geo.num_layers == logical.shape[1]
    assert geo.block_bytes == logical[0].nbytes
    assert all(r.nbytes == geo.piece_bytes for r in geo.regions)
    for block in range(5):
        got = b"".join(ctypes.string_at(r.base + block * r.stride, r.nbytes) for r in geo.regions)
        assert got == block_bytes(logical, block)
        offsets = [r.host_offset for r in geo.regions]
        assert offsets == [i * geo.piece_bytes for i in range(len(geo.regions))]


def test_merge_joins_a_compact_block_into_one_copy() -> None:
    logical = logical_blocks(np.random.default_rng(2), 4)
    arrays = engine_arrays(logical, KVLayout.BLOCK_COMPACT)
    geo = describe_kv(_tensors(arrays), KVLayout.BLOCK_COMPACT)
    merged = merge_regions(geo.regions)
    assert len(merged) == 1 and merged[0].nbytes == geo.block_bytes
    kv_first = describe_kv(
        _tensors(engine_arrays(logical, KVLayout.LAYER_KV_FIRST)), KVLayout.LAYER_KV_FIRST
    )
    assert len(merge_regions(kv_first.regions)) == len(kv_first.regions)  # K and V apart
    blocks_first = describe_kv(
        _tensors(engine_arrays(logical, KVLayout.LAYER_BLOCKS_FIRST)), KVLayout.LAYER_BLOCKS_FIRST
    )
    # K and V of one layer are adjacent; layers are separate tensors (adjacent only by chance).
    assert len(merge_regions(blocks_first.regions)) <= blocks_first.num_layers


def test_layouts_are_checked() -> None:
    logical = logical_blocks(np.random.default_rng(3), 4)
    arrays = engine_arrays(logical, KVLayout.LAYER_KV_FIRST)
    with pytest.raises(ValueError, match="want"):
        describe_kv(_tensors([a[:, :, ::2] for a in arrays]), KVLayout.LAYER_BLOCKS_FIRST)
    with pytest.raises(ValueError, match="page sizes"):
        describe_kv(
            _tensors([arrays[0], np.ascontiguousarray(arrays[1][:, :, :2])]),
            KVLayout.LAYER_BLOCKS_FIRST,
        )
    permuted = [
        np.ascontiguousarray(a.transpose(0, 1, 3, 2, 4)).transpose(0, 1, 3, 2, 4) for a in arrays
    ]
    assert (
        describe_kv(_tensors(permuted), KVLayout.LAYER_KV_FIRST).piece_bytes
        == arrays[0][0, 0].nbytes
    )
    with pytest.raises(ValueError, match="one tensor"):
        describe_kv(_tensors(arrays), KVLayout.BLOCK_COMPACT)
    strided = [a[:, ::2] for a in arrays]  # blocks still dense, fewer of them: fine
    assert describe_kv(_tensors(strided), KVLayout.LAYER_KV_FIRST).num_blocks == 2
    torn = [a[..., ::2] for a in arrays]  # a block no longer dense
    with pytest.raises(ValueError):
        describe_kv(_tensors(torn), KVLayout.LAYER_KV_FIRST)
    uneven = [arrays[0], arrays[1][:, :3]]
    with pytest.raises(ValueError, match="blocks"):
        describe_kv(_tensors(uneven), KVLayout.LAYER_KV_FIRST)


def test_host_addresses_slot_by_slot_with_parts() -> None:
    slots = np.array([3, 0], dtype=np.int64)
    got = host_block_addresses(1000, 256, 64, slots, 2, 16)
    assert got.tolist() == [1000 + 64 + 3 * 256, 1000 + 64 + 3 * 256 + 16, 1064, 1080]


def test_check_job() -> None:
    blocks, slots = check_job([4, 5, 6, 7], [1, 0], 2, 8, 2)
    assert blocks.tolist() == [4, 5, 6, 7] and slots.tolist() == [1, 0]
    with pytest.raises(ValueError, match="engine blocks for"):
        check_job([1, 2, 3], [0, 1], 2, 8, 2)
    with pytest.raises(ValueError, match="engine block id"):
        check_job([8], [0], 1, 8, 2)
    with pytest.raises(ValueError, match="slot outside"):
        check_job([0], [-1], 1, 8, 2)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("to_host", [True, False])
def test_copy_list_moves_every_byte(layout: KVLayout, to_host: bool) -> None:
    rng = np.random.default_rng(4)
    logical = logical_blocks(rng, 9)
    arrays = engine_arrays(logical, layout)
    geo = describe_kv(_tensors(arrays), layout)
    host = np.full((6, geo.block_bytes + 32), 0xAB, dtype=np.uint8)
    blocks = np.array([7, 2, 3, 0, 8], dtype=np.int64)
    slots = np.array([5, 1, 2, 0, 3], dtype=np.int64)
    hosts = host_block_addresses(host.ctypes.data, host.shape[1], 0, slots, 1, geo.block_bytes)
    if not to_host:
        for b, s in zip(blocks, slots, strict=True):
            host[s, : geo.block_bytes] = np.frombuffer(block_bytes(logical, int(b)), np.uint8)
        for a in arrays:
            a.fill(0xDEAD)
    copies = copy_list(merge_regions(geo.regions), blocks, hosts, to_host)
    for dst, src, size in zip(
        copies.dsts.tolist(), copies.srcs.tolist(), copies.sizes.tolist(), strict=True
    ):
        ctypes.memmove(dst, src, size)
    assert copies.nbytes == len(blocks) * geo.block_bytes
    if to_host:
        for b, s in zip(blocks, slots, strict=True):
            assert host[s, : geo.block_bytes].tobytes() == block_bytes(logical, int(b))
        assert (host[4] == 0xAB).all() and (host[:, geo.block_bytes :] == 0xAB).all()
    else:
        from support.kv_reference import to_logical

        got = to_logical(arrays, layout)
        for b in range(9):
            if b in blocks:
                assert got[b].tobytes() == block_bytes(logical, b)
            else:
                assert (got[b] == 0xDEAD).all()


def test_copy_list_coalesces_runs() -> None:
    logical = logical_blocks(np.random.default_rng(5), 8)
    arrays = engine_arrays(logical, KVLayout.BLOCK_COMPACT)
    geo = describe_kv(_tensors(arrays), KVLayout.BLOCK_COMPACT)
    blocks = np.array([2, 3, 4, 6], dtype=np.int64)
    hosts = np.array(
        [10_000, 10_000 + geo.block_bytes, 10_000 + 2 * geo.block_bytes, 50_000], dtype=np.uint64
    )
    copies = copy_list(merge_regions(geo.regions), blocks, hosts, to_host=True)
    assert copies.sizes.tolist() == [3 * geo.block_bytes, geo.block_bytes]
    assert copies.dsts.tolist() == [10_000, 50_000]


def test_capacities_and_param_sizes() -> None:
    assert pick_capacity(1) == 8 and pick_capacity(9) == 64 and pick_capacity(512) == 512
    assert pick_capacity(5000) == 2048
    assert param_bytes(2048) < 32764  # CUDA's kernel parameter limit (Volta+, CUDA >= 12.1)
    assert param_bytes(8) % 8 == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("to_host", [True, False])
def test_kernel_params_drive_the_emulated_kernel(layout: KVLayout, to_host: bool) -> None:
    rng = np.random.default_rng(6)
    logical = logical_blocks(rng, 10)
    arrays = engine_arrays(logical, layout)
    geo = describe_kv(_tensors(arrays), layout)
    table = region_table(geo.regions)
    rows = table.reshape(-1, 3)
    host = np.full((4, geo.block_bytes), 0xCD, dtype=np.uint8)
    blocks = np.array([9, 0, 4], dtype=np.int64)
    slots = np.array([2, 3, 0], dtype=np.int64)
    hosts = host_block_addresses(host.ctypes.data, host.shape[1], 0, slots, 1, geo.block_bytes)
    if not to_host:
        for b, s in zip(blocks, slots, strict=True):
            host[s] = np.frombuffer(block_bytes(logical, int(b)), np.uint8)
        for a in arrays:
            a.fill(0xBEEF)
    capacity = pick_capacity(len(blocks))
    buf = np.zeros(param_bytes(2048), dtype=np.uint8)
    # Layer by layer, as a layer-wise load launches.
    for layer in range(geo.num_layers):
        rng_regions = geo.layer_regions(layer)
        pack_params(
            buf,
            capacity,
            0,
            geo.piece_bytes,
            rng_regions.start,
            len(rng_regions),
            to_host,
            blocks,
            hosts,
        )
        emulate_kernel(
            buf,
            capacity,
            lambda i: (int(rows[i, 0]), int(rows[i, 1]), int(rows[i, 2])),
            ctypes.memmove,
        )
    if to_host:
        for b, s in zip(blocks, slots, strict=True):
            assert host[s].tobytes() == block_bytes(logical, int(b))
        assert (host[1] == 0xCD).all()
    else:
        from support.kv_reference import to_logical

        got = to_logical(arrays, layout)
        for b in range(10):
            if b in blocks:
                assert got[b].tobytes() == block_bytes(logical, b)
            else:
                assert (got[b] == 0xBEEF).all()


def test_region_begins_repeat_one_pack() -> None:
    rng = np.random.default_rng(9)
    blocks = rng.permutation(100)[:5].astype(np.int64)
    hosts = rng.integers(0, 1 << 40, 5).astype(np.uint64)
    one = np.zeros(param_bytes(8), dtype=np.uint8)
    pack_params(one, 8, 0x1000, 4096, 0, 2, True, blocks, hosts)
    rows = with_region_begins(one, [0, 2, 4])
    for row, begin in zip(rows, [0, 2, 4], strict=True):
        expected = np.zeros(param_bytes(8), dtype=np.uint8)
        pack_params(expected, 8, 0x1000, 4096, begin, 2, True, blocks, hosts)
        assert row.tobytes() == expected.tobytes()
