"""What the scheduler half tells the workers about the blocks a step hands out."""

from __future__ import annotations

from types import SimpleNamespace

from support import require

require.importorskip("vllm", "vllm")

from kvtier.integrations.vllm.scheduler import BlockTables, fresh_blocks  # noqa: E402


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


def test_block_tables_follow_vllms_scheduler_outputs() -> None:
    """New requests bring their table, running ones append, resumed ones replace theirs; built
    from vLLM's own output classes, so the attribute names are the real ones."""
    import dataclasses

    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    def step(new: dict[str, list[int]], cached: dict[str, list[int] | None], resumed=()):
        output = SchedulerOutput.make_empty()
        for req_id, ids in new.items():
            output.scheduled_new_reqs.append(
                NewRequestData(
                    **{f.name: None for f in dataclasses.fields(NewRequestData)}
                    | {"req_id": req_id, "prompt_token_ids": [1], "block_ids": (ids,)}
                )
            )
        data = CachedRequestData.make_empty()
        for req_id, ids in cached.items():
            data.req_ids.append(req_id)
            data.new_block_ids.append((ids,) if ids is not None else None)
        data.resumed_req_ids = set(resumed)
        output.scheduled_cached_reqs = data
        return output

    tables = BlockTables()
    tables.update(step({"a": [4, 5], "b": [7]}, {}))
    tables.update(step({}, {"a": [6], "b": None}))
    assert tables.get("a") == [4, 5, 6] and tables.get("b") == [7]
    tables.update(step({}, {"b": [9, 10]}, resumed={"b"}))  # preempted, then resumed
    assert tables.get("b") == [9, 10]
    tables.drop("a")
    assert tables.get("a") == [] and tables.get("unknown") == []
