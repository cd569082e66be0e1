"""Waiting for a server process the test started to answer its health check."""

from __future__ import annotations

import subprocess
import time
import urllib.request
from pathlib import Path


def wait_until_healthy(
    proc: subprocess.Popen[bytes], base: str, log_path: Path, timeout_s: float = 300
) -> None:
    """Return once ``base``/health answers 200; fail with the log's tail if the process exits
    or the timeout passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, log_path.read_text()[-5000:]
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, log_path.read_text()[-5000:]
        time.sleep(1)
