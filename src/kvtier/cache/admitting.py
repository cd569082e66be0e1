"""Which new keys of a store get a pool slot: the admission filter's, then the policy's say."""

from __future__ import annotations

from kvtier.keys import BlockKey
from kvtier.metrics import CacheCounters
from kvtier.policies.admission import AdmissionFilter
from kvtier.policies.base import EvictionPolicy


def admit_new(
    todo: list[BlockKey],
    admission: AdmissionFilter | None,
    policy: EvictionPolicy,
    free: int,
    counters: CacheCounters,
    tiered: bool = False,
) -> list[BlockKey]:
    """The leading keys of ``todo`` (neither present nor in flight) to reserve slots for, with
    ``free`` free slots in the pool: those the filter admits (at their ``min_seen``-th offer),
    then, where they need more than the free slots and no secondary tier sits below the pool
    (``tiered``), as many as the policy's ``admit_store`` allows. Both refusals are counted in
    ``store_skipped_admission``.

    With a tier below, the policy is not asked: a block the pool evicts goes on to the tier
    (``on_evict``) or is there already (``through``), while a refused block is lost to every
    tier. In the vLLM demo test (12 requests, 3 in flight, fs tier) ``hinted`` under pressure
    refused 332 of 647 stores in half of the runs, and the fs tier then served 3 blocks instead
    of 273 (2-core VM, vLLM CPU 0.32)."""
    admitted = todo
    if admission is not None:
        admitted = [key for key in admitted if admission.admit(key)]
    if len(admitted) > free and not tiered:
        # The policy may refuse what would evict blocks it keeps (``hinted`` under pressure): in
        # an engine the requests in flight store about as much as the pool holds before any of
        # them is hinted, and stores that evict whatever comes next left nothing kept (issue 24).
        n = policy.admit_store(len(admitted), free)
        admitted = admitted[: max(0, n)]
    counters.store_skipped_admission += len(todo) - len(admitted)
    return admitted
