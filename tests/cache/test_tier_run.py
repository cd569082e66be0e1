"""``promotion.tier_run``: the run a lookup may count on after the pool's hits, the same whether
found key by key or, for one tier without failed promotions, in C (``_one_tier_run``)."""

from __future__ import annotations

import random

from kvtier.cache.promotion import tier_run
from kvtier.cache.retry import FailedPromotions


def test_the_run_is_the_same_as_found_key_by_key():
    rng = random.Random(7)
    flags: list[bool | None] = [True, True, True, False, None]
    for case in range(3000):
        n = rng.randrange(1, 40)
        rest = [bytes([case % 251, i]) for i in range(n)]
        tiers = rng.choice([1, 1, 1, 2])
        answers = [[rng.choice(flags) for _ in rest] for _ in range(tiers)]
        if rng.random() < 0.5:  # the common answer: a run held, then not
            cut = rng.randrange(n + 1)
            answers[0] = [True] * cut + [False] * (n - cut)
        index = {k: 0 for k in rest if rng.random() < 0.2}
        inflight = {k: 0 for k in rest if rng.random() < rng.choice([0.0, 0.05])}
        promoting = {k for k in inflight if rng.random() < 0.5}
        failed, key_by_key = FailedPromotions(), FailedPromotions()
        # A failed promotion of a key outside ``rest`` changes no answer but takes the loop.
        key_by_key.remember(0, b"not a key of rest", 0.0)
        if rng.random() < 0.2:
            key = rng.choice(rest)
            failed.remember(0, key, 0.0)
            key_by_key.remember(0, key, 0.0)
        got = tier_run(rest, answers, index, inflight, promoting, failed)
        want = tier_run(rest, answers, index, inflight, promoting, key_by_key)
        assert got == want, case
        assert [type(t) for _, t in got[0]] == [int] * len(got[0])
