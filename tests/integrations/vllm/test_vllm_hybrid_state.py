"""Mamba groups through the vLLM adapter, against vLLM's own spec classes (the CPU build runs no
Mamba model: Jamba lacks ``selective_scan_fwd``, Mamba-2 stops at an ``IndexError``): which
groups are served, a Mamba layer's state views as whole pages for the copy backends, and the
local prefix hit every group agrees on where vLLM 0.25.1 takes the longest group's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import require

torch = require.importorskip("torch", "vllm")
pytestmark = require.unless("vllm", require.vllm_missing())

from kvtier.copy.base import CopyJob, Direction  # noqa: E402
from kvtier.copy.cpu import CpuCopyBackend  # noqa: E402
from kvtier.engine.groups import GroupKind  # noqa: E402
from kvtier.pool import HostPool  # noqa: E402

# Nemotron-H-8B's Mamba-2 state: conv (3, 8192 + 2 * 8 * 128) bfloat16, SSM (128, 64, 128)
# float32, padded to the 1,152-token attention page (8 KV heads of 128, bfloat16).
BLOCK = 1152
PAGE = BLOCK * 2 * 8 * 128 * 2
SHAPES = ((3, 10240), (128, 64, 128))
DTYPES = (torch.bfloat16, torch.float32)


def _config(*specs: Any) -> Any:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"layer.{i}"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def _mamba(mode: str = "all", **extra: Any) -> Any:
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(
        block_size=BLOCK,
        shapes=SHAPES,
        dtypes=DTYPES,
        page_size_padded=PAGE,
        mamba_cache_mode=mode,
        **extra,
    )


def _attention() -> Any:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)


def test_mamba_groups_are_served_in_mamba_cache_mode_all_only() -> None:
    from kvtier.integrations.vllm.groups import describe, uniform

    groups = describe(_config(_mamba(), _attention(), _mamba("align"), _mamba("none")))
    assert [g.kind for g in groups] == [
        GroupKind.STATE,
        GroupKind.FULL,
        GroupKind.OTHER,
        GroupKind.OTHER,
    ]
    assert uniform(groups[:2]) is None  # one block size, one (padded) page size
    assert groups[0].page_bytes == groups[1].page_bytes == PAGE
    assert groups[0].tag.startswith("state:0:") and groups[0].tag != groups[2].tag
    # Speculative blocks shift where a state lives.
    (speculative,) = describe(_config(_mamba(num_speculative_blocks=1)))
    assert speculative.kind is GroupKind.OTHER


def _vllm_0_25_state_views(raw: torch.Tensor, num_blocks: int) -> list[torch.Tensor]:
    """A Mamba layer's KV cache as vLLM 0.25.1's model runner makes it
    (``_reshape_kv_cache_tensors``): one view per state over the layer's int8 buffer, each
    ``[num_blocks, *shape]`` with a block stride of one page, the states one after another."""
    views, offset = [], 0
    for shape, dtype in zip(SHAPES, DTYPES, strict=True):
        size = torch.empty((), dtype=dtype).element_size()
        inner = torch.empty((num_blocks, *shape)).stride()[1:]
        views.append(
            torch.as_strided(
                raw.view(dtype), (num_blocks, *shape), (PAGE // size, *inner), offset // size
            )
        )
        offset += inner[0] * shape[0] * size
    return views


def test_a_mamba_layers_state_views_are_copied_as_whole_pages(tmp_path: Path) -> None:
    from kvtier.integrations.vllm.groups import describe, group_tensors, state_pages

    blocks = 4
    raw = torch.randint(-128, 127, (blocks * PAGE,), dtype=torch.int8)
    conv, ssm = _vllm_0_25_state_views(raw, blocks)
    pages = state_pages([conv, ssm], PAGE)
    assert tuple(pages.shape) == (blocks, 1, 1, PAGE) and pages.data_ptr() == raw.data_ptr()
    assert torch.equal(pages[2].flatten(), raw[2 * PAGE : 3 * PAGE].view(torch.uint8))
    # The same memory: a page written is the states written.
    (state, _full) = describe(_config(_mamba(), _attention()))
    (kv,) = group_tensors([state], {"layer.0": [conv, ssm]})[0]
    pool = HostPool.create(2, PAGE, shm_dir=str(tmp_path))
    try:
        backend = CpuCopyBackend([kv], pool)
        backend.submit(CopyJob(1, Direction.STORE, [3], [0]))
        backend.submit(CopyJob(2, Direction.LOAD, [1], [0]))
        assert backend.poll().done == [1, 2]
        bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}  # random bits: NaNs
        for state_view in (conv, ssm):
            same = [state_view[b].view(bits[state_view.dtype]) for b in (0, 1, 3)]
            assert torch.equal(same[1], same[2]) and not torch.equal(same[0], same[2])
        backend.close()
    finally:
        pool.close()
    # vLLM 0.32 hands over the pages already: whole pages pass unchanged; a view of the state
    # bytes alone (a block stride of one padded page) is widened to the page, contiguous.
    view = torch.zeros((blocks, 1, 1, PAGE), dtype=torch.int8)
    assert group_tensors([state], {"layer.0": view})[0][0] is view
    content = view.as_strided((blocks, 1, 1, PAGE - 100), (PAGE, PAGE, PAGE, 1))
    (widened,) = group_tensors([state], {"layer.0": content})[0]
    assert widened.is_contiguous() and widened.shape[3] == PAGE
    assert widened.data_ptr() == view.data_ptr()


def test_state_views_that_are_not_pages_of_one_buffer_are_refused() -> None:
    from kvtier.integrations.vllm.groups import state_pages

    raw = torch.zeros(4 * PAGE, dtype=torch.int8)
    conv, ssm = _vllm_0_25_state_views(raw, 4)
    with pytest.raises(ValueError, match="not pages"):
        state_pages([conv, ssm], PAGE // 2)
    with pytest.raises(ValueError, match="not pages"):
        state_pages([conv, ssm.clone()], PAGE)


class _Blocks:
    """What ``find_longest_cache_hit`` answers: per group its hit blocks, and the hit length."""

    def find_longest_cache_hit(self, block_hashes: Any, max_length: int) -> Any:
        return (["a0", "a1"], ["null", "m1"]), 2 * BLOCK


def test_vllm_0_32_reconciles_diverged_hybrid_hits_itself() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

    from kvtier.integrations.vllm import hybrid_hits

    assert not hybrid_hits.needed(KVConnectorBase_V1, HybridKVCacheCoordinator)
    assert not hybrid_hits.install(KVConnectorBase_V1, HybridKVCacheCoordinator)


def test_a_release_taking_the_longest_groups_hit_gets_the_one_every_group_has() -> None:
    from vllm.v1.core.kv_cache_coordinator import HybridKVCacheCoordinator

    from kvtier.integrations.vllm import hybrid_hits

    class OldBase:  # vLLM 0.25.1's connector base: no supports_divergent_local_hybrid_hits
        pass

    class Coordinator(HybridKVCacheCoordinator):  # a copy, so vLLM's own class stays as it is
        pass

    original = HybridKVCacheCoordinator.find_longest_cache_hit_per_group
    assert hybrid_hits.install(OldBase, Coordinator)
    assert hybrid_hits.install(OldBase, Coordinator)  # once is enough, twice is harmless
    assert HybridKVCacheCoordinator.find_longest_cache_hit_per_group is original
    blocks, hits = Coordinator.find_longest_cache_hit_per_group(_Blocks(), [], 4 * BLOCK)  # type: ignore[arg-type]
    assert blocks == (["a0", "a1"], ["null", "m1"]) and hits == (2 * BLOCK, 2 * BLOCK)


def test_only_a_model_with_mamba_layers_needs_it() -> None:
    from kvtier.integrations.vllm import hybrid_hits

    assert not hybrid_hits.install_for(_config(_attention()))
