"""The ``dma`` strategy: the copy engines alone, no SM.

One ``cudaMemcpyBatchAsync`` (CUDA >= 12.8) over all of a transfer's pieces, with the engine's
adjacent regions merged first (``BLOCK_COMPACT`` and vLLM's block-outermost layouts: one copy per
block); without the batched call, one ``cudaMemcpyAsync`` per piece. ``dma_lanes`` > 1 splits the
copy over that many streams that fork from and join back into the transfer's stream.
"""

from __future__ import annotations

import numpy as np

from kvtier.copy.cuda.executor import Recorder
from kvtier.copy.cuda.plan import (
    CopyList,
    KVGeometry,
    PinnedPieces,
    Plan,
    Region,
    RegionArrays,
    copy_list,
    merge_regions,
)
from kvtier.copy.cuda.queue import Transfer
from kvtier.copy.cuda.resources import EventPool, StreamPool
from kvtier.copy.cuda.runtime import MemcpyAttributes
from kvtier.copy.cuda.strategy import Strategy, hand_over, layer_done, take_lanes


class DmaStrategy(Strategy):
    name = "dma"

    def __init__(
        self,
        geometry: KVGeometry,
        merged: list[Region],
        attrs: dict[bool, MemcpyAttributes],
        dma_lanes: int,
        streams: StreamPool,
        events: EventPool,
        pieces: PinnedPieces,
    ) -> None:
        """``merged``: the engine's regions merged where adjacent; ``attrs``: the batched copy's
        attributes per direction (``to_host``); ``pieces``: where the pool's pinned pieces begin
        (no copy runs across one)."""
        self._geometry = geometry
        self._pieces_pinned = pieces
        layer_merged = [
            merge_regions([geometry.regions[i] for i in geometry.layer_regions(layer)])
            for layer in range(geometry.num_layers)
        ]
        self._arrays = RegionArrays.of(merged)
        self._layer_arrays = [RegionArrays.of(regions) for regions in layer_merged]
        self._pieces = len(merged)
        self._layer_pieces = sum(len(regions) for regions in layer_merged)
        self._attrs = attrs
        self._dma_lanes = dma_lanes
        self._streams = streams
        self._events = events

    def estimate_ops(self, transfer: Transfer) -> int:
        n = len(transfer.job.engine_blocks)
        return n * (self._layer_pieces if transfer.layerwise else self._pieces)

    def enqueue(self, rec: Recorder, transfer: Transfer, plan: Plan) -> None:
        if not transfer.layerwise:
            copies = copy_list(
                self._arrays, plan.blocks, plan.hosts, plan.to_host, pieces=self._pieces_pinned
            )
            self.dma(rec, transfer, copies, plan.to_host)
            return
        for layer in range(self._geometry.num_layers):
            copies = copy_list(
                self._layer_arrays[layer],
                plan.blocks,
                plan.hosts,
                plan.to_host,
                pieces=self._pieces_pinned,
            )
            self.dma(rec, transfer, copies, plan.to_host)
            layer_done(rec, self._events, transfer)

    def dma(self, rec: Recorder, transfer: Transfer, copies: CopyList, to_host: bool) -> None:
        """One batched copy, split over ``dma_lanes`` streams that fork from and join back into
        the transfer's stream."""
        lanes = min(self._dma_lanes, len(copies.sizes))
        if lanes <= 1:
            self._batch(rec, transfer.stream, copies, to_host)
            return
        extra = take_lanes(self._streams, transfer, lanes - 1)
        hand_over(rec, self._events, transfer.stream, *extra)
        bounds = np.linspace(0, len(copies.sizes), lanes + 1).astype(np.int64).tolist()
        for lane, stream in enumerate([transfer.stream, *extra]):
            part = slice(bounds[lane], bounds[lane + 1])
            self._batch(
                rec,
                stream,
                CopyList(copies.dsts[part], copies.srcs[part], copies.sizes[part]),
                to_host,
            )
        for stream in extra:
            hand_over(rec, self._events, stream, transfer.stream)

    def _batch(self, rec: Recorder, stream: int, copies: CopyList, to_host: bool) -> None:
        if rec.has_batch_memcpy and len(copies.sizes) > 1:  # (one copy: no batch needed)
            rec.memcpy_batch_async(
                copies.dsts, copies.srcs, copies.sizes, self._attrs[to_host], stream
            )
            return
        for dst, src, size in zip(
            copies.dsts.tolist(), copies.srcs.tolist(), copies.sizes.tolist(), strict=True
        ):
            rec.memcpy_async(dst, src, size, stream)
