"""How well what an online policy knows predicts a block's next use, on a trace.

For every block of every request (a block occurrence): the features a policy has once the request
finished, and the label "used again within H requests". Conversations (requests that share their
first block) are split in two halves by a hash of that block; P(label | feature cell) is counted
on one half and scores the other, then the halves swap, so no occurrence is scored by counts it
contributed to. Reported: the AUC of that score (0.5: no better than chance; 1.0: a perfect
ranking) per feature set and horizon, separately for *new* blocks (computed by the request: first
seen there) and *found* blocks (in the request's leading run of blocks seen before). Occurrences
less than H requests before the end of the trace are left out (their label is unknown).

The horizons bracket what matters at 4,000 blocks on the bundled trace: LRU keeps a block about
130 requests, the offline optimum hits nearly every reuse within 500 requests (docs/policies.md).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvtier.sim.trace import TraceRequest, bundled_trace_path, read_trace

IntArray = npt.NDArray[np.int64]

FEATURES = (
    "output",
    "from_end",
    "hit_any",
    "uses",
    "conversation",
    "block_gap",
    "conv_gap",
    "length",
)
"""Per occurrence, all known when its request finished: output tokens (bit length), place from the
end of the request (0, 1, 2+), whether the request found any block, times the block was used so
far (1..4+), requests of its conversation so far (1..8+), requests since the block's previous use
and since the conversation's previous request (bit length, 0: none), request blocks (bit length)."""
FEATURE_SETS = {
    "hint (hinted's classes)": ("output", "from_end", "hit_any"),
    "hint + use counts": ("output", "from_end", "hit_any", "uses", "conversation"),
    "hint + gaps": ("output", "from_end", "hit_any", "block_gap", "conv_gap"),
    "all": FEATURES,
}
HORIZONS = (150, 300, 500, 800)
PRIOR = 16.0
"""A cell's rate is shrunk towards its kind's rate by this many occurrences (as ``hinted`` does)."""
RADIX = 32


@dataclass(slots=True)
class Row:
    features: str
    kind: str
    horizon: int
    auc: float
    """Scored by counts of the other half of the conversations."""
    auc_in_sample: float
    """Scored by counts of all conversations, its own included: what statistics of the same
    trace would claim (the gap to ``auc`` is over-fitting)."""
    occurrences: int
    reused_fraction: float


@dataclass(slots=True)
class Occurrences:
    features: IntArray
    """One row per occurrence, one column per ``FEATURES`` entry."""
    found: npt.NDArray[np.bool_]
    next_gap: IntArray
    """Requests until the block's next use (a large number when never)."""
    request: IntArray
    half: npt.NDArray[np.bool_]
    """Which half of the conversations the occurrence belongs to."""


def _bits(value: int, cap: int) -> int:
    return min(value.bit_length(), cap)


def collect(requests: Sequence[TraceRequest]) -> Occurrences:
    never = 1 << 40
    next_use: dict[int, int] = {}
    next_gaps: list[int] = []
    for t in range(len(requests) - 1, -1, -1):
        for block in reversed(requests[t].hash_ids):
            next_gaps.append(next_use.get(block, t + never) - t)
            next_use[block] = t
    next_gaps.reverse()
    uses: dict[int, int] = {}
    last_use: dict[int, int] = {}
    conv_count: dict[int, int] = {}
    conv_last: dict[int, int] = {}
    rows: list[tuple[int, ...]] = []
    found: list[bool] = []
    request: list[int] = []
    half: list[bool] = []
    for t, req in enumerate(requests):
        blocks = req.hash_ids
        n = len(blocks)
        run = 0
        while run < n and blocks[run] in uses:
            run += 1
        conv = blocks[0]
        conv_gap = t - conv_last[conv] if conv in conv_last else 0
        conv_count[conv] = conv_count.get(conv, 0) + 1
        conv_last[conv] = t
        in_first_half = (conv * 2654435761) % 1000 < 500
        for i, block in enumerate(blocks):
            block_gap = t - last_use[block] if block in last_use else 0
            uses[block] = uses.get(block, 0) + 1
            last_use[block] = t
            rows.append(
                (
                    _bits(req.output_length, 16),
                    min(n - 1 - i, 2),
                    int(run > 0),
                    min(uses[block], 4),
                    min(conv_count[conv], 8),
                    _bits(block_gap, 12),
                    _bits(conv_gap, 12),
                    _bits(n, 10),
                )
            )
            found.append(i < run)
            request.append(t)
            half.append(in_first_half)
    return Occurrences(
        np.array(rows, dtype=np.int64),
        np.array(found),
        np.array(next_gaps, dtype=np.int64),
        np.array(request, dtype=np.int64),
        np.array(half),
    )


