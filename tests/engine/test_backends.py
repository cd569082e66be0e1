"""``make_backend`` chooses a copy backend through ``COPY_BACKENDS`` by the KV tensors' device type
and builds it with the arguments its constructor names."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from plugin_examples.meta_backend import MetaCopyBackend
from support import require
from support.emulated_cuda import EmulatedBackend, FakeRuntime, FakeTensor
from support.kv_reference import engine_arrays, logical_blocks

torch = require.importorskip("torch", "vllm")

from kvtier.copy.base import BackendSetup  # noqa: E402
from kvtier.copy.cpu import CpuCopyBackend  # noqa: E402
from kvtier.copy.cuda.plan import KVLayout  # noqa: E402
from kvtier.copy.options import CopyConfig, CopyStrategy  # noqa: E402
from kvtier.engine.backends import make_backend  # noqa: E402
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.pool import HostPool  # noqa: E402
from kvtier.registry import COPY_BACKENDS  # noqa: E402

META = "plugin_examples.meta_backend:MetaCopyBackend"


def test_the_cpu_backend_is_the_registered_one_for_cpu_tensors() -> None:
    assert COPY_BACKENDS.entries["cpu"] == "kvtier.copy.cpu:CpuCopyBackend"
    with HostPool.create(2, 2 * 3 * 64) as pool:
        kv = [torch.zeros(4, 64, dtype=torch.uint8) for _ in range(3)]
        backend = make_backend(kv, BackendSetup(pool, 1, 1, 2, CopyConfig(CopyStrategy.DMA)))
        try:
            assert isinstance(backend, CpuCopyBackend)
            assert backend.slot_part_bytes == 3 * 64
        finally:
            backend.close()


class Emulated(EmulatedBackend):
    """The CUDA backend over an emulated runtime, with the real backend's constructor."""

    def __init__(self, kv_caches: Any, layout: Any, pool: Any, options: Any, **kwargs: Any) -> None:
        super().__init__(kv_caches, layout, pool, options, fake=FakeRuntime(), **kwargs)


def test_cuda_tensors_get_the_cuda_backend_with_their_layout_and_the_copy_options(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    assert COPY_BACKENDS.entries["cuda"] == "kvtier.copy.cuda.backend:CudaCopyBackend"
    monkeypatch.setitem(COPY_BACKENDS.entries, "cuda", f"{__name__}:Emulated")
    logical = logical_blocks(np.random.default_rng(0), 4)
    kv = [FakeTensor(a) for a in engine_arrays(logical, KVLayout.LAYER_KV_FIRST)]
    copy = CopyConfig(CopyStrategy.DMA, max_sms=4)
    with HostPool.create(4, 2 * logical[0].nbytes, shm_dir=str(tmp_path)) as pool:
        backend = make_backend(kv, BackendSetup(pool, 1, 1, 2, copy, allow_pageable=True))
        try:
            assert isinstance(backend, Emulated)
            assert backend.geometry.layout is KVLayout.LAYER_KV_FIRST
            options = backend.options
            assert (options.strategy, options.max_sms, options.allow_pageable) == ("dma", 4, True)
            assert backend.slot_part_bytes == logical[0].nbytes
        finally:
            backend.close()


def test_a_device_without_a_backend_is_an_error_listing_the_known_ones() -> None:
    with HostPool.create(2, 64) as pool:
        with pytest.raises(NotImplementedError, match=r"'meta' KV \(only 'cpu', 'cuda'\)"):
            make_backend([torch.empty(4, 64, device="meta")], BackendSetup(pool))
        with pytest.raises(ValueError, match="no KV tensors"):
            make_backend([], BackendSetup(pool))


def test_a_backend_registered_for_another_device_is_built_with_what_it_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(COPY_BACKENDS.entries, "meta", META)
    with HostPool.create(2, 64) as pool:
        setup = BackendSetup(pool, 2, 1, 4, CopyConfig(max_sms=3))
        backend = make_backend([torch.empty(4, 64, device="meta")] * 2, setup)
        assert isinstance(backend, MetaCopyBackend)
        assert backend.built_with == (2, setup)  # through its create, as every backend


def test_a_registered_backend_that_does_not_import_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(COPY_BACKENDS.entries, "meta", "plugin_examples.no_such_module:Backend")
    with (
        HostPool.create(2, 64) as pool,
        pytest.raises(ConfigError, match="its dependency is not installed"),
    ):
        make_backend([torch.empty(4, 64, device="meta")], BackendSetup(pool))
