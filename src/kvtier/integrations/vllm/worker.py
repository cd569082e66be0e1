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
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from kvtier.copy.base import BackendSetup, CopyBackend
from kvtier.engine.backends import make_backend
from kvtier.engine.copier import FAULT_ENV, Copier

if TYPE_CHECKING:
    from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata

__all__ = ["FAULT_ENV", "WorkerSide", "make_backend"]


class WorkerSide(Copier):
    """One vLLM worker's copier; its backend comes from this module's ``make_backend`` (the
    engine-neutral ``kvtier.engine.backends.make_backend``, re-exported: vLLM's tensors need no
    translation)."""

    _groups: Mapping[int, Sequence[Any]] = MappingProxyType({})
    """A hybrid model's tensors per KV cache group (``register_groups``); none: one backend."""

    def register_groups(self, tensors: Mapping[int, Sequence[Any]]) -> None:
        """A hybrid model's KV tensors per KV cache group (vLLM's group index -> the group's
        layers' tensors, in layer order): each group gets its own backend
        (``copy.grouped.GroupedCopyBackend``)."""
        self._groups = {group: list(kv) for group, kv in tensors.items()}
        self.register([t for kv in self._groups.values() for t in kv])

    def _new_backend(self, kv_caches: Sequence[Any], setup: BackendSetup) -> CopyBackend:
        # make_backend is looked up when the backend is built, so a replaced one (tests inject a
        # recording backend) is the one used.
        if not self._groups:
            return make_backend(kv_caches, setup)
        from kvtier.copy.grouped import GroupedCopyBackend

        parts = {group: make_backend(kv, setup) for group, kv in self._groups.items()}
        return GroupedCopyBackend(parts, self.blocks_per_slot)

    def take_meta(self) -> KVTierWorkerMetadata | None:
        """``take_report`` as vLLM's worker metadata class (imported here, where vLLM runs, so
        that this module imports without it)."""
        report = self.take_report()
        if report is None:
            return None
        from kvtier.integrations.vllm.metadata import KVTierWorkerMetadata

        return KVTierWorkerMetadata(report.done, report.failed)
