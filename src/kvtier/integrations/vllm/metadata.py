"""kvtier's step orders and rank reports as vLLM's connector metadata classes.

The records are ``kvtier.engine.orders``'s; vLLM wants its own base classes (it pickles them
between processes and merges the workers' reports with ``aggregate``). Only the connector imports
this module: the worker half works on the plain records and imports without vLLM.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvtier.engine.orders import CopyOrder, RankReport, StepOrders

__all__ = ["CopyOrder", "KVTierMetadata", "KVTierWorkerMetadata"]


class KVTierMetadata(StepOrders, KVConnectorMetadata):
    """One step's orders (``StepOrders``), as vLLM hands them to every worker."""

    __slots__ = ()


class KVTierWorkerMetadata(RankReport, KVConnectorWorkerMetadata):
    """A worker's (or several workers' merged) ``RankReport``, as vLLM collects them."""

    __slots__ = ()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KVTierWorkerMetadata)
        merged = self.merged(other)
        assert isinstance(merged, KVTierWorkerMetadata)
        return merged
