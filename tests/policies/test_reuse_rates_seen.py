"""``ReuseRates.seen`` picks a request's sampled keys in one numpy pass where all keys have
``KEY_BYTES`` bytes: it counts the same reuses as the test of each key's last byte."""

from __future__ import annotations

import random

from kvtier.policies.reuse_rates import SAMPLE, ReuseRates


def reference(rates: ReuseRates, keys: list[bytes]) -> list[float]:
    """The reuses per class that a per-key loop counts, on a copy of the followed keys."""
    followed = dict(rates._followed)
    reused = list(rates._reused)
    for key in keys:
        if key and key[-1] % SAMPLE == 0:
            cls = followed.pop(key, None)
            if cls is not None:
                reused[cls if cls >= 0 else ~cls] += 1.0  # ~class: counted as inserted
    return reused


def test_seen_counts_the_reuses_a_per_key_test_counts() -> None:
    rng = random.Random(7)
    for length in (16, 15, 0):  # 15 and 0: not every key has KEY_BYTES bytes (the loop)
        rates = ReuseRates(64)
        keys = [rng.randbytes(16) for _ in range(300)]
        if length != 16:
            keys[5] = rng.randbytes(length)
        followed = [key for key in keys if rates.follow(key, rng.randrange(6))]
        assert followed  # a quarter of them, by the last byte
        later = keys[::2] + [rng.randbytes(16) for _ in range(40)]
        expected = reference(rates, later)
        rates.seen(later)
        assert rates._reused == expected
        assert rates._reused_total == sum(expected) > 0.0
