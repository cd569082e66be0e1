"""Closing tiers within a bound, whatever they do."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from kvtier.tiers.base import Tier

log = logging.getLogger(__name__)


def close_tiers(tiers: Sequence[Tier], timeout_s: float) -> None:
    """Close every tier on its own helper thread, all at once, and wait at most ``timeout_s`` in
    all. A tier whose ``close()`` has not returned by then is named in a warning and left to
    finish on its own."""
    closers = [
        threading.Thread(target=_close, args=(tier,), name=f"kvtier-close-{tier.name}", daemon=True)
        for tier in tiers
    ]
    for thread in closers:
        thread.start()
    deadline = time.monotonic() + timeout_s
    for tier, thread in zip(tiers, closers, strict=True):
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            log.warning(
                "tier %s did not close within %g s; going on without it", tier.name, timeout_s
            )


def _close(tier: Tier) -> None:
    try:
        tier.close()
    except Exception:
        log.exception("closing tier %s failed", tier.name)
