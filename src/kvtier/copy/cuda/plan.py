"""Where every byte of a transfer lives: engine KV geometry, slot arrangement, copy lists.

Pure index arithmetic on integers and numpy arrays (no CUDA), so it is tested on any machine.

The engine's KV memory is described as *regions*: a region is one part of the KV cache (a layer,
or one layer's K or V) in which engine block ``b`` occupies ``nbytes`` contiguous bytes at
``base + b * stride``. Bytes are copied as they lie; the order of the dimensions inside a piece
does not matter. Every supported layout reduces to such regions:

* ``LAYER_KV_FIRST`` (vLLM's FlashAttention before 0.32): one tensor per layer,
  ``[2, num_blocks, block_size, kv_heads, head_dim]``; regions (layer, K) and (layer, V).
* ``LAYER_BLOCKS_FIRST``: one tensor per layer, ``[num_blocks, ...]``, each block's bytes one
  dense run at any block stride; one region per layer. These are vLLM 0.32's per-layer views
  (``[num_blocks, kv_heads, block_size, K + V]`` in any of its ``KVCacheLayout`` orders: a
  layer-outermost layout gives each layer its own run of blocks, a block-outermost one, such as
  ``BLNHC``, puts a block's layers next to each other, which ``merge_regions`` joins into one
  copy) and FlashInfer's ``[num_blocks, 2, ...]``.
* ``BLOCK_COMPACT``: one tensor ``[num_blocks, layers, 2, block_size, kv_heads, head_dim]``: a
  block is contiguous across all layers, so a whole block is one copy.

Slot arrangement (the same for all three layouts, given the same page bytes): a rank's part of
a slot holds its ``blocks_per_slot`` engine blocks one after another; one engine
block is its regions in order, i.e. for each layer its page (K then V in the first and last
layouts, as ``[layers, 2, block_size, kv_heads, head_dim]``).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Protocol

import numpy as np

from kvtier.copy.base import SKIP, CopyJob, Direction


class KVLayout(Enum):
    LAYER_KV_FIRST = "layer_kv_first"
    LAYER_BLOCKS_FIRST = "layer_blocks_first"
    BLOCK_COMPACT = "block_compact"


class TensorLike(Protocol):
    """What the planner reads off a KV tensor (``torch.Tensor`` has all of it)."""

    @property
    def shape(self) -> Sequence[int]: ...

    def stride(self) -> Sequence[int]: ...

    def data_ptr(self) -> int: ...

    def element_size(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Region:
    base: int
    """Address of engine block 0's bytes of this region."""
    stride: int
    """Bytes from one engine block to the next."""
    nbytes: int
    """Bytes of one block in this region (contiguous)."""
    layer: int
    """First layer this region covers."""
    host_offset: int
    """Offset of this region's bytes within one engine block's part of a slot."""


@dataclass(frozen=True, slots=True)
class KVGeometry:
    layout: KVLayout
    num_layers: int
    num_blocks: int
    regions: tuple[Region, ...]
    """Finest regions (per layer, or per layer and K/V), in slot order; all of equal ``nbytes``."""

    @property
    def block_bytes(self) -> int:
        """Bytes of one engine block across all layers (its share of a slot)."""
        return self.regions[0].nbytes * len(self.regions)

    @property
    def piece_bytes(self) -> int:
        return self.regions[0].nbytes

    def layer_regions(self, layer: int) -> range:
        """Indices into ``regions`` of one layer."""
        per = len(self.regions) // self.num_layers
        return range(layer * per, (layer + 1) * per)


def _inner_contiguous(t: TensorLike, first_dim: int) -> bool:
    """Whether dims ``first_dim..`` of ``t`` are laid out densely (row-major)."""
    expected = 1
    shape, stride = list(t.shape), list(t.stride())
    for dim in range(len(shape) - 1, first_dim - 1, -1):
        if shape[dim] != 1 and stride[dim] != expected:
            return False
        expected *= shape[dim]
    return True


