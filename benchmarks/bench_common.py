"""Helpers shared by the benchmark scripts (run as ``python benchmarks/<script>.py``)."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

from kvtier.pool import DEFAULT_SHM_DIR


def shm_dir(needed: int, preferred: str) -> str:
    """The first of ``preferred``, /dev/shm, /tmp with room for the pool (a tmpfs pins best)."""
    for directory in (preferred, DEFAULT_SHM_DIR, "/tmp"):
        try:
            st = os.statvfs(directory)
        except OSError:
            continue
        if st.f_bavail * st.f_frsize > needed * 1.1:
            return directory
    raise SystemExit(f"no shared-memory directory with {needed} bytes free")


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what ``platform`` says."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"
