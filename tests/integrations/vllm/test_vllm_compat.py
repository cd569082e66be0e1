"""The vLLM release differences (``integrations/vllm/compat.py``): version range, layout requests,
0.25.1's cross-layer KV tensor, the namespace's page order."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import pytest
from support import require

from kvtier.errors import ConfigError
from kvtier.integrations.vllm import compat


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("0.25.1", (0, 25, 1)),
        ("0.32.0", (0, 32, 0)),
        ("0.33.0+cu130", (0, 33, 0)),
        ("0.33.1.dev4+g1a2b3c", (0, 33, 1)),
        ("0.34.0rc1", (0, 34, 0)),
    ],
)
def test_versions_parse(text: str, version: tuple[int, ...]) -> None:
    assert compat.parse_version(text) == version


def test_a_release_outside_the_tested_range_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    for ok in ((0, 25, 1), (0, 32, 0), (0, 33, 0), (0, 33, 9)):
        compat.check_version(ok)
    for bad in ((0, 25, 0), (0, 24, 3), (0, 34, 0), (1, 0)):
        with pytest.raises(ConfigError, match=r">= 0\.25\.1 and < 0\.34"):
            compat.check_version(bad)
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    compat.check_version((0, 34, 0))


def test_the_connector_refuses_to_start_on_an_untested_release(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    vllm = require.importorskip("vllm", "vllm")
    from kvtier.integrations.vllm import KVTierConnector

    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.24.0")
    config = SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config={}))
    with pytest.raises(ConfigError, match=r"vllm version='0\.24\.0'"):
        KVTierConnector(config, None, None)


def test_layout_requests_per_release() -> None:
    v025, v032 = (0, 25, 1), (0, 32, 0)
    assert compat.layout_request("engine", v025) == compat.LayoutRequest(None, False)
    assert compat.layout_request("engine", v032) == compat.LayoutRequest(None, False)
    # 0.32+: the name itself; 0.25: a page order, block-outermost as one cross-layer tensor.
    assert compat.layout_request("BLNHC", v032) == compat.LayoutRequest("BLNHC", False)
    assert compat.layout_request("BLNHC", v025) == compat.LayoutRequest("NHD", True)
    assert compat.layout_request("BLHNC", v025) == compat.LayoutRequest("HND", True)
    assert compat.layout_request("LBNHC", v025) == compat.LayoutRequest("NHD", False)
    assert compat.layout_request("LBHNC", v025) == compat.LayoutRequest("HND", False)
    with pytest.raises(ConfigError, match=r"vllm\.kv_cache_layout='LHBNC'"):
        compat.layout_request("LHBNC", v025)


def test_page_order_per_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    config = SimpleNamespace(cache_config=SimpleNamespace(kv_cache_layout="BLNHC"))
    assert compat.page_order(config, "BLNHC", (0, 32, 0)) == "NHC"
    config.cache_config.kv_cache_layout = "LBHNC"
    assert compat.page_order(config, None, (0, 33, 0)) == "HNC"
    # 0.25 names no resolved layout: its request, vLLM's NHD default, or the environment's.
    bare = SimpleNamespace(cache_config=SimpleNamespace())
    assert compat.page_order(bare, "HND", (0, 25, 1)) == "2HND"
    assert compat.page_order(bare, None, (0, 25, 1)) == "2NHD"
    monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", "HND")
    assert compat.page_order(bare, "NHD", (0, 25, 1)) == "2HND"


class _FlashAttention025:
    """vLLM 0.25.1's FlashAttention stride orders with NHD pages."""

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        return (1, 0, 2, 3, 4, 5) if include_num_layers_dimension else (0, 1, 2, 3, 4)


def test_cross_layer_views_are_the_layers_and_a_block_is_one_copy() -> None:
    """0.25.1 allocates ``[num_blocks, num_layers, 2, block_size, heads, head_size]`` and hands
    connectors that one tensor: each view is one layer's ``[num_blocks, 2, ...]`` (what its
    attention layer reads), and the CUDA planner moves a block of all layers as one piece."""
    torch = require.importorskip("torch", "vllm")
    from kvtier.copy.cuda.plan import cuda_layout, describe_kv, merge_regions

    layers, blocks, shape = 3, 5, (2, 16, 2, 8)
    page = 2 * 16 * 2 * 8 * 2  # bf16
    physical = torch.zeros((blocks, layers, *shape), dtype=torch.bfloat16)
    views = compat.cross_layer_views(physical, _FlashAttention025)
    assert len(views) == layers
    for layer, view in enumerate(views):
        assert tuple(view.shape) == (blocks, *shape)
        for block in range(blocks):
            view[block].view(torch.int16).fill_(layer * blocks + block + 1)
    for block in range(blocks):
        for layer in range(layers):
            assert int(physical[block, layer].view(torch.int16).flatten()[0]) == (
                layer * blocks + block + 1
            )
    geo = describe_kv(views, cuda_layout(views))
    assert (geo.num_layers, geo.num_blocks, geo.piece_bytes) == (layers, blocks, page)
    region = geo.regions[1]
    start = region.base + 2 * region.stride
    assert ctypes.string_at(start, 2) == (1 * blocks + 2 + 1).to_bytes(2, "little")
    assert [r.nbytes for r in merge_regions(geo.regions)] == [layers * page]


def test_cross_layer_views_refuse_a_stride_order_of_another_rank() -> None:
    torch = require.importorskip("torch", "vllm")

    class Bad:
        @staticmethod
        def get_kv_cache_stride_order(
            include_num_layers_dimension: bool = False,
        ) -> tuple[int, ...]:
            del include_num_layers_dimension
            return (1, 0, 2, 3, 4)

    with pytest.raises(ValueError, match="stride order"):
        compat.cross_layer_views(torch.zeros(2, 3, 2, 4, 1, 8), Bad)


def test_sleep_mode_is_refused_where_vllm_does_not_tell_connectors() -> None:
    sleepy = SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=True))
    awake = SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=False))
    with pytest.raises(ConfigError, match=r"enable_sleep_mode=True.*from vLLM 0\.33 on"):
        compat.check_sleep_mode(sleepy, (0, 32, 0))
    compat.check_sleep_mode(awake, (0, 25, 1))
    compat.check_sleep_mode(sleepy, (0, 33, 0))


def test_a_recovery_warning_where_vllm_recomputes_failed_loads_wrongly() -> None:
    def config(policy: str) -> SimpleNamespace:
        return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_load_failure_policy=policy))

    warning = compat.warn_recovery(config("recompute"), (0, 25, 1))
    assert warning is not None and "49250" in warning
    assert compat.warn_recovery(config("fail"), (0, 25, 1)) is None
    assert compat.warn_recovery(config("recompute"), (0, 32, 0)) is None


def test_steps_in_flight_follow_vllms_batch_queue() -> None:
    require.importorskip("vllm", "vllm")
    from vllm.config import VllmConfig

    config = VllmConfig()
    config.scheduler_config.async_scheduling = False
    assert compat.steps_in_flight(config) == 1
    config.scheduler_config.async_scheduling = True  # CUDA builds' default: a queue of two
    assert compat.steps_in_flight(config) == 2
    assert compat.steps_in_flight(SimpleNamespace()) == 1  # a release without the property
