"""The CUDA backend's full option record (``CudaCopyOptions``), built from the config's ``copy``
section (``kvtier.copy.options.CopyConfig``) and ``pool.allow_pageable``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvtier.copy.options import STRATEGY_NAMES, CopyConfig
from kvtier.errors import ConfigError

DEFAULT_MAX_SMS = 8
"""SMs the copy kernel occupies where ``max_sms`` is 0."""
GIB = 1 << 30
MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class CudaCopyOptions:
    strategy: str = "auto"
    """A ``CopyStrategy`` value. ``auto``: ``dma`` for pieces of at least
    ``dma_min_piece_bytes``, else ``staged``; or one of ``dma``, ``staged``, ``kernel`` (see
    ``docs/cuda.md``)."""
    max_sms: int = 0
    """SMs the copy kernel may occupy (its grid size); 0: ``DEFAULT_MAX_SMS``."""
    allow_pageable: bool = False
    """Run on pageable memory (DMA only, slow) where pinning the pool fails, instead of raising."""
    dma_min_piece_bytes: int = 256 << 10
    dma_lanes: int = 1
    """Streams one ``dma`` transfer is spread over (1: back-to-back transfers already overlap)."""
    stage_lanes: int = 2
    """Streams the staging chunks' DMAs alternate over, so consecutive chunks overlap."""
    prefer_copy_engine: bool = True
    """Ask ``cudaMemcpyBatchAsync`` for the copy engines (never SMs) for DMA copies."""
    stage_bytes: int = 128 * MIB
    """Size of one staging buffer (``staged``): ``stage_buffers`` per direction are allocated on
    the device (512 MiB by default). Smaller buffers cost more chunks, so more issue time."""
    stage_buffers: int = 2
    stage_ramp_bytes: int = 8 * MIB
    """``staged``: the first chunks of a STORE grow from about this size to ``stage_bytes``, and
    the last chunks of a LOAD shrink to it, so the kernel step that cannot overlap a DMA (the
    first gather, the last scatter) is short. ``stage_bytes`` or more: equal chunks."""
    staged_min_blocks: int = 8
    """``staged``: jobs of fewer engine blocks go straight to the pool through the kernel."""
    stage_shared_streams: bool = True
    """``staged``: transfers of one direction run on that direction's staging streams (see
    ``resources.StagingRing``); False: each on streams of its own from the pool (slower
    back to back; kept to measure that)."""
    issue_thread: bool = True
    """Make the CUDA calls that enqueue transfers on the backend's native executor thread: the
    caller's thread only plans and records them (0.1-0.5 ms for 512 scattered blocks). False, or
    where the executor cannot be built: the caller's thread makes them too."""
    max_in_flight: int = 32
    """Transfers enqueued on the device and unfinished at most; more wait on the host (in a
    queue fed to the device as room is made). Enqueueing is a few CUDA calls that can take
    100-200 us while the device is busy; the fewer enqueued ahead, the fewer such waits."""
    max_device_ops: int = 2048
    """Copies and kernel launches enqueued and unfinished at most (estimated per transfer). The
    driver blocks the host once about 1,000 operations wait in one of its hardware queues (4 for
    copies, 8 for kernels, measured on an H100); this stays well below."""
    max_streams: int = 64
    """CUDA streams in the pool, all created at registration."""
    prefill_events: int = 256
    """CUDA events created at registration (more are created when needed)."""
    stream_priority: int = 0
    register_chunk_bytes: int = GIB
    """Pin the pool in pieces of about this size (whole slots each)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGY_NAMES:
            raise ConfigError("copy.strategy", self.strategy, f"one of {', '.join(STRATEGY_NAMES)}")
        if self.max_sms < 0:
            raise ConfigError("copy.max_sms", self.max_sms, "0 (backend's choice) or more")
        for name in (
            "dma_lanes",
            "stage_lanes",
            "max_device_ops",
            "stage_buffers",
            "max_in_flight",
            "max_streams",
            "staged_min_blocks",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"copy.{name}", getattr(self, name), "at least 1")
        if self.prefill_events < 0:
            raise ConfigError("copy.prefill_events", self.prefill_events, "0 or more")
        for name in ("stage_bytes", "stage_ramp_bytes", "register_chunk_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(f"copy.{name}", getattr(self, name), "a positive byte count")

    @classmethod
    def from_copy(cls, copy: CopyConfig, allow_pageable: bool, **overrides: Any) -> CudaCopyOptions:
        """Options from the config's ``copy`` section and ``pool.allow_pageable``."""
        values: dict[str, Any] = {
            "strategy": copy.strategy.value,
            "max_sms": copy.max_sms,
            "allow_pageable": allow_pageable,
        }
        values.update(overrides)
        return cls(**values)
