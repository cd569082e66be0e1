"""What the fuzz modules share: hypothesis settings that give the same inputs every run, and a
line of counts printed past pytest's capture (shown under ``-q`` too)."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
from hypothesis import HealthCheck, settings


def fuzz_settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        derandomize=True,  # the same inputs every run: a CI failure reproduces
        database=None,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


def counts_line(label: str, counts: Mapping[str, int]) -> str:
    """``label: total (name n, ...)``."""
    parts = ", ".join(f"{k} {v}" for k, v in counts.items())
    return f"{label}: {sum(counts.values())} ({parts})"


def print_line(request: pytest.FixtureRequest, line: str) -> None:
    """Write ``line`` to the terminal, not to pytest's capture."""
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None:
        with capture.global_and_fixture_disabled():
            reporter.write_line("\n" + line)
