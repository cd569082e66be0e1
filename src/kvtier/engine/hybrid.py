"""The planner for hybrid models: several KV cache groups, each with its own block table.

With one full-attention group (``groups`` empty or that one group) this is ``Planner`` unchanged:
same keys, lookups and orders. Otherwise each group's blocks have their own keys
(``keys.group_keys``) and a request resumes at the longest boundary where every group has what
it needs (``engine.groups``): a lookup first finds the leading blocks every full-attention group
has, then asks for the blocks each window group needs before that boundary and the state block
each state group needs (the block ending there), stepping back to the block a group lacks until
all are there. The blocks are pinned together and loaded in one order whose slots name their
group (``CopyOrder.groups``); a missing or changed block of any group, or an allocation without
a block for a state, makes the whole lookup a miss, never a partial state. A model with a group
kvtier cannot store (``groups.servable``), or a state group under blocks of several engine
blocks, is never served: every lookup misses and nothing is stored.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvtier.copy.base import Direction
from kvtier.engine.groups import (
    CacheGroup,
    GroupKind,
    auto_boundary_blocks,
    held_tokens,
    servable,
    tail_blocks,
    window_tail,
)
from kvtier.engine.orders import SKIP, CopyOrder
from kvtier.engine.planner import (
    BlockTableView,
    EngineRequest,
    Planner,
    _LoadPlan,
)
from kvtier.engine.stats_file import Snapshot
from kvtier.events import POOL_TIER
from kvtier.keys import BlockKey, group_keys
from kvtier.metrics import CacheStats

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
class _Tail:
    """A group whose resume needs only the blocks right before the boundary: a sliding window,
    or a state group (one block: the state at the boundary)."""

    group: CacheGroup
    need: int
    """kvtier blocks before a boundary a resume needs."""
    every: int
    """Boundaries whose blocks are stored: every this many kvtier blocks (and each stored end)."""
    held: int
    """Tokens before the next one whose blocks the engine still holds (``groups.held_tokens``)."""

    @property
    def state(self) -> bool:
        return self.group.kind is GroupKind.STATE


class HybridPlanner(Planner):
    """``Planner`` for engines with several KV cache groups (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """``Planner``'s arguments; ``set_groups`` then names the engine's KV cache groups."""
        super().__init__(*args, **kwargs)
        self.set_groups((), 0, None)

    def set_groups(
        self, groups: Sequence[CacheGroup], boundary_blocks: int, null_block: int | None
    ) -> None:
        """The engine's KV cache groups (in its order), the spacing of the window and state
        groups' stored boundaries (0: ``groups.auto_boundary_blocks``) and the engine's id for "no
        block" in a window or state group's table. Call before the first request."""
        one_full = len(groups) == 1 and groups[0].kind not in (GroupKind.WINDOW, GroupKind.STATE)
        self.groups = [] if one_full else list(groups)
        """Empty: one group, the ``Planner``'s behaviour."""
        self.refused = servable(self.groups) if self.groups else None
        """Why this model is not served (None: it is)."""
        states = [g for g in self.groups if g.kind is GroupKind.STATE]
        if self.refused is None and states and self.blocks_per_slot != 1:
            # A state group's boundary is one engine block; a kvtier block of several would
            # hold states the engine already freed.
            self.refused = f"state group {states[0].index} with blocks_per_slot > 1"
        if self.refused is not None:
            log.warning("kvtier serves no request of this model: %s", self.refused)
        self._full = [g.index for g in self.groups if g.kind is GroupKind.FULL]
        self._tails = [
            self._tail_of(g, boundary_blocks)
            for g in self.groups
            if g.kind in (GroupKind.WINDOW, GroupKind.STATE)
        ]
        self._null = null_block
        self._tags = {g.index: g.tag for g in self.groups}
        self._group_keys: dict[str, dict[int, dict[int, BlockKey]]] = {}
        """Request -> group -> kvtier block -> key, made as lookups and stores need them."""
        self._tail_offered: dict[str, set[tuple[int, int]]] = {}
        self.group_counters = {g.index: GroupCounters() for g in self.groups}
        self.alloc_tables: Sequence[Sequence[int]] = ()
        """The request's block ids per group, set by the adapter around ``after_alloc``."""

    def _tail_of(self, group: CacheGroup, boundary_blocks: int) -> _Tail:
        need = tail_blocks(group, self.block_tokens)
        every = boundary_blocks or auto_boundary_blocks(need)
        return _Tail(group, need, every, held_tokens(group))

    def _group_keys_of(self, req_id: str, targets: Sequence[tuple[int, int]]) -> list[BlockKey]:
        """The keys of the request's (group, kvtier block) ``targets``, each made once per request
        from its chain keys (a window or state group needs only a few of its blocks' keys)."""
        chain = self._keys.get(req_id) or []
        made = self._group_keys.setdefault(req_id, {})
        missing: dict[int, set[int]] = {}
        for g, b in targets:
            if b not in made.setdefault(g, {}):
                missing.setdefault(g, set()).add(b)
        for g, wanted in missing.items():
            blocks = sorted(wanted)
            keys = group_keys([chain[b] for b in blocks], self._tags[g])
            made[g].update(zip(blocks, keys, strict=True))
        return [made[g][b] for g, b in targets]

    # -- lookups --------------------------------------------------------------------------------

    def matched_tokens(self, request: EngineRequest, num_computed: int) -> tuple[int | None, bool]:
        if not self.groups:
            return super().matched_tokens(request, num_computed)
        req_id = request.request_id
        self._requests[req_id] = request
        self._release_plan(req_id)
        chain = None if self.refused else self._request_keys(request)
        if chain is None or req_id in self._no_loads:
            return 0, False
        bt = self.block_tokens
        start = num_computed // bt
        limit = min((request.num_tokens - 1) // bt, len(chain))
        if limit <= start:  # the engine holds all it may reuse: nothing to pin for it
            self._hit_blocks[req_id] = (start, start)
            self.counters.engine_hit_blocks += limit
            self.cache.forget(req_id)
            return 0, False
        first_ask = req_id not in self._deferred_since
        self.counters.requests_looked_up += first_ask
        if self.recorder is not None and first_ask:
            self.recorder.record(request, chain)
        found = self._boundary(start, limit, req_id)
        if found is None:  # asked again next step
            self._deferred = req_id
            self._deferred_since.setdefault(req_id, self.cache.now())
            self.counters.deferred_lookups += 1
            return None, False
        self._end_wait(req_id)
        self.counters.engine_hit_blocks += start
        return self._plan(request, start, found, num_computed)

    def _boundary(self, start: int, limit: int, req_id: str) -> int | None:
        """The longest boundary in (start, limit] where every group has its blocks (``start``:
        none), or None while a promotion or a shared load is in flight."""
        end = limit
        if self._full:
            targets = [(g, b) for b in range(start, limit) for g in self._full]
            result = self.cache.lookup(self._group_keys_of(req_id, targets), req_id)
            if not result.final:
                return None
            end = start + result.hits // len(self._full)
        while end > start:
            tail = self._tail(end, start)
            result = self.cache.lookup(self._group_keys_of(req_id, tail), req_id)
            if not result.final:
                return None
            if result.hits == len(tail):
                return end
            # No boundary past a missing block has it before it (a window's, or a state).
            end = tail[result.hits][1]
        return start

    def _tail(self, end: int, start: int) -> list[tuple[int, int]]:
        """(group, block) of each window and state group's blocks a resume at ``end`` loads."""
        return [
            (t.group.index, b) for t in self._tails for b in range(max(start, end - t.need), end)
        ]

    def _plan(
        self, request: EngineRequest, start: int, end: int, num_computed: int
    ) -> tuple[int, bool]:
        req_id = request.request_id
        self._hit_blocks[req_id] = (end, start)
        targets = [(g, b) for b in range(start, end) for g in self._full] + self._tail(end, start)
        load_keys = self._group_keys_of(req_id, targets)
        slots = self.cache.prepare_load(load_keys, req_id)
        external = end * self.block_tokens - num_computed
        if len(slots) < len(load_keys) or external <= 0 or not targets:
            # A group's block left the pool since the lookup: a miss, never a partial state.
            self.cache.release_load(load_keys[: len(slots)])
            self._hit_blocks[req_id] = (start, start)
            return 0, False
        if self._full:
            first = self._full[0]
            counted = self._group_keys_of(req_id, [(first, b) for b in range(start, end)])
            origins = self.cache.origins(counted)
        else:
            origins = [POOL_TIER] * (end - start)
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
        states = {t.group.index for t in self._tails if t.state}
        out: list[int] = []
        fits = True
        for group, position in zip(plan.groups, plan.positions, strict=True):
            table = tables[group] if group < len(tables) else ()
            for e in range(position * bps, (position + 1) * bps):
                if e < computed:
                    out.append(SKIP)
                elif e >= len(table) or (table[e] == self._null and group in states):
                    # No block for it (a state group's must be there: the resume reads it).
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
        chain = None if request is None or self.refused else self._request_keys(request)
        if request is None or chain is None:
            return None
        done = request.num_computed_tokens + num_scheduled
        if not self.settings.store_generated:
            done = min(done, request.num_prompt_tokens)
        full = min(done // self.block_tokens, len(chain))
        offered = self._offered.get(req_id, 0)
        if full <= offered:
            return None
        self._offered[req_id] = full
        targets = [(g, b) for b in range(offered, full) for g in self._full]
        targets += self._tail_stores(request, offered, full, tables)
        keys = self._group_keys_of(req_id, targets)
        where = dict(zip(keys, targets, strict=True))
        reservation = self.cache.prepare_store(keys)
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

    def _tail_stores(
        self, request: EngineRequest, offered: int, full: int, tables: BlockTableView
    ) -> list[tuple[int, int]]:
        """Window and state blocks to store now: those before the boundaries a later request can
        resume from (``groups.window_tail``) that the engine still holds. A block the engine
        freed before this step (out of the window, or a state it no longer needs) may already
        serve another request, so it is not read."""
        req_id = request.request_id
        seen = self._tail_offered.setdefault(req_id, set())
        bps = self.blocks_per_slot
        bt = self.block_tokens
        whole = full * bt in (request.num_prompt_tokens, request.num_tokens)
        out: list[tuple[int, int]] = []
        for t in self._tails:
            g = t.group.index
            # The first engine block the engine still holds for this step's first token.
            live = max(0, request.num_computed_tokens - t.held) // t.group.block_tokens
            table = self._group_table(tables, req_id, g)
            for b in window_tail(offered, full, t.need, t.every, whole):
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
        self._tail_offered.pop(request.request_id, None)
        super().request_finished(request)

    def _hint(self, request: EngineRequest) -> None:
        if not self.groups:
            super()._hint(request)
        else:
            # The eviction hint names the chain's keys; a hybrid model's blocks have their
            # groups' keys, so it gets none (its blocks are evicted in recency order).
            self._hit_blocks.pop(request.request_id, None)

    def stats_snapshot(self, snapshot: CacheStats) -> Snapshot:
        """``Planner.stats_snapshot`` with the groups' kinds and counters (copied here): what
        ``stats()`` returns and the stats file holds."""
        build = super().stats_snapshot(snapshot)
        if not self.groups:
            return build
        groups = {
            f"{g.index}": {
                "kind": g.kind.value,
                "layers": len(g.layers),
                "window": g.window,
                "hit_blocks": self.group_counters[g.index].hit_blocks,
                "stored_blocks": self.group_counters[g.index].stored_blocks,
                "stored_bytes": self.group_counters[g.index].stored_blocks * self._block_bytes(g),
            }
            for g in self.groups
        }
        refused, block_tokens = self.refused, self.block_tokens

        def build_groups() -> dict[str, Any]:
            out = build()
            out["groups"] = groups
            out["groups_refused"] = refused
            out["block_tokens"] = block_tokens
            return out

        return build_groups
