"""A toy engine for hybrid models: ``HybridPlanner`` and one rank's ``Copier`` over per-group CPU
KV tensors (a ``GroupedCopyBackend`` of two ``CpuCopyBackend``), a block allocator whose block 0
is the null block, and per-group block tables. Tests add how their engine prefills and resumes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvtier.config import load_config
from kvtier.copy.cpu import CpuCopyBackend
from kvtier.copy.grouped import GroupedCopyBackend
from kvtier.engine.copier import Copier
from kvtier.engine.groups import CacheGroup
from kvtier.engine.hybrid import HybridPlanner
from kvtier.engine.orders import RankReport, StepOrders
from kvtier.engine.planner_settings import PlannerSettings
from kvtier.keys import Namespace

LAYERS, PAGE, BS = 2, 32, 4
NULL = 0


class GroupTables:
    """Block ids per request and group, as the planner reads them."""

    def __init__(self) -> None:
        self.tables: dict[str, list[list[int]]] = {}

    def get(self, req_id: str) -> list[int]:
        return self.group(req_id, 0)

    def group(self, req_id: str, group: int) -> list[int]:
        return self.tables.get(req_id, [[], []])[group]


class ToyHybridEngine:
    """Planner, one rank's copier over two groups' KV tensors of ``blocks`` blocks each, and a
    block allocator."""

    def __init__(
        self,
        tmp_path: Path,
        groups: Sequence[CacheGroup],
        *,
        blocks: int,
        pool_blocks: int,
        boundary_blocks: int,
        seed: int,
        settings: PlannerSettings | None = None,
    ) -> None:
        pool = pool_blocks * LAYERS * PAGE
        config = load_config({"model": "toy", "pool": {"size": pool, "shm_dir": str(tmp_path)}})
        kinds = "-".join(g.kind.name.lower() for g in groups)
        ns = Namespace(model="toy", dtype="uint8", block_tokens=BS, extra=kinds)
        self.planner = HybridPlanner(
            config, settings or PlannerSettings(), ns, LAYERS * PAGE, BS, 1
        )
        self.planner.set_groups(list(groups), boundary_blocks, NULL)
        gen = torch.Generator().manual_seed(seed)
        self.kv = {
            g: [
                torch.randint(0, 255, (blocks, PAGE), dtype=torch.uint8, generator=gen)
                for _ in range(LAYERS)
            ]
            for g in (0, 1)
        }

        def grouped(kv: Any, setup: Any) -> GroupedCopyBackend:
            parts = {g: CpuCopyBackend.create(self.kv[g], setup) for g in (0, 1)}
            return GroupedCopyBackend(parts, setup.blocks_per_slot)

        self.copier = Copier(1, 0, 1, backend_factory=grouped)
        self.copier.register([t for g in (0, 1) for t in self.kv[g]])
        self.tables = GroupTables()
        self.next_block = 1  # block 0 is the null block

    def alloc(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def step(self, scheduled: dict[str, int]) -> StepOrders:
        orders = self.planner.plan_step(scheduled, self.tables, None)
        self.copier.start_load(orders)
        self.copier.save(orders)
        self.planner.on_report(self.copier.take_report() or RankReport())
        return orders

    def close(self) -> None:
        self.planner.close()
        self.copier.close()
