"""Copy backend for engines whose KV cache lives in host memory (vLLM's CPU build).

Each engine block of each layer is copied as an opaque page (the CPU attention kernels pack K and
V in an ISA-specific order, so the bytes are never interpreted). A rank's part of a slot holds
``[layer][sub_block][page]``. Copies run synchronously inside ``submit`` (host memory to host
memory, a few GB/s); ``poll`` then reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.copy.base import SKIP, BackendSetup, CopyBackend, CopyJob, CopyResults, Direction
from kvtier.pool import HostPool


class CpuCopyBackend(CopyBackend):
    kind = "cpu"

    @classmethod
    def create(cls, kv_caches: Sequence[Any], setup: BackendSetup) -> CpuCopyBackend:
        """The copy options do not apply: a CPU copy is one ``memcpy`` per piece."""
        return cls(
            kv_caches,
            setup.pool,
            blocks_per_slot=setup.blocks_per_slot,
            tp_rank=setup.tp_rank,
            tp_size=setup.tp_size,
        )

    def __init__(
        self,
        kv_caches: Sequence[Any],
        pool: HostPool,
        *,
        blocks_per_slot: int = 1,
        tp_rank: int = 0,
        tp_size: int = 1,
    ) -> None:
        import torch

        if not kv_caches:
            raise ValueError("no KV tensors to copy")
        if blocks_per_slot < 1 or not 0 <= tp_rank < tp_size:
            raise ValueError(f"bad blocks_per_slot={blocks_per_slot} / tp {tp_rank} of {tp_size}")
        num_blocks = kv_caches[0].shape[0]
        pages = []
        for kv in kv_caches:
            if kv.device.type != "cpu" or not kv.is_contiguous() or kv.shape[0] != num_blocks:
                raise ValueError(
                    "KV tensors must be contiguous CPU tensors with equal block counts"
                )
            pages.append(kv.view(torch.uint8).reshape(num_blocks, -1))
        page_bytes = pages[0].shape[1]
        if any(p.shape[1] != page_bytes for p in pages):
            raise ValueError("all layers must have the same page size")
        self._torch = torch
        self._pages = pages
        self.num_blocks = num_blocks
        self.blocks_per_slot = blocks_per_slot
        self._part_bytes = int(len(pages) * blocks_per_slot * page_bytes)
        if pool.slot_bytes < tp_size * self._part_bytes:
            raise ValueError(
                f"pool slots of {pool.slot_bytes} bytes cannot hold {tp_size} parts of "
                f"{self._part_bytes} bytes"
            )
        offset = tp_rank * self._part_bytes
        whole = torch.from_numpy(pool.array())
        part = whole[:, offset : offset + self._part_bytes]
        # A view: rows keep the pool's slot stride, each row splits into layer x sub-block x page.
        self._slots = part.as_strided(
            (pool.num_slots, len(pages), blocks_per_slot, page_bytes),
            (pool.slot_stride, blocks_per_slot * page_bytes, page_bytes, 1),
            offset,
        )
        self._num_slots = pool.num_slots
        self._done: list[int] = []
        self._failed: list[int] = []

    @property
    def slot_part_bytes(self) -> int:
        return self._part_bytes

    def submit(self, job: CopyJob) -> None:
        try:
            self._copy(job)
        except Exception:
            self._failed.append(job.job_id)
        else:
            self._done.append(job.job_id)

    def _copy(self, job: CopyJob) -> None:
        torch = self._torch
        bps = self.blocks_per_slot
        if len(job.engine_blocks) != len(job.slots) * bps:
            raise ValueError("engine_blocks must hold blocks_per_slot ids per slot")
        slot_idx: list[int] = []
        sub_idx: list[int] = []
        engine_idx: list[int] = []
        for i, block in enumerate(job.engine_blocks):
            if block == SKIP and job.direction is Direction.LOAD:
                continue
            slot = job.slots[i // bps]
            if not (0 <= slot < self._num_slots and 0 <= block < self.num_blocks):
                raise IndexError(f"slot {slot} or engine block {block} out of range")
            slot_idx.append(slot)
            sub_idx.append(i % bps)
            engine_idx.append(block)
        if not engine_idx:
            return
        slots_t = torch.tensor(slot_idx)
        subs_t = torch.tensor(sub_idx)
        engine_t = torch.tensor(engine_idx)
        for layer, pages in enumerate(self._pages):
            layer_t = torch.full_like(slots_t, layer)
            if job.direction is Direction.STORE:
                self._slots.index_put_((slots_t, layer_t, subs_t), pages.index_select(0, engine_t))
            else:
                pages.index_copy_(0, engine_t, self._slots[slots_t, layer_t, subs_t])

    def poll(self) -> CopyResults:
        done, failed = self._done, self._failed
        self._done, self._failed = [], []
        return CopyResults(done, failed)

    def wait(self, job_ids: Sequence[int]) -> None:
        return  # copies finish inside submit

    def close(self) -> None:
        self._pages = []