def _dense(t: TensorLike, first_dim: int) -> bool:
    """Whether dims ``first_dim..`` of ``t`` cover one dense run of elements, in any order (vLLM
    permutes the dimensions inside a page by its KV cache layout)."""
    dims = sorted(
        (stride, size)
        for size, stride in zip(t.shape[first_dim:], t.stride()[first_dim:], strict=True)
        if size != 1
    )
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def describe_kv(kv_caches: Sequence[TensorLike], layout: KVLayout) -> KVGeometry:
    """Regions of an engine's KV tensors; raises ``ValueError`` naming what does not fit."""
    if not kv_caches:
        raise ValueError("no KV tensors given")
    regions: list[Region] = []
    offset = 0
    if layout is KVLayout.BLOCK_COMPACT:
        if len(kv_caches) != 1:
            raise ValueError(f"BLOCK_COMPACT takes one tensor, got {len(kv_caches)}")
        t = kv_caches[0]
        shape, stride, es = list(t.shape), list(t.stride()), t.element_size()
        if len(shape) < 4 or shape[2] != 2:
            raise ValueError(f"BLOCK_COMPACT wants [num_blocks, layers, 2, ...], got {shape}")
        if not _inner_contiguous(t, 1):
            raise ValueError("BLOCK_COMPACT: each block must be contiguous across layers")
        num_blocks, num_layers = shape[0], shape[1]
        piece = _prod(shape[3:]) * es
        for layer in range(num_layers):
            for kv in range(2):
                base = t.data_ptr() + (layer * stride[1] + kv * stride[2]) * es
                regions.append(Region(base, stride[0] * es, piece, layer, offset))
                offset += piece
        return KVGeometry(layout, num_layers, num_blocks, tuple(regions))

    num_layers = len(kv_caches)
    num_blocks = -1
    for layer, t in enumerate(kv_caches):
        shape, stride, es = list(t.shape), list(t.stride()), t.element_size()
        starts: tuple[int, ...]  # of the layer's regions, in elements from its data pointer
        if layout is KVLayout.LAYER_KV_FIRST:
            if len(shape) < 3 or shape[0] != 2 or not _dense(t, 2):
                raise ValueError(f"layer {layer}: want [2, num_blocks, ...] with dense blocks")
            blocks, block_stride, starts = shape[1], stride[1], (0, stride[0])
            piece = _prod(shape[2:]) * es
        else:
            if len(shape) < 2 or not _dense(t, 1):
                raise ValueError(f"layer {layer}: want [num_blocks, ...] with dense blocks")
            blocks, block_stride, starts = shape[0], stride[0], (0,)
            piece = _prod(shape[1:]) * es
        if num_blocks not in (-1, blocks):
            raise ValueError(f"layer {layer} has {blocks} blocks, layer 0 has {num_blocks}")
        num_blocks = blocks
        for start in starts:
            regions.append(
                Region(t.data_ptr() + start * es, block_stride * es, piece, layer, offset)
            )
            offset += piece
    if len({r.nbytes for r in regions}) != 1:
        raise ValueError(f"layers of different page sizes: {sorted({r.nbytes for r in regions})}")
    return KVGeometry(layout, num_layers, num_blocks, tuple(regions))


def merge_regions(regions: Sequence[Region]) -> list[Region]:
    """Join neighbours that are adjacent both in engine memory and in the slot (same stride).

    For ``BLOCK_COMPACT`` all regions of a block join into one (a block is one copy).
    """
    out: list[Region] = []
    for r in regions:
        if out:
            last = out[-1]
            if (
                r.stride == last.stride
                and r.base == last.base + last.nbytes
                and r.host_offset == last.host_offset + last.nbytes
            ):
                out[-1] = Region(
                    last.base, last.stride, last.nbytes + r.nbytes, last.layer, last.host_offset
                )
                continue
        out.append(r)
    return out


