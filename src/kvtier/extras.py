"""kvtier's optional extras and the install hint every "missing dependency" message carries.

kvtier is on no package index, so ``pip install 'kvtier[redis]'`` fails for a user who installed
it from a checkout or a wheel (docs/vllm.md, "Installing kvtier"). The hint therefore names the
extra's own packages, installed with the Python that runs kvtier (in vLLM's environment that is
vLLM's Python), and the checkout form. ``EXTRAS`` mirrors ``pyproject.toml``'s
``[project.optional-dependencies]`` (tests/test_extras.py compares them).
"""

from __future__ import annotations

import shlex
import sys

EXTRAS: dict[str, tuple[str, ...]] = {
    "redis": ("redis>=5", "hiredis>=2"),
    "prometheus": ("prometheus-client>=0.17",),
    "plot": ("matplotlib>=3.7",),
}
"""Extra name -> its requirements, as in pyproject.toml."""

_MODULES = {
    "redis": "redis",
    "hiredis": "redis",
    "prometheus_client": "prometheus",
    "matplotlib": "plot",
}
"""Top-level module a missing-dependency ImportError names -> the extra that brings it."""


def install_hint(extra: str) -> str:
    """How to install ``extra`` into the running Python, e.g. ``/venv/bin/python -m pip install
    'redis>=5' 'hiredis>=2' (kvtier's redis extra; from a checkout: pip install '.[redis]')``."""
    packages = " ".join(shlex.quote(p) for p in EXTRAS[extra])
    return (
        f"{shlex.quote(sys.executable or 'python3')} -m pip install {packages} "
        f"(kvtier's {extra} extra; from a kvtier checkout: pip install '.[{extra}]')"
    )


def extra_for(exc: ImportError) -> str | None:
    """The extra whose package ``exc`` found missing, None when it is none of kvtier's."""
    name = exc.name or ""
    return _MODULES.get(name.partition(".")[0])
