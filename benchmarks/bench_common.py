"""Helpers shared by the GPU benchmark scripts (run as ``python benchmarks/<script>.py``)."""

from __future__ import annotations

import os

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
