"""The local prefix hit of a hybrid Mamba model under a KV connector, made the one every group has.

vLLM 0.25.1's scheduler, for a model with Mamba layers and any KV connector, asks its
``HybridKVCacheCoordinator.find_longest_cache_hit_per_group`` for each group's own hit and takes
the longest (``max(per_group_hits)``) as the request's locally computed tokens, with each group's
own hit blocks. A connector is then expected to restore what a shorter group lacks (NIXL sends
the Mamba state unconditionally). Where the groups' hits differ and the connector loads nothing
beyond, a group's blocks at the resume boundary are fresh blocks: a Mamba state the kernels read
as the initial state, or attention KV the next tokens attend to, that nobody wrote (vLLM issues
46453 and 43090). Both orders happen under GPU memory pressure: a Mamba state block is freed as
soon as the next one is written, and a finished request's full-attention blocks are freed tail
first.

vLLM 0.32 asks only connectors that declare ``supports_divergent_local_hybrid_hits`` for the
per-group hits and otherwise takes the hit every group agrees on (``get_computed_blocks``), as
vLLM without a connector does. kvtier does not declare it. On a release whose connector base
class lacks that property, ``install`` replaces ``find_longest_cache_hit_per_group`` (called from
that scheduler path only) with the agreed hit: every group's blocks and length as
``find_longest_cache_hit`` finds them. It is a class attribute, so it applies to every engine of
the process (each a hybrid Mamba model under a connector), which then resume where vLLM without
a connector would.
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

_MARK = "_kvtier_agreed_hit"
_PER_GROUP = "find_longest_cache_hit_per_group"


def _agreed_hit_per_group(
    self: Any, block_hashes: Any, max_cache_hit_length: int
) -> tuple[tuple[list[Any], ...], tuple[int, ...]]:
    """``find_longest_cache_hit_per_group`` answering the hit every group has."""
    blocks, hit = self.find_longest_cache_hit(block_hashes, max_cache_hit_length)
    return blocks, tuple(hit for _ in blocks)


setattr(_agreed_hit_per_group, _MARK, True)


def needed(connector_base: type, coordinator: type) -> bool:
    """Whether this release takes the longest per-group hit for every connector."""
    if hasattr(connector_base, "supports_divergent_local_hybrid_hits"):
        return False
    return callable(getattr(coordinator, _PER_GROUP, None))


def install(connector_base: type, coordinator: type) -> bool:
    """Make ``coordinator``'s per-group hit the agreed one where this release needs it (see the
    module docstring); True when it is (now or already)."""
    if not needed(connector_base, coordinator):
        return False
    if not getattr(getattr(coordinator, _PER_GROUP), _MARK, False):
        setattr(coordinator, _PER_GROUP, _agreed_hit_per_group)
        log.warning(
            "vLLM without supports_divergent_local_hybrid_hits: a hybrid Mamba model's local "
            "prefix hit with a KV connector is the one every KV cache group has (vLLM issue "
            "46453), in every engine of this process"
        )
    return True


def install_for(kv_cache_config: Any) -> bool:
    """``install`` for vLLM's own classes when the model has Mamba layers."""
    if not getattr(kv_cache_config, "has_mamba_layers", False):
        return False
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

    return install(KVConnectorBase_V1, HybridKVCacheCoordinator)
