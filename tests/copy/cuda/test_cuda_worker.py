"""The vLLM connector's worker half on a real GPU with the CUDA backend (skipped without CUDA).

vLLM is not needed: where it is not installed, the two base classes the connector's metadata
derives from are stood in for. The test plays vLLM's part: per-layer KV tensors in
FlashAttention's layout, a store after a "forward pass", then the next step's ``fence`` and a
kernel that overwrites all KV at once (as a request that got the stored blocks after a free
would), and a load of the stored blocks into other engine blocks. Every element is checked.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator

import pytest
from support import require

torch = require.importorskip("torch", "gpu", "PyTorch is not installed")
if not torch.cuda.is_available():
    require.missing("gpu", "no CUDA device", module=True)

pytestmark = pytest.mark.gpu


def _stand_in_for_vllm() -> None:
    """Let ``kvtier.integrations.vllm.metadata`` import where vLLM is not installed."""
    try:
        import vllm  # noqa: F401
    except ImportError:
        pass
    else:
        return
    base_name = "vllm.distributed.kv_transfer.kv_connector.v1.base"
    parts = base_name.split(".")
    for i in range(1, len(parts) + 1):
        sys.modules.setdefault(".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
    base = sys.modules[base_name]
    base.KVConnectorMetadata = type("KVConnectorMetadata", (), {})  # type: ignore[attr-defined]
    base.KVConnectorWorkerMetadata = type(  # type: ignore[attr-defined]
        "KVConnectorWorkerMetadata", (), {}
    )


_stand_in_for_vllm()

from kvtier.copy.options import CopyConfig, CopyStrategy  # noqa: E402
from kvtier.integrations.vllm.metadata import CopyOrder, KVTierMetadata  # noqa: E402
from kvtier.integrations.vllm.worker import WorkerSide  # noqa: E402
from kvtier.pool import HostPool  # noqa: E402

LAYERS, TOKENS, HEADS, HEAD_DIM = 32, 16, 8, 128
NUM_BLOCKS = 640
BLOCK_BYTES = LAYERS * 2 * TOKENS * HEADS * HEAD_DIM * 2
STORED = 256  # 512 MiB: a store of several milliseconds, so an unfenced overwrite would win


@pytest.fixture
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostPool]:
    with HostPool.create(STORED, BLOCK_BYTES) as p:
        yield p


@pytest.mark.parametrize("strategy", ["auto", "kernel"])
def test_store_fence_overwrite_then_load(pool: HostPool, strategy: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(7)
    kv = [
        torch.randint(
            -(1 << 15),
            1 << 15,
            (2, NUM_BLOCKS, TOKENS, HEADS, HEAD_DIM),
            dtype=torch.int16,
            device="cuda",
            generator=gen,
        )
        for _ in range(LAYERS)
    ]
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    stored, targets = perm[:STORED], perm[STORED : 2 * STORED]
    index = torch.tensor(stored, device="cuda")
    originals = [t[:, index].clone() for t in kv]
    slots = list(range(STORED))[::-1]

    worker = WorkerSide(1, 0, 1, CopyConfig(CopyStrategy(strategy)))
    worker.register(kv)
    try:
        # Round 0 warms every kernel up: the first launch of a lazily loaded kernel synchronizes
        # the device, which would hide a missing fence. Round 1 is the one that could race.
        for round_ in range(2):
            jobs = (10 * round_ + 1, 10 * round_ + 2)
            for t, original in zip(kv, originals, strict=True):
                t[:, index] = original
            torch.cuda.synchronize()
            worker.save(KVTierMetadata(pool.handle, [], [CopyOrder(jobs[0], slots, stored)]))
            # Next step: vLLM calls handle_preemptions, then its kernels may overwrite the
            # stored blocks (here: all KV).
            fresh = KVTierMetadata(pool.handle, fresh_blocks=stored)  # freed and handed out
            worker.fence(fresh)
            for t in kv:
                t.fill_(-1)
            load = CopyOrder(jobs[1], slots, targets)
            worker.start_load(KVTierMetadata(pool.handle, [load], []))
            torch.cuda.synchronize()
            meta = worker.take_meta()
            assert meta is not None and meta.failed == {}
            assert meta.done == {jobs[0]: 1, jobs[1]: 1}
            assert worker.take_load_errors() == set()
            back = torch.tensor(targets, device="cuda")
            for t, original in zip(kv, originals, strict=True):
                assert torch.equal(t[:, back], original)
                assert bool((t[:, index] == -1).all())  # untouched by the load
    finally:
        worker.close()
