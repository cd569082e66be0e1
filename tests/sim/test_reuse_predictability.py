"""``benchmarks/reuse_predictability.py``: its AUC, its cross-fitting and its labels."""

from __future__ import annotations

import itertools
from types import ModuleType

import numpy as np
import pytest
from support.scripts import load_script

from kvtier.sim.trace import TraceRequest


@pytest.fixture(scope="module")
def rp() -> ModuleType:
    return load_script("benchmarks/reuse_predictability.py")


def brute_auc(scores: list[float], labels: list[bool]) -> float:
    pairs = [
        1.0 if p > n else 0.5 if p == n else 0.0
        for (p, lp), (n, ln) in itertools.product(zip(scores, labels, strict=True), repeat=2)
        if lp and not ln
    ]
    return sum(pairs) / len(pairs)


def test_auc_equals_pair_counting_with_ties(rp: ModuleType) -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        scores = rng.integers(0, 4, size=30).astype(float)
        labels = rng.random(30) < 0.4
        if labels.all() or not labels.any():
            continue
        assert rp.auc(scores, labels) == pytest.approx(brute_auc(list(scores), list(labels)))


def test_cross_fitted_scores_do_not_see_their_own_half(rp: ModuleType) -> None:
    # Each cell's label is fixed within a half and opposite across halves: counted on all, a cell
    # looks informative; counted on the other half only, it ranks every occurrence wrongly.
    cells = np.array([0, 0, 1, 1, 0, 0, 1, 1], dtype=np.int64)
    half = np.array([True] * 4 + [False] * 4)
    labels = np.array([True, True, False, False, False, False, True, True])
    cross, in_sample = rp.scores(cells, labels, half)
    assert rp.auc(cross, labels) == 0.0
    assert rp.auc(in_sample, labels) == 0.5
    # A rule that holds in both halves is found by both.
    labels = np.array([True, True, False, False, True, True, False, False])
    cross, in_sample = rp.scores(cells, labels, half)
    assert rp.auc(cross, labels) == 1.0 == rp.auc(in_sample, labels)


def test_occurrences_are_labelled_by_next_use(rp: ModuleType) -> None:
    requests = [
        TraceRequest(0.0, 1024, 10, (1, 2)),
        TraceRequest(1.0, 1536, 500, (1, 2, 3)),
        TraceRequest(2.0, 512, 10, (9,)),
        TraceRequest(3.0, 1024, 10, (1, 4)),
    ]
    occ = rp.collect(requests)
    assert occ.found.tolist() == [False, False, True, True, False, False, True, False]
    assert occ.next_gap[:3].tolist() == [1, 1, 2]
    assert occ.next_gap[3] > 1000  # block 2 is not used after request 1
    uses = occ.features[:, rp.FEATURES.index("uses")]
    assert uses.tolist() == [1, 1, 2, 2, 1, 1, 3, 1]
    conversation = occ.features[:, rp.FEATURES.index("conversation")]
    assert conversation.tolist() == [1, 1, 2, 2, 2, 1, 3, 3]