def auc(scores: npt.NDArray[np.float64], labels: npt.NDArray[np.bool_]) -> float:
    """Mann-Whitney AUC with ties counted half."""
    positives = int(labels.sum())
    negatives = len(labels) - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts)
    mid_rank = ends - (counts - 1) / 2.0
    rank_sum = float(mid_rank[inverse][labels].sum())
    return (rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives)


def cell_rates(cell: IntArray, labels: npt.NDArray[np.bool_], size: int) -> npt.NDArray[np.float64]:
    """Per cell: the reuse rate, shrunk towards the overall rate by ``PRIOR`` occurrences."""
    seen = np.bincount(cell, minlength=size).astype(np.float64)
    hits = np.bincount(cell, weights=labels, minlength=size)
    base = float(labels.mean()) if len(labels) else 0.0
    rates: npt.NDArray[np.float64] = (hits + PRIOR * base) / (seen + PRIOR)
    return rates


def scores(
    cells: IntArray, labels: npt.NDArray[np.bool_], half: npt.NDArray[np.bool_]
) -> tuple[npt.NDArray[np.float64], npt.NDArray[np.float64]]:
    """Each occurrence's cell rate: counted on the other half (cross-fitted), and on all."""
    _, cell = np.unique(cells, return_inverse=True)
    size = int(cell.max()) + 1 if len(cell) else 0
    cross = np.empty(len(cells), dtype=np.float64)
    for train in (half, ~half):
        cross[~train] = cell_rates(cell[train], labels[train], size)[cell[~train]]
    return cross, cell_rates(cell, labels, size)[cell]


def measure(occ: Occurrences, last_request: int) -> list[Row]:
    rows: list[Row] = []
    for name, columns in FEATURE_SETS.items():
        index = [FEATURES.index(c) for c in columns]
        cells = np.zeros(len(occ.found), dtype=np.int64)
        for column in index:
            cells = cells * RADIX + occ.features[:, column]
        for horizon in HORIZONS:
            known = occ.request <= last_request - horizon
            labels = occ.next_gap <= horizon
            for kind, mask in (("new", ~occ.found), ("found", occ.found)):
                keep = known & mask
                cross, in_sample = scores(cells[keep], labels[keep], occ.half[keep])
                rows.append(
                    Row(
                        name,
                        kind,
                        horizon,
                        auc(cross, labels[keep]),
                        auc(in_sample, labels[keep]),
                        int(keep.sum()),
                        float(labels[keep].mean()),
                    )
                )
    return rows


def print_table(rows: list[Row]) -> None:
    header = " | ".join(f"within {h}" for h in HORIZONS)
    print(f"| features | blocks | {header} |")
    print("|---|---|" + "---:|" * len(HORIZONS))
    for name in FEATURE_SETS:
        for kind in ("new", "found"):
            cells = [r for r in rows if r.features == name and r.kind == kind]
            values = " | ".join(f"{r.auc:.3f} ({r.auc_in_sample:.3f})" for r in cells)
            print(f"| {name} | {kind} | {values} |")
    for kind in ("new", "found"):
        cells = [r for r in rows if r.features == next(iter(FEATURE_SETS)) and r.kind == kind]
        values = " | ".join(f"{r.reused_fraction:.2f} of {r.occurrences:,}" for r in cells)
        print(f"| (reused within H) | {kind} | {values} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--trace", type=Path, default=None, help="default: the bundled trace")
    parser.add_argument("--json", type=Path, default=Path("docs/results/reuse_predictability.json"))
    args = parser.parse_args()
    requests = read_trace(args.trace or bundled_trace_path())
    rows = measure(collect(requests), len(requests) - 1)
    print("AUC of the reuse rate counted on the other conversations (on all, in brackets);")
    print("0.5 = chance:")
    print_table(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {"trace": str(args.trace or "bundled"), "rows": [asdict(r) for r in rows]}
    args.json.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
