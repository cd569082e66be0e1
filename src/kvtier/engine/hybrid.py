"""The planner for hybrid models: several KV cache groups, each with its own block table.

With one full-attention group (``groups`` empty or that one group) this is ``Planner`` unchanged:
same keys, lookups and orders. Otherwise each group's blocks have their own keys
(``keys.group_keys``) and a request resumes at the longest boundary where every group has what
it needs (``engine.groups``): a lookup first finds the leading blocks every full-attention group
has, then asks for each window group's blocks before that boundary, stepping back to the block a
window group lacks until all are there. The blocks are pinned together and loaded in one order
whose slots name their group (``CopyOrder.groups``); a missing or changed block of any group
makes the whole lookup a miss, never a partial state. A model with a group kvtier cannot store
(``groups.servable``) is never served: every lookup misses and nothing is stored.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.copy.base import Direction
from kvtier.engine.groups import (
    CacheGroup,
    GroupKind,
    auto_boundary_blocks,
    servable,
    window_blocks,
    window_tail,
)
from kvtier.engine.orders import SKIP, CopyOrder
from kvtier.engine.planner import (
    BlockTableView,
    EngineRequest,
    Planner,
    _LoadPlan,
)
from kvtier.events import POOL_TIER
from kvtier.keys import BlockKey, group_keys

log = logging.getLogger(__name__)


class GroupTables(BlockTableView, Protocol):
    """Each request's engine block ids per KV cache group, as of this step."""

    def group(self, req_id: str, group: int) -> Sequence[int]: ...


@dataclass(slots=True)
class _GroupPlan(_LoadPlan):
    """A load plan of a hybrid model: per slot, its group and kvtier block position."""

    groups: list[int]
    positions: list[int]


@dataclass(slots=True)
class GroupCounters:
    hit_blocks: int = 0
    """Blocks of this group planned for loading."""
    stored_blocks: int = 0
    """Blocks of this group ordered stored."""


@dataclass(frozen=True, slots=True)
class _Window:
    group: CacheGroup
    need: int
    """kvtier blocks before a boundary the next token attends to."""
    every: int
    """Boundaries whose window is stored: every this many kvtier blocks (and each stored end)."""


