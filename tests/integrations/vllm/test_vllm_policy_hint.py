"""The connector's scheduler half tells the eviction policy what vLLM knows of a finished
request."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from kvtier.config import load_config
from kvtier.integrations.vllm.scheduler import SchedulerSide
from kvtier.integrations.vllm.settings import VllmSettings
from kvtier.keys import Namespace
from kvtier.policies import RequestHint


def request(req_id: str, prompt: list[int], output: int) -> SimpleNamespace:
    tokens = prompt + [7] * output
    return SimpleNamespace(
        request_id=req_id,
        num_tokens=len(tokens),
        num_prompt_tokens=len(prompt),
        num_output_tokens=output,
        num_computed_tokens=0,
        all_token_ids=tokens,
        mm_features=None,
        prompt_embeds=None,
        lora_request=None,
        cache_salt=None,
    )


def test_a_finished_request_hints_its_prompt_blocks_hits_and_output(tmp_path: Path) -> None:
    config = load_config({"pool": {"size": 64 * 16, "shm_dir": str(tmp_path)}})
    ns = Namespace(model="m", dtype="bfloat16", block_tokens=4)
    side = SchedulerSide(config, VllmSettings(), ns, 64, engine_block_size=4, tp_size=1)
    hints: list[tuple[list[bytes], RequestHint]] = []
    real = side.cache.hint_request

    def recording(keys: list[bytes], hint: RequestHint) -> None:
        hints.append((list(keys), hint))
        real(keys, hint)

    side.cache.hint_request = recording  # type: ignore[method-assign]
    try:
        first = request("a", list(range(10)), output=5)  # 2 full prompt blocks
        assert side.matched_tokens(first, 0) == (0, False)
        # Stored by hand as the store path would: both prompt blocks are in the pool now.
        keys = side._request_keys(first)
        assert keys is not None
        res = side.cache.prepare_store(keys[:2])
        side.cache.complete_store(res.keys)
        side.request_finished(first)
        assert hints == [(keys[:2], RequestHint(0, 5))]
        # The same prompt again, generating more blocks' worth: it hits both, and only the
        # prompt's blocks are hinted (generated tokens are not part of what a later request sends).
        again = request("b", list(range(10)), output=9)
        assert side.matched_tokens(again, 0) == (8, False)
        side.after_alloc(again, [0, 1, 2, 3], 0)  # vLLM did not take them: unpinned
        side.request_finished(again)
        assert hints[1] == (keys[:2], RequestHint(2, 9))
        # A request that was never looked up hints nothing.
        side.request_finished(request("c", list(range(10)), output=1))
        assert len(hints) == 2
    finally:
        side.close()
