"""Hybrid models' KV cache groups: which window blocks are stored, what a resume needs, tags."""

from __future__ import annotations

import pytest

from kvtier.engine.groups import (
    CacheGroup,
    GroupKind,
    auto_boundary_blocks,
    held_tokens,
    servable,
    tail_blocks,
    window_blocks,
    window_tail,
)


def _group(index: int, kind: GroupKind, window: int = 0, layers: int = 2) -> CacheGroup:
    names = tuple(f"model.layers.{index + 10 * i}.attn" for i in range(layers))
    return CacheGroup(index, kind, names, 4096, 16, window)


def test_a_window_needs_the_blocks_its_next_token_attends_to() -> None:
    assert window_blocks(64, 32) == 2  # 63 tokens before the next one: 2 blocks
    assert window_blocks(65, 32) == 2
    assert window_blocks(66, 32) == 3
    assert window_blocks(4096, 16) == 256
    assert window_blocks(1, 16) == 1
    assert auto_boundary_blocks(2) == 16 and auto_boundary_blocks(64) == 256


def test_window_tails_cover_the_end_the_block_before_and_every_nth_boundary() -> None:
    # A 31-block prompt stored at once, window of 2 blocks, boundaries every 16.
    assert window_tail(0, 31, 2, 16) == [14, 15, 28, 29, 30]
    # Decode steps adding one block: the new end's window (the rest was stored before).
    assert window_tail(31, 32, 2, 16) == [30, 31]
    assert window_tail(31, 33, 2, 16) == [30, 31, 32]
    # A window as long as the spacing: every block is before some boundary.
    assert window_tail(0, 8, 4, 4) == list(range(8))
    # Never past the stored end, never below block 0.
    assert window_tail(0, 1, 3, 16) == [0]
    assert window_tail(0, 0, 3, 16) == []


def test_the_block_before_the_end_only_where_the_tokens_end_on_the_boundary() -> None:
    # Tokens beyond the last whole block: no lookup of this prefix stops one block short.
    assert window_tail(0, 31, 2, 16, whole_prompt=False) == [14, 15, 29, 30]
    # A state group (one block): the state at the end, and at 16; the one before the end only
    # for a prompt of whole blocks, looked up one block short.
    assert window_tail(0, 31, 1, 16, whole_prompt=False) == [15, 30]
    assert window_tail(0, 31, 1, 16) == [15, 29, 30]


def test_a_state_group_needs_the_block_ending_at_the_boundary() -> None:
    state, window = _group(0, GroupKind.STATE), _group(1, GroupKind.WINDOW, 64)
    assert tail_blocks(state, 16) == 1 and tail_blocks(window, 16) == 4
    # vLLM keeps a running request's state of its last computed token (the block holding it);
    # a window's last window - 1 tokens.
    assert held_tokens(state) == 1 and held_tokens(window) == 63


def test_tags_name_kind_and_geometry_so_groups_never_alias() -> None:
    a, b = _group(0, GroupKind.WINDOW, 64), _group(2, GroupKind.WINDOW, 64)
    assert a.tag != b.tag  # same geometry, other layers and block table
    assert a.tag != CacheGroup(0, GroupKind.WINDOW, a.layers, 4096, 16, 128).tag
    assert a.tag != CacheGroup(0, GroupKind.FULL, a.layers, 4096, 16, 0).tag
    assert a.tag != CacheGroup(0, GroupKind.WINDOW, a.layers, 8192, 16, 64).tag
    assert a.tag.startswith("window:0:layers=2:")


@pytest.mark.parametrize(
    ("kinds", "refused"),
    [
        ((GroupKind.WINDOW, GroupKind.FULL), None),
        ((GroupKind.FULL, GroupKind.FULL, GroupKind.WINDOW), None),
        ((GroupKind.STATE, GroupKind.FULL), None),
        ((GroupKind.STATE, GroupKind.WINDOW, GroupKind.FULL), None),
        ((GroupKind.STATE,), "no full-attention group"),
        ((GroupKind.FULL, GroupKind.OTHER), "group 1 is other"),
        ((GroupKind.WINDOW,), "no full-attention group"),
    ],
)
def test_a_model_with_a_group_kvtier_cannot_store_is_not_served(
    kinds: tuple[GroupKind, ...], refused: str | None
) -> None:
    why = servable(_group(i, k) for i, k in enumerate(kinds))
    if refused is None:
        assert why is None
    else:
        assert why is not None and why.startswith(refused)
