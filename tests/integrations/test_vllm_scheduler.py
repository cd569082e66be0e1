"""What the scheduler half tells the workers about the blocks a step hands out."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from kvtier.integrations.vllm.scheduler import fresh_blocks


def test_fresh_blocks_are_every_block_handed_out_this_step() -> None:
    output = SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(block_ids=([3, 4, 5],)),
            SimpleNamespace(block_ids=([9],)),
        ],
        # A running request that got a block, one that got none, a resumed one.
        scheduled_cached_reqs=SimpleNamespace(new_block_ids=[([7],), None, ([11, 12],)]),
        kv_cache_block_copies=[SimpleNamespace(src_block_id=3, dst_block_id=20)],
    )
    assert fresh_blocks(output) == [3, 4, 5, 9, 7, 11, 12, 20]


def test_fresh_blocks_unknown_when_the_output_does_not_say() -> None:
    assert fresh_blocks(SimpleNamespace(num_scheduled_tokens={"a": 4})) is None


def test_fresh_blocks_of_a_real_vllm_scheduler_output() -> None:
    """The attribute names match vLLM's own ``SchedulerOutput`` (not only our stand-ins)."""
    import dataclasses

    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    new = NewRequestData(
        **{f.name: None for f in dataclasses.fields(NewRequestData)}
        | {"req_id": "a", "prompt_token_ids": [1, 2], "block_ids": ([5, 6],)}
    )
    cached = CachedRequestData.make_empty()
    cached.req_ids.append("b")
    cached.new_block_ids.append(([8],))
    output = SchedulerOutput.make_empty()
    output.scheduled_new_reqs.append(new)
    output.scheduled_cached_reqs = cached
    assert fresh_blocks(output) == [5, 6, 8]
