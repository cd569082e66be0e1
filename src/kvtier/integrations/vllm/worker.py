"""The connector's worker half: kvtier's ``Copier`` on this rank's vLLM KV tensors.

Everything a worker does lives in ``kvtier.engine.copier`` (and the backend choice in
``kvtier.engine.backends``); the connector maps vLLM's hooks onto it: ``register_kv_caches``
(or 0.25.1's cross-layer tensor) -> ``register``, ``handle_preemptions`` -> ``fence``,
``start_load_kv`` -> ``start_load``, ``wait_for_save`` -> ``save``, ``build_connector_worker_meta``
-> ``take_meta``, ``get_block_ids_with_load_errors`` -> ``take_load_errors``, and 0.33's
``unregister_kv_caches`` / ``restore_kv_caches`` -> ``suspend`` / ``resume``. This module imports
without vLLM: the orders arrive as ``kvtier.engine.orders.StepOrders`` (vLLM's metadata class
derives from it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvtier.copy.base import CopyBackend
from kvtier.engine.backends import cuda_layout, make_backend
from kvtier.engine.copier import FAULT_ENV, Copier

if TYPE_CHECKING:
    from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata

__all__ = ["FAULT_ENV", "WorkerSide", "cuda_layout", "make_backend"]


class WorkerSide(Copier):
    """One vLLM worker's copier; its backend comes from this module's ``make_backend`` (the
    engine-neutral ``kvtier.engine.backends.make_backend``, re-exported: vLLM's tensors need no
    translation)."""

    def __init__(
        self, blocks_per_slot: int, tp_rank: int, tp_size: int, copy_options: Any = None
    ) -> None:
        super().__init__(
            blocks_per_slot, tp_rank, tp_size, copy_options, backend_factory=self._make_backend
        )
        self._groups: dict[int, list[Any]] = {}

    def register_groups(self, tensors: Mapping[int, Sequence[Any]]) -> None:
        """A hybrid model's KV tensors per KV cache group (vLLM's group index -> the group's
        layers' tensors, in layer order): each group gets its own backend
        (``copy.grouped.GroupedCopyBackend``)."""
        self._groups = {group: list(kv) for group, kv in tensors.items()}
        self.register([t for kv in self._groups.values() for t in kv])

    def _make_backend(self, kv_caches: Sequence[Any], *rest: Any) -> CopyBackend:
        # make_backend is looked up when the backend is built, so a replaced one (tests inject a
        # recording backend) is the one used.
        if not self._groups:
            return make_backend(kv_caches, *rest)
        from kvtier.copy.grouped import GroupedCopyBackend

        parts = {group: make_backend(kv, *rest) for group, kv in self._groups.items()}
        return GroupedCopyBackend(parts, self.blocks_per_slot)

    def take_meta(self) -> KVTierWorkerMetadata | None:
        """``take_report`` as vLLM's worker metadata class (imported here, where vLLM runs, so
        that this module imports without it)."""
        report = self.take_report()
        if report is None:
            return None
        from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata

        return KVTierWorkerMetadata(report.done, report.failed)
