"""The engine-neutral worker side (``Copier``) and the vLLM worker half built on it, with a real
CPU copy backend and host pool: both import and work where vLLM cannot be imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

import pytest
from support import require

torch = require.importorskip("torch", "vllm")

from kvtier.copy.base import BackendSetup, CopyBackend, CopyJob, CopyResults  # noqa: E402
from kvtier.engine.backends import make_backend  # noqa: E402
from kvtier.engine.copier import Copier  # noqa: E402
from kvtier.engine.orders import SKIP, CopyOrder, StepOrders  # noqa: E402
from kvtier.pool import HostPool  # noqa: E402

LAYERS, BLOCKS, PAGE = 3, 8, 64


def _kv(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, 255, (BLOCKS, PAGE), dtype=torch.uint8, generator=gen)
        for _ in range(LAYERS)
    ]


def test_a_store_then_a_load_moves_the_bytes_and_reports_each_job_once() -> None:
    kv = _kv(1)
    original = [t.clone() for t in kv]
    with HostPool.create(4, 2 * LAYERS * PAGE) as pool:
        copier = Copier(blocks_per_slot=2, tp_rank=0, tp_size=1)
        copier.register(kv)
        copier.save(StepOrders(pool.handle, stores=[CopyOrder(0, [1], [2, 3])]))
        for t in kv:
            t.zero_()
        copier.start_load(StepOrders(pool.handle, loads=[CopyOrder(1, [1], [SKIP, 6])]))
        report = copier.take_report()
        assert report is not None and report.done == {0: 1, 1: 1} and report.failed == {}
        assert copier.take_report() is None
        for t, before in zip(kv, original, strict=True):
            assert torch.equal(t[6], before[3])  # the slot's second block, loaded
            assert not t[5].any()  # SKIP: the slot's first block was not copied
        # A stale plan fails without copying; vLLM gets its blocks as load errors.
        copier.start_load(StepOrders(pool.handle, loads=[CopyOrder(2, [1], [4, 5], fail=True)]))
        assert copier.take_report() is not None and copier.take_load_errors() == {4, 5}
        assert not kv[0][4].any()
        copier.close()


def test_no_backend_for_the_device_fails_every_order() -> None:
    # A meta tensor: no copy backend for it. Loads fail (recomputed), stores are dropped.
    with HostPool.create(2, 64) as pool:
        copier = Copier(1, 0, 1)
        copier.register([torch.empty(4, 64, device="meta")])
        orders = StepOrders(pool.handle, [CopyOrder(0, [0], [1])], [CopyOrder(1, [1], [2])])
        copier.start_load(orders)
        copier.save(orders)
        report = copier.take_report()
        assert report is not None and report.failed == {0: 1, 1: 1}
        assert copier.take_load_errors() == {1}
        with pytest.raises(NotImplementedError, match="'meta'"):
            make_backend([torch.empty(4, 64, device="meta")], BackendSetup(pool))
        copier.close()


def test_the_vllm_worker_half_imports_and_copies_without_vllm() -> None:
    # vLLM made unimportable: the worker half and the engine layer must not need it.
    code = textwrap.dedent(
        """
        import sys
        sys.modules["vllm"] = None  # any import of vllm raises ImportError
        import torch
        from kvtier.engine.orders import CopyOrder, StepOrders
        from kvtier.integrations.vllm.worker import WorkerSide
        from kvtier.pool import HostPool

        kv = [torch.arange(4 * 32, dtype=torch.uint8).reshape(4, 32)]
        with HostPool.create(2, 32) as pool:
            worker = WorkerSide(1, 0, 1)
            worker.register(kv)
            worker.save(StepOrders(pool.handle, stores=[CopyOrder(7, [0], [2])]))
            kv[0][3].zero_()
            worker.start_load(StepOrders(pool.handle, loads=[CopyOrder(8, [0], [3])]))
            report = worker.take_report()
            assert torch.equal(kv[0][3], kv[0][2]), kv
            worker.close()
        print(sorted(report.done.items()), "vllm" in sys.modules and sys.modules["vllm"])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[(7, 1), (8, 1)] None"


class HeldLoads(CopyBackend):
    """A copy backend whose loads end only when the test says so (``end``): an asynchronous
    copy still running on the device."""

    @classmethod
    def create(cls, kv_caches: Sequence[Any], setup: BackendSetup) -> HeldLoads:
        return cls()

    def __init__(self) -> None:
        self.submitted: list[CopyJob] = []
        self.waited: list[int] = []
        self._ended: list[tuple[int, bool]] = []

    def submit(self, job: CopyJob) -> None:
        self.submitted.append(job)

    def end(self, job_id: int, ok: bool = True) -> None:
        self._ended.append((job_id, ok))

    def poll(self) -> CopyResults:
        ended, self._ended = self._ended, []
        return CopyResults([j for j, ok in ended if ok], [j for j, ok in ended if not ok])

    def wait(self, job_ids: Sequence[int]) -> None:
        self.waited.extend(job_ids)
        for job_id in job_ids:
            self.end(job_id)

    def fence(self, job_ids: Sequence[int]) -> None:
        return

    def close(self) -> None:
        return

    @property
    def slot_part_bytes(self) -> int:
        return 64


def test_an_asynchronous_load_is_not_waited_for_and_names_its_request_when_it_ends() -> None:
    backend = HeldLoads()
    with HostPool.create(4, 64) as pool:
        copier = Copier(1, 0, 1, backend_factory=lambda *args: backend)
        copier.register(_kv(1))
        loads = [CopyOrder(0, [1], [2], request_id="a"), CopyOrder(1, [2], [3], request_id="b")]
        copier.start_load(StepOrders(pool.handle, loads=loads))
        assert backend.waited == [] and [j.job_id for j in backend.submitted] == [0, 1]
        assert copier.take_finished_loads() == set()
        assert copier.take_report() is None
        backend.end(0)
        backend.end(1, ok=False)
        assert copier.take_finished_loads() == {"a", "b"}
        assert copier.take_load_errors() == {3}  # b's block: recomputed by the engine
        report = copier.take_report()
        assert report is not None and report.done == {0: 1} and report.failed == {1: 1}
        # A stale asynchronous plan ends at once: failed, its request named.
        stale = CopyOrder(2, [1], [5], fail=True, request_id="c")
        copier.start_load(StepOrders(pool.handle, loads=[stale]))
        assert copier.take_finished_loads() == {"c"} and copier.take_load_errors() == {5}
        copier.close()


def test_closing_waits_for_asynchronous_loads_that_write_engine_memory() -> None:
    backend = HeldLoads()
    with HostPool.create(4, 64) as pool:
        copier = Copier(1, 0, 1, backend_factory=lambda *args: backend)
        copier.register(_kv(1))
        copier.start_load(StepOrders(pool.handle, loads=[CopyOrder(7, [1], [2], request_id="a")]))
        copier.suspend()
        assert backend.waited == [7]
        assert copier.take_finished_loads() == {"a"}
        copier.close()
