"""``promotion.tier_run``: the run a lookup may count on after the pool's hits, the same whether
found key by key or, for one tier without failed promotions, in C (``_one_tier_run``)."""

from __future__ import annotations

import random

from kvtier.cache.promotion import Answer, tier_run
from kvtier.cache.retry import FailedPromotions
from kvtier.keys import BlockKey


def reference_run(
    rest: list[BlockKey],
    answers: list[Answer],
    index: dict[BlockKey, int],
    inflight: dict[BlockKey, int],
    promoting: set[BlockKey],
    failed: FailedPromotions,
) -> tuple[list[tuple[BlockKey, int]], bool]:
    """``tier_run`` key by key, as it was before the one-tier path."""
    run: list[tuple[BlockKey, int]] = []
    unknown = False
    for i, key in enumerate(rest):
        if key in index:
            run.append((key, -1))
            continue
        if key in inflight:
            unknown = key in promoting
            break
        chosen = -1
        for tier_index, answer in enumerate(answers):
            present = answer[i]
            if present and (tier_index, key) not in failed:
                chosen = tier_index
                break
            if present is None:
                unknown = True
        if chosen < 0:
            break
        unknown = False
        run.append((key, chosen))
    return run, unknown


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
        failed = FailedPromotions()
        if rng.random() < 0.2:
            failed.remember(0, rng.choice(rest), 0.0)
        got = tier_run(rest, answers, index, inflight, promoting, failed)
        want = reference_run(rest, answers, index, inflight, promoting, failed)
        assert got == want, case
        assert [type(t) for _, t in got[0]] == [int] * len(got[0])
