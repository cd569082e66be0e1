"""``hinted`` under pressure with an engine's cache in front of the pool (issue 24: in vLLM at 16
conversations in flight x 2 GiB the pool cached 1.8% of the reusable tokens where the replay of
the same sequence kept a stable subset)."""

from __future__ import annotations

from kvtier.policies import HintedPolicy, RequestHint


def key(conversation: int, block: int) -> bytes:
    return conversation.to_bytes(8, "little") + block.to_bytes(8, "little")


def test_engine_hits_do_not_count_as_the_pools() -> None:
    """The gauge compares the stable shadow with what the pool found: blocks the engine's own
    cache held (vLLM's GPU prefix cache; a preempted request scheduled again) are not the
    pool's. Counted in, they kept the stable mode off."""
    policy = HintedPolicy(100)
    for i in range(200):
        keys = [key(i % 16, b) for b in range(40)]
        policy.on_request(keys, RequestHint(40, 64, 40))  # the engine held all of it
    assert policy.gauge.baseline == 0.0
    assert policy.pressure


def test_hint_clamps_engine_blocks() -> None:
    assert RequestHint(5, None, 9).engine_blocks == 5
    assert RequestHint(5, None, -1).engine_blocks == 0
    assert RequestHint(5, None, "x").served_blocks == 5  # type: ignore[arg-type]
    assert RequestHint(5, None, 2).served_blocks == 3