class HybridPlanner(Planner):
    """``Planner`` for engines with several KV cache groups (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``Planner``'s arguments; ``set_groups`` then names the engine's KV cache groups."""
        super().__init__(*args, **kwargs)
        self.set_groups((), 0, None)

    def set_groups(
        self, groups: Sequence[CacheGroup], boundary_blocks: int, null_block: int | None
    ) -> None:
        """The engine's KV cache groups (in its order), the spacing of the window groups' stored
        boundaries (0: ``groups.auto_boundary_blocks``) and the engine's id for "no block" in
        a window group's table. Call before the first request."""
        one_full = len(groups) == 1 and groups[0].kind not in (GroupKind.WINDOW, GroupKind.STATE)
        self.groups = [] if one_full else list(groups)
        """Empty: one group, the ``Planner``'s behaviour."""
        self.refused = servable(self.groups) if self.groups else None
        """Why this model is not served (None: it is)."""
        if self.refused is not None:
            log.warning("kvtier serves no request of this model: %s", self.refused)
        self._full = [g.index for g in self.groups if g.kind is GroupKind.FULL]
        self._windows = [
            self._window(g, boundary_blocks) for g in self.groups if g.kind is GroupKind.WINDOW
        ]
        self._null = null_block
        self._group_keys: dict[str, dict[int, list[BlockKey]]] = {}
        self._window_offered: dict[str, set[tuple[int, int]]] = {}
        self.group_counters = {g.index: GroupCounters() for g in self.groups}
        self.alloc_tables: Sequence[Sequence[int]] = ()
        """The request's block ids per group, set by the adapter around ``after_alloc``."""

    def _window(self, group: CacheGroup, boundary_blocks: int) -> _Window:
        need = window_blocks(group.window, self.block_tokens)
        return _Window(group, need, boundary_blocks or auto_boundary_blocks(need))

    def _keys_of(self, request: EngineRequest) -> dict[int, list[BlockKey]] | None:
        """Per group, the keys of the request's full kvtier blocks so far."""
        chain = self._request_keys(request)
        if chain is None:
            return None
        out = self._group_keys.setdefault(request.request_id, {})
        for g in self.groups:
            keys = out.setdefault(g.index, [])
            if len(keys) < len(chain):
                keys.extend(group_keys(chain[len(keys) :], g.tag))
        return out

    # -- lookups --------------------------------------------------------------------------------

    def matched_tokens(self, request: EngineRequest, num_computed: int) -> tuple[int | None, bool]:
        if not self.groups:
            return super().matched_tokens(request, num_computed)
        req_id = request.request_id
        self._requests[req_id] = request
        self._release_plan(req_id)
        keys = None if self.refused else self._keys_of(request)
        if keys is None or req_id in self._load_failed:
            return 0, False
        bt = self.block_tokens
        start = num_computed // bt
        limit = min((request.num_tokens - 1) // bt, len(self._keys[req_id] or ()))
        if limit <= start:  # the engine holds all it may reuse: nothing to pin for it
            self._hit_blocks[req_id] = (start, start)
            self.counters.engine_hit_blocks += limit
            self.cache.forget(req_id)
            return 0, False
        first_ask = req_id not in self._deferred_since
        self.counters.requests_looked_up += first_ask
        if self.recorder is not None and first_ask:
            self.recorder.record(request, self._keys[req_id] or [])
        found = self._boundary(keys, start, limit, req_id)
        if found is None:  # asked again next step
            self._deferred = True
            self._deferred_since.setdefault(req_id, time.monotonic())
            self.counters.deferred_lookups += 1
            return None, False
        self._end_wait(req_id)
        self.counters.engine_hit_blocks += start
        return self._plan(request, keys, start, found, num_computed)

    def _boundary(
        self, keys: Mapping[int, list[BlockKey]], start: int, limit: int, req_id: str
    ) -> int | None:
        """The longest boundary in (start, limit] where every group has its blocks (``start``:
        none), or None while a promotion or a shared load is in flight."""
        end = limit
        if self._full:
            wanted = [keys[g][b] for b in range(start, limit) for g in self._full]
            result = self.cache.lookup(wanted, req_id)
            if not result.final:
                return None
            end = start + result.hits // len(self._full)
        while end > start:
            tail = self._tail(end, start)
            result = self.cache.lookup([keys[g][b] for g, b in tail], req_id)
            if not result.final:
                return None
            if result.hits == len(tail):
                return end
            end = tail[result.hits][1]  # no boundary past a missing window block has its window
        return start

    def _tail(self, end: int, start: int) -> list[tuple[int, int]]:
        """(group, block) of each window group's blocks a resume at ``end`` loads."""
        return [
            (w.group.index, b) for w in self._windows for b in range(max(start, end - w.need), end)
        ]

    def _plan(
        self,
        request: EngineRequest,
        keys: Mapping[int, list[BlockKey]],
        start: int,
        end: int,
        num_computed: int,
    ) -> tuple[int, bool]:
        req_id = request.request_id
        self._hit_blocks[req_id] = (end, start)
        targets = [(g, b) for b in range(start, end) for g in self._full] + self._tail(end, start)
        load_keys = [keys[g][b] for g, b in targets]
        slots = self.cache.prepare_load(load_keys, req_id)
        external = end * self.block_tokens - num_computed
        if len(slots) < len(load_keys) or external <= 0 or not targets:
            # A group's block left the pool since the lookup: a miss, never a partial state.
            self.cache.release_load(load_keys[: len(slots)])
            self._hit_blocks[req_id] = (start, start)
            return 0, False
        first = self._full[0] if self._full else targets[0][0]
        counted = [keys[first][b] for b in range(start, end)]
        origins = self.cache.origins(counted) if self._full else [POOL_TIER] * len(counted)
        for origin in origins:
            self.hits_by_tier[origin] = self.hits_by_tier.get(origin, 0) + 1
        for g, _ in targets:
            self.group_counters[g].hit_blocks += 1
        groups = [g for g, _ in targets]
        positions = [b for _, b in targets]
        bt = self.block_tokens
        plan = _GroupPlan(
            load_keys, slots, start * bt, num_computed, external, origins, groups, positions
        )
        self._plans[req_id] = plan
        return external, self.settings.async_loads

    def _load_targets(
        self, plan: _LoadPlan, block_ids: Sequence[int]
    ) -> tuple[list[int], list[int] | None, bool]:
        if not isinstance(plan, _GroupPlan):
            return super()._load_targets(plan, block_ids)
        bps = self.blocks_per_slot
        computed = plan.num_computed // self.engine_block_size
        tables = self.alloc_tables
        out: list[int] = []
        fits = True
        for group, position in zip(plan.groups, plan.positions, strict=True):
            table = tables[group] if group < len(tables) else ()
            for e in range(position * bps, (position + 1) * bps):
                if e < computed:
                    out.append(SKIP)
                elif e >= len(table):
                    out.append(SKIP)
                    fits = False
                elif table[e] == self._null:
                    # Outside the window of the resumed request: the engine holds no block there.
                    out.append(SKIP)
                else:
                    out.append(table[e])
        return out, plan.groups, fits

    # -- stores ---------------------------------------------------------------------------------

    def _store_order(
        self, req_id: str, num_scheduled: int, tables: BlockTableView
    ) -> CopyOrder | None:
        if not self.groups:
            return super()._store_order(req_id, num_scheduled, tables)
        request = self._requests.get(req_id)
        keys = None if request is None or self.refused else self._keys_of(request)
        if request is None or keys is None:
            return None
        done = request.num_computed_tokens + num_scheduled
        if not self.settings.store_generated:
            done = min(done, request.num_prompt_tokens)
        full = min(done // self.block_tokens, len(self._keys[req_id] or ()))
        offered = self._offered.get(req_id, 0)
        if full <= offered:
            return None
        self._offered[req_id] = full
        targets = [(g, b) for b in range(offered, full) for g in self._full]
        targets += self._window_stores(request, offered, full, tables)
        where = {keys[g][b]: (g, b) for g, b in targets}
        reservation = self.cache.prepare_store([keys[g][b] for g, b in targets])
        if not reservation.keys:
            return None
        bps = self.blocks_per_slot
        engine_blocks: list[int] = []
        groups: list[int] = []
        for key in reservation.keys:
            g, b = where[key]
            groups.append(g)
            engine_blocks.extend(self._group_table(tables, req_id, g)[b * bps : (b + 1) * bps])
        if len(engine_blocks) != len(reservation.keys) * bps:
            self.cache.complete_store(reservation.keys, ok=False)
            return None
        for g in groups:
            self.group_counters[g].stored_blocks += 1
        job_id = self._jobs.open(Direction.STORE, reservation.keys)
        self.counters.stores_ordered += 1
        return CopyOrder(job_id, reservation.slots, engine_blocks, groups=groups)

    def _window_stores(
        self, request: EngineRequest, offered: int, full: int, tables: BlockTableView
    ) -> list[tuple[int, int]]:
        """Window blocks to store now: those before the boundaries a later request can resume
        from (``groups.window_tail``) that the engine still holds. A block that left the window
        before this step may already serve another request, so it is not read."""
        req_id = request.request_id
        seen = self._window_offered.setdefault(req_id, set())
        bps = self.blocks_per_slot
        out: list[tuple[int, int]] = []
        for w in self._windows:
            g = w.group.index
            # The first engine block this step's first token attends to (the engine frees the
            # blocks before it once they leave the window).
            live = max(0, request.num_computed_tokens - w.group.window + 1) // w.group.block_tokens
            table = self._group_table(tables, req_id, g)
            for b in window_tail(offered, full, w.need, w.every):
                ids = table[b * bps : (b + 1) * bps]
                if (g, b) in seen or b * bps < live or len(ids) < bps or self._null in ids:
                    continue
                seen.add((g, b))
                out.append((g, b))
        return out

    @staticmethod
    def _group_table(tables: BlockTableView, req_id: str, group: int) -> Sequence[int]:
        by_group = getattr(tables, "group", None)
        if by_group is None:
            return tables.get(req_id) if group == 0 else ()
        table: Sequence[int] = by_group(req_id, group)
        return table

    def _block_bytes(self, group: CacheGroup) -> int:
        """Bytes of one kvtier block of ``group`` over all ranks (a slot may hold more: slots
        are sized for the group with the most layers)."""
        return self.tp_size * len(group.layers) * self.blocks_per_slot * group.page_bytes

    # -- requests and reports -------------------------------------------------------------------

    def request_finished(self, request: EngineRequest) -> None:
        self._group_keys.pop(request.request_id, None)
        self._window_offered.pop(request.request_id, None)
        super().request_finished(request)

    def _hint(self, request: EngineRequest) -> None:
        if not self.groups:
            super()._hint(request)
        else:
            # The eviction hint names the chain's keys; a hybrid model's blocks have their
            # groups' keys, so it gets none (its blocks are evicted in recency order).
            self._hit_blocks.pop(request.request_id, None)

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        if self.groups:
            out["groups"] = {
                f"{g.index}": {
                    "kind": g.kind.value,
                    "layers": len(g.layers),
                    "window": g.window,
                    "hit_blocks": self.group_counters[g.index].hit_blocks,
                    "stored_blocks": self.group_counters[g.index].stored_blocks,
                    "stored_bytes": self.group_counters[g.index].stored_blocks
                    * self._block_bytes(g),
                }
                for g in self.groups
            }
            out["groups_refused"] = self.refused
            out["block_tokens"] = self.block_tokens
        return out