def host_block_addresses(
    pool_base: int,
    slot_stride: int,
    part_offset: int,
    slots: np.ndarray,
    blocks_per_slot: int,
    block_bytes: int,
) -> np.ndarray:
    """Host address of each engine block's bytes: slot by slot, ``blocks_per_slot`` per slot."""
    starts = np.uint64(pool_base + part_offset) + slots.astype(np.uint64) * np.uint64(slot_stride)
    if blocks_per_slot == 1:
        return starts
    within = np.arange(blocks_per_slot, dtype=np.uint64) * np.uint64(block_bytes)
    return (starts[:, None] + within[None, :]).reshape(-1)


@dataclass(frozen=True, slots=True)
class CopyList:
    """One batched copy: ``dsts[i] <- srcs[i]``, ``sizes[i]`` bytes (uintp arrays)."""

    dsts: np.ndarray
    srcs: np.ndarray
    sizes: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())


@dataclass(frozen=True, slots=True)
class RegionArrays:
    """Regions as uint64 columns, built once per region set (copy lists are made per job)."""

    base: np.ndarray
    stride: np.ndarray
    nbytes: np.ndarray
    host_offset: np.ndarray

    @classmethod
    def of(cls, regions: Sequence[Region]) -> RegionArrays:
        def column(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.uint64)

        return cls(
            column([r.base for r in regions]),
            column([r.stride for r in regions]),
            column([r.nbytes for r in regions]),
            column([r.host_offset for r in regions]),
        )


@dataclass(frozen=True, slots=True)
class PinnedPieces:
    """Where the pool's separate ``cudaHostRegister`` pieces begin. No copy may run across the
    start of one: the driver refuses it (cudaErrorInvalidValue on an H100, CUDA 13), so
    neighbouring slots are joined into one copy only inside a piece."""

    base: int
    step: int
    """Bytes per piece (whole slots); 0: the pool is one piece (or not pinned)."""

    def starts(self, hosts: np.ndarray) -> np.ndarray:
        """Per host address (uint64), whether a piece begins there."""
        if self.step <= 0:
            return np.zeros(len(hosts), dtype=bool)
        offsets = hosts.astype(np.uint64) - np.uint64(self.base)
        return np.asarray(offsets % np.uint64(self.step) == 0)


ONE_PIECE = PinnedPieces(0, 0)


def copy_list(
    regions: RegionArrays | Sequence[Region],
    engine_blocks: np.ndarray,
    host_addrs: np.ndarray,
    to_host: bool,
    coalesce: bool = True,
    pieces: PinnedPieces = ONE_PIECE,
) -> CopyList:
    """Copies of ``regions`` for each engine block (block-major), joined where contiguous
    inside one of the pool's pinned ``pieces``."""
    cols = regions if isinstance(regions, RegionArrays) else RegionArrays.of(regions)
    blocks = engine_blocks.astype(np.uint64)
    dev = (cols.base[None, :] + blocks[:, None] * cols.stride[None, :]).reshape(-1)
    host = (host_addrs.astype(np.uint64)[:, None] + cols.host_offset[None, :]).reshape(-1)
    sizes = np.tile(cols.nbytes, len(engine_blocks))
    if coalesce:
        dev, host, sizes = join_contiguous(dev, host, sizes, pieces.starts(host))
    dev, host = dev.astype(np.uintp), host.astype(np.uintp)
    sizes = np.ascontiguousarray(sizes, dtype=np.uintp)
    return CopyList(host, dev, sizes) if to_host else CopyList(dev, host, sizes)


