"""What an engine adapter tells its ``Planner`` (``kvtier.engine.planner``): options from the
config and what the engine is like."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.engine.load_mode import LoadMode


@dataclass(frozen=True, slots=True)
class PlannerSettings:
    blocks_per_slot: int = 1
    """Engine blocks per kvtier block."""
    store_generated: bool = False
    """Also store blocks filled by generated tokens (not only prompt tokens)."""
    load_mode: LoadMode = LoadMode.SYNC
    """Which loads are asynchronous (``LoadMode``)."""
    stats_path: str | None = None
    """Write the stats as JSON to this file (each second and at ``close``)."""
    steps_in_flight: int = 1
    """Steps the engine runs at once (vLLM's batch queue: 2 under asynchronous scheduling). The
    time between two ``plan_step`` calls is then the oldest queued step's, and the compute rate
    is measured from that step's tokens (docs/vllm.md, *The compute rate under vLLM's batch
    queue*)."""

    @property
    def async_loads(self) -> bool:
        """Every load asynchronous (``LoadMode.ASYNC``)."""
        return self.load_mode is LoadMode.ASYNC
