"""Slot and pin invariants of ``TieredCache``, checked by tests and soaks (``check_invariants``).
Walks every slot: not for the hot path."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from kvtier.keys import BlockKey


@dataclass(frozen=True, slots=True)
class CacheState:
    num_slots: int
    visible: Mapping[BlockKey, int]
    inflight: Mapping[BlockKey, int]
    held: Collection[int]
    free: list[int]
    policy_size: int
    pins: Mapping[BlockKey, int]
    loading: Mapping[BlockKey, int]
    jobs: int


def check(state: CacheState, settled: bool = False) -> None:
    """Raise ``AssertionError`` naming the first broken invariant.

    Every slot is in exactly one place (visible, being written, held by a job, free); the policy
    tracks exactly the visible keys; every pin is on a visible key. ``settled``: no job runs any
    more, so no pin, load or held slot may be left.
    """
    visible = set(state.visible.values())
    inflight = set(state.inflight.values())
    held = set(state.held)
    free = set(state.free)
    _require(len(state.free) == len(free), "a slot was freed twice")
    _require(len(visible) == len(state.visible), "two visible keys share a slot")
    places = (visible, inflight, held, free)
    for i, a in enumerate(places):
        for b in places[i + 1 :]:
            _require(not a & b, f"slots in two places at once: {sorted(a & b)[:5]}")
    _require(visible | inflight | held | free == set(range(state.num_slots)), "a slot leaked")
    _require(state.policy_size == len(state.visible), "the policy tracks other keys")
    _require(all(key in state.visible for key in state.pins), "a pinned key is not visible")
    _require(state.loading.keys() <= state.pins.keys(), "a load without a pin")
    if settled:
        _require(not state.jobs, f"{state.jobs} jobs still running")
        _require(not state.pins, f"{len(state.pins)} pins left")
        _require(not state.held, f"{len(state.held)} slots still held")


def _require(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(f"TieredCache invariant broken: {what}")