def join_contiguous(
    a: np.ndarray, b: np.ndarray, sizes: np.ndarray, breaks: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Copies ``a[i] <-> b[i]`` of ``sizes[i]`` bytes, each run that continues the one before on
    both sides joined into one (the driver's cost is per copy, about a microsecond each), except
    where ``breaks[i]`` (copy ``i`` must start a copy of its own)."""
    if len(sizes) < 2:
        return a, b, sizes
    joins = (a[1:] == a[:-1] + sizes[:-1]) & (b[1:] == b[:-1] + sizes[:-1])
    if breaks is not None:
        joins &= ~breaks[1:]
    if not joins.any():
        return a, b, sizes
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return a[starts], b[starts], np.add.reduceat(sizes, starts)


def check_job(
    engine_blocks: Sequence[int] | np.ndarray,
    slots: Sequence[int] | np.ndarray,
    blocks_per_slot: int,
    num_engine_blocks: int,
    num_slots: int,
    skips: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """The job's block ids and slots as int64 arrays; ``ValueError`` saying what is wrong.
    ``skips``: ``SKIP`` ids are allowed (a LOAD's positions the engine already holds)."""
    blocks = np.asarray(engine_blocks, dtype=np.int64).reshape(-1)
    slot_arr = np.asarray(slots, dtype=np.int64).reshape(-1)
    if len(blocks) != len(slot_arr) * blocks_per_slot:
        raise ValueError(
            f"{len(blocks)} engine blocks for {len(slot_arr)} slots of {blocks_per_slot} blocks"
        )
    if not _within(blocks[blocks != SKIP] if skips else blocks, num_engine_blocks):
        raise ValueError(f"engine block id outside 0..{num_engine_blocks - 1}")
    if not _within(slot_arr, num_slots):
        raise ValueError(f"slot outside 0..{num_slots - 1}")
    return blocks, slot_arr


@dataclass(frozen=True, slots=True)
class Plan:
    """A checked job: what its strategy enqueues."""

    to_host: bool
    blocks: np.ndarray
    """Engine block ids (int64)."""
    hosts: np.ndarray
    """Host address of each engine block's bytes in its slot (uint64)."""


def plan_job(
    job: CopyJob,
    geometry: KVGeometry,
    blocks_per_slot: int,
    num_slots: int,
    pool_base: int,
    slot_stride: int,
    part_offset: int,
) -> Plan:
    """``job`` checked (``ValueError`` or ``TypeError`` saying what is wrong) and planned: its
    engine blocks and the host address of each in its slot, a LOAD's ``SKIP`` positions left out
    (each kept block keeps its place in its slot)."""
    if job.direction not in (Direction.STORE, Direction.LOAD):
        raise ValueError(f"unknown direction {job.direction!r}")
    load = job.direction is Direction.LOAD
    blocks, slots = check_job(
        job.engine_blocks, job.slots, blocks_per_slot, geometry.num_blocks, num_slots, skips=load
    )
    hosts = host_block_addresses(
        pool_base, slot_stride, part_offset, slots, blocks_per_slot, geometry.block_bytes
    )
    if load:
        keep = blocks != SKIP
        if not keep.all():
            blocks, hosts = blocks[keep], hosts[keep]
    return Plan(not load, blocks, hosts)


def _within(values: np.ndarray, end: int) -> bool:
    """All of ``values`` in ``[0, end)`` (a few: in Python, cheaper than two reductions)."""
    if not len(values):
        return True
    if len(values) <= 8:
        return all(0 <= v < end for v in values.tolist())
    return bool(values.min() >= 0 and values.max() < end)


# -- kernel launches ----------------------------------------------------------------------------

KERNEL_CAPACITIES = (8, 64, 512, 2048)
"""Blocks per launch of each compiled kernel variant (its by-value parameter array size)."""
PARAM_HEADER_BYTES = 32
PARAM_HEADER_FORMAT = "=Qq4i"
"""The header: region table address, piece bytes, region_begin, n_regions, n_blocks, to_host."""


def param_bytes(capacity: int) -> int:
    """Bytes of ``Params<capacity>``: header, u64 ``host_addr[capacity]``, i32 ``block_id[...]``."""
    size = PARAM_HEADER_BYTES + 8 * capacity + 4 * capacity
    return -(-size // 8) * 8


def pick_capacity(n_blocks: int) -> int:
    for cap in KERNEL_CAPACITIES:
        if n_blocks <= cap:
            return cap
    return KERNEL_CAPACITIES[-1]


def pack_params(
    buf: np.ndarray,
    capacity: int,
    region_table: int,
    piece_bytes: int,
    region_begin: int,
    n_regions: int,
    to_host: bool,
    engine_blocks: np.ndarray,
    host_addrs: np.ndarray,
) -> None:
    """Write one launch's ``Params<capacity>`` into ``buf`` (uint8, at least ``param_bytes``).

    The layout matches the ``Params`` struct in ``kernels``: u64 region table address,
    i64 piece bytes, i32 region_begin, n_regions, n_blocks, to_host, then the two arrays.
    """
    n = len(engine_blocks)
    if n > capacity:
        raise ValueError(f"{n} blocks exceed the launch capacity {capacity}")
    header = (region_table, piece_bytes, region_begin, n_regions, n, 1 if to_host else 0)
    struct.pack_into(PARAM_HEADER_FORMAT, buf.data, 0, *header)
    start = PARAM_HEADER_BYTES
    buf[start : start + 8 * n].view(np.uint64)[:] = host_addrs
    start += 8 * capacity
    buf[start : start + 4 * n].view(np.int32)[:] = engine_blocks


def with_region_begins(params: np.ndarray, region_begins: Sequence[int]) -> np.ndarray:
    """Copies of one launch's packed ``params``, one row per first region (a layer-wise copy
    launches the same blocks once per layer; only ``region_begin`` differs)."""
    rows = np.tile(params, (len(region_begins), 1))
    rows[:, 16:20].view(np.int32)[:, 0] = region_begins
    return rows


def region_table(regions: Sequence[Region]) -> np.ndarray:
    """The device-side region table: per region ``(base, stride, host_offset)`` as uint64."""
    return np.array([(r.base, r.stride, r.host_offset) for r in regions], dtype=np.uint64).reshape(
        -1
    )


def emulate_kernel(
    params: np.ndarray,
    capacity: int,
    read_region: Callable[[int], tuple[int, int, int]],
    move: Callable[[int, int, int], None],
) -> None:
    """Do one launch's copies on the CPU as the kernel would, from its packed ``params``:
    ``read_region(i)`` gives region table row ``i`` (base, stride, host_offset) and
    ``move(dst, src, nbytes)`` copies. For tests of the index arithmetic and the packing."""
    header = params[:PARAM_HEADER_BYTES]
    piece = int(header[8:16].view(np.int64)[0])
    region_begin, n_regions, n_blocks, to_host = (int(x) for x in header[16:32].view(np.int32))
    start = PARAM_HEADER_BYTES
    host_addr = params[start : start + 8 * n_blocks].view(np.uint64)
    start += 8 * capacity
    block_id = params[start : start + 4 * n_blocks].view(np.int32)
    for unit in range(n_blocks * n_regions):
        b, r = divmod(unit, n_regions)
        base, stride, host_offset = read_region(region_begin + r)
        dev = base + stride * int(block_id[b])
        host = int(host_addr[b]) + host_offset
        if to_host:
            move(host, dev, piece)
        else:
            move(dev, host, piece)


def cuda_layout(kv_caches: Sequence[Any]) -> KVLayout:
    """Which layout an engine's per-layer CUDA tensors have (the backend checks their strides):
    vLLM 0.32's ``[num_blocks, kv_heads, block_size, K + V]`` views, in whichever
    ``KVCacheLayout`` order, and FlashInfer's older ``[num_blocks, 2, ...]`` are
    ``LAYER_BLOCKS_FIRST``; FlashAttention's older ``[2, num_blocks, ...]`` is
    ``LAYER_KV_FIRST``."""
    shapes = {tuple(t.shape) for t in kv_caches}
    if len(shapes) != 1:
        raise ValueError(f"KV tensors of different shapes: {sorted(shapes)}")
    shape = next(iter(shapes))
    if len(shape) == 4:
        return KVLayout.LAYER_BLOCKS_FIRST
    if len(shape) == 5 and shape[0] == 2 and shape[1] != 2:
        return KVLayout.LAYER_KV_FIRST
    if len(shape) == 5 and shape[1] == 2 and shape[0] != 2:
        return KVLayout.LAYER_BLOCKS_FIRST
    raise ValueError(
        f"unrecognised per-layer KV shape {shape} (want [blocks, heads, tokens, K+V], "
        "[2, blocks, ...] or [blocks, 2, ...])"
    )
