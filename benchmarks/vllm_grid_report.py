"""The grid's figures, acceptance checks, table and plot (``benchmarks/vllm_gpu_bench.py --grid``).

Reads the grid JSON only (no vLLM): ``points`` maps a point key (``16x4``: 16 conversations in
flight, a 4 GiB host pool) to its ``workload`` and ``configs``, each configuration a row as
``vllm_gpu_bench.run_config`` wrote it, with its per-request records (``per_request``: a
``fields`` list and one ``rows`` entry per request, keyed by the request's submission id
``c<conversation>.t<turn>``, the same id in every configuration).

The acceptance checks are issue 24's, per point: kvtier + fs against the better of vLLM's native
offloading and its tiering with an fs tier (``native_fs``) on TTFT p50/p90/p99 (lower) and output
tokens/s (higher), within ``TIE_BAND`` a tie; the requests with hits under kvtier + fs against
the same requests in vLLM alone (mean and p90 strictly lower); promoted blocks at most
``PROMOTED_PER_LOADED`` x loaded blocks; kvtier's pool against native on every figure; the
connector's p99 time per engine step against native's. Where native caches under 5% of the
reusable prompt tokens (the thrash regime), the pool's share of the prompt tokens against half of
the offline optimum's for the same request sequence and pool size (``OPTIMA_JSON``).

A variant (``kvtier_fs+tiers.0.write=on_evict``: ``config_variants``) is a row of its own in the
table and the plot, after its base; the checks stay on the base configurations, and each variant
gets a line of ratios to its base at the same point (an A/B on one host, not an acceptance).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

import config_variants as variants

CONFIGS = ("none", "native", "native_fs", "kvtier", "kvtier_fs")
TIE_BAND = 0.03
"""Within 3% of the reference counts as a tie (and is said so)."""
PROMOTED_PER_LOADED = 1.1
REQUEST_FIELDS = ("id", "ttft_ms", "prompt_tokens", "cached_tokens", "output_digest")
TTFT_FIGURES = (("TTFT p50", "50"), ("TTFT p90", "90"), ("TTFT p99", "99"))
TTFT_LABELS = frozenset(label for label, _ in TTFT_FIGURES)
OPTIMA_JSON = Path(__file__).resolve().parents[1] / "docs" / "results" / "pressure_bench.json"
"""``benchmarks/pressure_bench.py``'s rows: among them the offline optimum (``kvtier.sim.optimal``)
of the grid's own request sequence per concurrency and host pool, Llama-3.1-8B's 2 MiB blocks in
the pool alone, as the share of all prompt blocks it serves."""
OPTIMA_MODEL = "Llama-3.1-8B"
"""The model those rows are for (the grid JSON's ``model`` starts with it)."""
THRASH_SHARE = 0.05
"""Native caching less than this share of the reusable prompt tokens is the thrash regime."""
OPTIMUM_SHARE = 0.5
"""There, the pool must serve at least this share of what the offline optimum serves."""

Optima = dict[tuple[int, float], tuple[int, float]]
"""(concurrency, host GiB) -> (requests, the optimum's share of the prompt blocks)."""


def load_optima(path: Path = OPTIMA_JSON) -> Optima:
    """The offline optimum of the grid's sequence at each point ``path`` has (none: empty)."""
    try:
        rows = json.loads(path.read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {
        (int(r["concurrency"]), float(r["pool_gib"])): (int(r["requests"]), float(r["hit_ratio"]))
        for r in rows
        if r.get("sequence") == "benchmark" and r.get("policy") == "optimal"
    }


def percentile(values: list[float], q: float) -> float:
    """The value at rank ``q`` percent of the sorted values (nearest rank); nan when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request of one configuration, as kept in the JSON."""

    id: str
    ttft_ms: float
    prompt_tokens: int
    cached_tokens: int
    output_digest: str

    def row(self) -> list[Any]:
        return [self.id, self.ttft_ms, self.prompt_tokens, self.cached_tokens, self.output_digest]


def per_request(records: list[RequestRecord]) -> dict[str, Any]:
    """The JSON form: field names once, one short row per request."""
    return {"fields": list(REQUEST_FIELDS), "rows": [r.row() for r in records]}


def request_records(row: dict[str, Any]) -> dict[str, RequestRecord]:
    """A configuration row's requests by submission id (empty for rows without them)."""
    table = row.get("per_request") or {}
    fields = table.get("fields", [])
    if tuple(fields) != REQUEST_FIELDS:
        return {}
    out: dict[str, RequestRecord] = {}
    for values in table.get("rows", []):
        rec = RequestRecord(
            str(values[0]), float(values[1]), int(values[2]), int(values[3]), str(values[4])
        )
        out[rec.id] = rec
    return out


@dataclass(frozen=True, slots=True)
class HitPairing:
    """The requests with cached prompt tokens under a configuration, against the same requests
    (same submission ids) in vLLM alone."""

    requests: int
    """Requests with hits that vLLM alone also served (the paired ones)."""
    unpaired: int
    """Requests with hits missing from vLLM alone's records."""
    mean_ms: float
    p90_ms: float
    base_mean_ms: float
    base_p90_ms: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "unpaired": self.unpaired,
            "mean_ms": round(self.mean_ms, 2),
            "p90_ms": round(self.p90_ms, 2),
            "none_mean_ms": round(self.base_mean_ms, 2),
            "none_p90_ms": round(self.base_p90_ms, 2),
        }


def pair_hits(row: dict[str, Any], base: dict[str, Any]) -> HitPairing | None:
    """TTFT of ``row``'s requests with hits, mean and p90, and of the same requests in ``base``
    (vLLM alone). None when either row has no per-request records or no request had a hit."""
    ours, theirs = request_records(row), request_records(base)
    if not ours or not theirs:
        return None
    hits = [r for r in ours.values() if r.cached_tokens > 0]
    paired = [r for r in hits if r.id in theirs]
    if not paired:
        return None
    mine = [r.ttft_ms for r in paired]
    base_ttft = [theirs[r.id].ttft_ms for r in paired]
    return HitPairing(
        requests=len(paired),
        unpaired=len(hits) - len(paired),
        mean_ms=statistics.fmean(mine),
        p90_ms=percentile(mine, 90),
        base_mean_ms=statistics.fmean(base_ttft),
        base_p90_ms=percentile(base_ttft, 90),
    )


# -- verdicts -----------------------------------------------------------------------------------


class Verdict(Enum):
    BETTER = "better"
    TIE = "tie"
    """Worse by at most ``TIE_BAND``."""
    WORSE = "worse"
    MISSING = "n/a"
    """A figure needed for the check is missing (configuration not run or failed)."""

    @property
    def passes(self) -> bool:
        return self in (Verdict.BETTER, Verdict.TIE)


def compare(ours: float, theirs: float, *, higher_is_better: bool) -> tuple[Verdict, float]:
    """``ours`` against ``theirs``: at or beyond it is better (equal counts as better: "at or
    below"), worse by at most ``TIE_BAND`` a tie. Returns the verdict and ours / theirs."""
    if theirs == 0:
        if ours == 0:
            return Verdict.BETTER, 1.0
        return (Verdict.BETTER if higher_is_better else Verdict.WORSE), float("inf")
    ratio = ours / theirs
    better = ratio >= 1 if higher_is_better else ratio <= 1
    if better:
        return Verdict.BETTER, ratio
    # A ratio of exactly 1.03 must not fall out of the band by a rounding error.
    return (Verdict.TIE if abs(ratio - 1) <= TIE_BAND + 1e-12 else Verdict.WORSE), ratio


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    verdict: Verdict
    detail: str


def usable(configs: dict[str, Any], name: str) -> dict[str, Any] | None:
    row = configs.get(name)
    return row if isinstance(row, dict) and "error" not in row else None


def _figures(row: dict[str, Any]) -> dict[str, float]:
    out = {label: float(row["ttft_ms"][q]) for label, q in TTFT_FIGURES}
    out["output tok/s"] = float(row["output_tokens_per_s"])
    return out


def _ratio_check(name: str, label: str, ours: float, theirs: float, higher: bool) -> Check:
    verdict, ratio = compare(ours, theirs, higher_is_better=higher)
    detail = f"{label}: {ours:,.1f} vs {theirs:,.1f} ({ratio:.3f}x)"
    return Check(name, verdict, detail)


def _fs_against_native(configs: dict[str, Any]) -> list[Check]:
    name = "kvtier_fs vs best of native/native_fs"
    ours = usable(configs, "kvtier_fs")
    refs = [(n, r) for n in ("native", "native_fs") if (r := usable(configs, n)) is not None]
    if ours is None or not refs:
        return [Check(name, Verdict.MISSING, "needs kvtier_fs and native or native_fs")]
    mine = _figures(ours)
    best: dict[str, tuple[float, str]] = {}
    for ref_name, ref in refs:
        for label, value in _figures(ref).items():
            higher = label == "output tok/s"
            old = best.get(label)
            if old is None or (value > old[0] if higher else value < old[0]):
                best[label] = value, ref_name
    note = "" if len(refs) == 2 else " (one reference missing)"
    spreads = {ref_name: _reference_spread(ours, ref_name, ref) for ref_name, ref in refs}
    checks = []
    for label, value in mine.items():
        theirs, ref_name = best[label]
        check = _ratio_check(name + note, label, value, theirs, label == "output tok/s")
        if label in TTFT_LABELS:
            check = replace(check, detail=check.detail + spreads[ref_name])
        checks.append(check)
    return checks


def _reference_spread(ours: dict[str, Any], ref_name: str, ref: dict[str, Any]) -> str:
    """Whose a TTFT figure is, and both rows' mean and slowest request: vLLM's fs tiering has
    the lower p50 at most points by stalling a few requests for seconds, which frees the engine
    for the other conversations (a closed loop: a stalled conversation sends nothing)."""
    spreads = []
    for row in (ours, ref):
        ttfts = [r.ttft_ms for r in request_records(row).values()]
        if not ttfts:
            return f" ({ref_name}'s)"
        spreads.append(f"{statistics.fmean(ttfts):,.0f} / {max(ttfts):,.0f}")
    return f" ({ref_name}'s); mean / max TTFT ours {spreads[0]}, {ref_name} {spreads[1]} ms"


def _hits_against_none(configs: dict[str, Any], config: str) -> list[Check]:
    name = f"{config} requests with hits vs the same in vLLM alone"
    row, base = usable(configs, config), usable(configs, "none")
    pairing = pair_hits(row, base) if row and base else None
    if pairing is None:
        return [Check(name, Verdict.MISSING, "needs per-request records and hits")]
    checks = []
    for label, ours, theirs in (
        ("mean", pairing.mean_ms, pairing.base_mean_ms),
        ("p90", pairing.p90_ms, pairing.base_p90_ms),
    ):
        verdict = Verdict.BETTER if ours < theirs else Verdict.WORSE
        ratio = ours / theirs if theirs else float("nan")
        detail = (
            f"{label} {ours:,.1f} vs {theirs:,.1f} ms ({ratio:.3f}x) over "
            f"{pairing.requests} requests"
        )
        checks.append(Check(name, verdict, detail))
    return checks


def promotion_ratio(row: dict[str, Any]) -> float | None:
    """Promoted blocks per loaded block over the timed run (None when not a kvtier row)."""
    kv = row.get("kvtier")
    if not isinstance(kv, dict):
        return None
    promoted, loaded = int(kv.get("promoted_blocks", 0)), int(kv.get("loaded_blocks", 0))
    if loaded == 0:
        return 0.0 if promoted == 0 else float("inf")
    return promoted / loaded


def _promotion(configs: dict[str, Any], config: str) -> Check:
    name = f"{config} promoted <= {PROMOTED_PER_LOADED}x loaded"
    row = usable(configs, config)
    ratio = promotion_ratio(row) if row else None
    if row is None or ratio is None:
        return Check(name, Verdict.MISSING, "needs kvtier counters")
    kv = row["kvtier"]
    verdict = Verdict.BETTER if ratio <= PROMOTED_PER_LOADED else Verdict.WORSE
    detail = f"{kv['promoted_blocks']:,} promoted / {kv['loaded_blocks']:,} loaded ({ratio:.2f}x)"
    return Check(name, verdict, detail)


def _pool_against_native(
    configs: dict[str, Any], workload: dict[str, Any], optimum: tuple[int, float] | None
) -> list[Check]:
    name = "kvtier pool vs native"
    ours, native = usable(configs, "kvtier"), usable(configs, "native")
    if ours is None or native is None:
        return [Check(name, Verdict.MISSING, "needs kvtier and native")]
    mine, theirs = _figures(ours), _figures(native)
    checks = [
        _ratio_check(name, label, mine[label], theirs[label], label == "output tok/s")
        for label in mine
    ]
    checks.append(
        _ratio_check(
            name,
            "prompt tokens cached",
            float(ours["prompt_tokens_cached"]),
            float(native["prompt_tokens_cached"]),
            True,
        )
    )
    reusable = int(workload.get("reusable_prompt_tokens") or 0)
    if reusable and native["prompt_tokens_cached"] / reusable < THRASH_SHARE:
        checks.append(_against_optimum(name, ours, native, reusable, workload, optimum))
    return checks


def _against_optimum(
    name: str,
    ours: dict[str, Any],
    native: dict[str, Any],
    reusable: int,
    workload: dict[str, Any],
    optimum: tuple[int, float] | None,
) -> Check:
    name += " (thrash regime)"
    detail = (
        f"native caches {native['prompt_tokens_cached'] / reusable:.1%} of {reusable:,} "
        f"reusable tokens, kvtier {ours['prompt_tokens_cached'] / reusable:.1%}"
    )
    if optimum is None or optimum[0] != workload.get("requests") or not ours["prompt_tokens"]:
        return Check(name, Verdict.MISSING, detail + "; no offline optimum of this sequence")
    hit = ours["prompt_tokens_cached"] / ours["prompt_tokens"]
    best = optimum[1]
    verdict = Verdict.BETTER if hit >= OPTIMUM_SHARE * best else Verdict.WORSE
    detail += (
        f"; of all prompt tokens kvtier {hit:.3f}, the offline optimum {best:.3f} "
        f"({hit / best:.2f} of it, at least {OPTIMUM_SHARE} needed)"
    )
    return Check(name, verdict, detail)


def _connector_p99(configs: dict[str, Any], config: str) -> Check:
    name = f"{config} connector p99 per step vs native"
    ours, native = usable(configs, config), usable(configs, "native")
    mine = (ours or {}).get("connector_step_us")
    theirs = (native or {}).get("connector_step_us")
    if not mine or not theirs:
        return Check(name, Verdict.MISSING, "needs connector step times of both")
    return _ratio_check(name, "p99 us", float(mine["p99"]), float(theirs["p99"]), False)


def point_checks(point: dict[str, Any], optima: Optima | None = None) -> list[Check]:
    """Issue 24's acceptance checks at one grid point (``optima``: ``load_optima``'s)."""
    configs: dict[str, Any] = point.get("configs", {})
    workload: dict[str, Any] = point.get("workload", {})
    at = (int(point.get("concurrency") or 0), float(point.get("host_gib") or 0))
    optimum = (optima or {}).get(at)
    checks = _fs_against_native(configs)
    checks += _hits_against_none(configs, "kvtier_fs")
    checks.append(_promotion(configs, "kvtier_fs"))
    checks.append(_promotion(configs, "kvtier"))
    checks += _pool_against_native(configs, workload, optimum)
    checks.append(_connector_p99(configs, "kvtier"))
    checks.append(_connector_p99(configs, "kvtier_fs"))
    return checks


# -- table --------------------------------------------------------------------------------------


def sorted_points(data: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    points: dict[str, dict[str, Any]] = data.get("points", {})
    return sorted(
        points.items(), key=lambda kv: (kv[1].get("concurrency", 0), kv[1].get("host_gib", 0))
    )


CONFIG_WIDTH = 10
"""The table's config column: the bases' names; a variant's label widens it."""


def table_head(width: int = CONFIG_WIDTH) -> str:
    return (
        f"{'point':<7} {'config':<{width}} {'p50 ms':>8} {'p90':>8} {'p99':>8} {'tok/s':>7} "
        f"{'computed':>9} {'cached':>9} {'hits':>5} {'hit mean/none':>15} {'hit p90/none':>15} "
        f"{'prom/load':>9} {'step us p50/p99':>16} {'date':>10} {'commit':>7}"
    )


TABLE_HEAD = table_head()


def ordered_configs(labels: Iterable[str]) -> list[str]:
    """The table's order: the bases as ``CONFIGS`` has them, each followed by its variants (by
    label); a name that is neither is left out."""
    names = set(labels)
    out: list[str] = []
    for base in CONFIGS:
        if base in names:
            out.append(base)
        out += sorted(n for n in names if variants.is_variant(n) and variants.base_of(n) == base)
    return out


def config_width(labels: Iterable[str]) -> int:
    return max([CONFIG_WIDTH, *(len(label) for label in labels)])


def _hit_cells(row: dict[str, Any], base: dict[str, Any] | None) -> tuple[str, str, str]:
    pairing = pair_hits(row, base) if base else None
    if pairing is None:
        return str(row.get("requests_with_cached_tokens", "-")), "-", "-"
    mean = f"{pairing.mean_ms:,.0f}/{pairing.base_mean_ms:,.0f}"
    p90 = f"{pairing.p90_ms:,.0f}/{pairing.base_p90_ms:,.0f}"
    return str(pairing.requests), mean, p90


def table_row(
    key: str,
    config: str,
    row: dict[str, Any],
    base: dict[str, Any] | None,
    width: int = CONFIG_WIDTH,
) -> str:
    if "error" in row:
        return f"{key:<7} {config:<{width}} failed: {str(row['error'])[:100]}"
    t = row["ttft_ms"]
    step = row.get("connector_step_us")
    steps = f"{step['p50']:,.0f}/{step['p99']:,.0f}" if step else "-"
    ratio = promotion_ratio(row)
    prom = "-" if ratio is None else f"{ratio:.2f}"
    hits, mean, p90 = _hit_cells(row, base)
    date = str(row.get("date", ""))[:10]
    commit = str(row.get("commit", ""))[:7]
    return (
        f"{key:<7} {config:<{width}} {t['50']:>8,.0f} {t['90']:>8,.0f} {t['99']:>8,.0f} "
        f"{row['output_tokens_per_s']:>7,.1f} {row['prompt_tokens_computed']:>9,} "
        f"{row['prompt_tokens_cached']:>9,} {hits:>5} {mean:>15} {p90:>15} {prom:>9} "
        f"{steps:>16} {date:>10} {commit:>7}"
    )


VARIANTS_HEAD = (
    f"variants against their base at the same point (ratios variant/base, within {TIE_BAND:.0%} "
    "a tie):"
)


def _against_base(name: str, ours: float | None, theirs: float | None, higher: bool) -> str:
    if ours is None or theirs is None:
        return f"{name} -"
    verdict, ratio = compare(ours, theirs, higher_is_better=higher)
    return f"{name} {ratio:.3f}x {verdict.value}"


def _connector_p99_us(row: dict[str, Any]) -> float | None:
    step = row.get("connector_step_us")
    return float(step["p99"]) if step else None


def variant_line(label: str, row: dict[str, Any], base: dict[str, Any] | None) -> str:
    """``label``'s row against its base's at one point: output tokens/s, TTFT p99 and the
    connector's p99 time per engine step."""
    name = variants.base_of(label)
    if "error" in row:
        return f"{label} vs {name}: failed"
    if base is None:
        return f"{label} vs {name}: no usable {name} row"
    ours, theirs = _figures(row), _figures(base)
    cells = (
        _against_base("tok/s", ours["output tok/s"], theirs["output tok/s"], higher=True),
        _against_base("TTFT p99", ours["TTFT p99"], theirs["TTFT p99"], higher=False),
        _against_base(
            "connector p99", _connector_p99_us(row), _connector_p99_us(base), higher=False
        ),
    )
    return f"{label} vs {name}: " + ", ".join(cells)


def variant_lines(point: dict[str, Any]) -> list[str]:
    """A line per variant at a point (``variant_line``), in the table's order."""
    configs: dict[str, Any] = point.get("configs", {})
    return [
        variant_line(label, configs[label], usable(configs, variants.base_of(label)))
        for label in ordered_configs(configs)
        if variants.is_variant(label) and isinstance(configs[label], dict)
    ]


def grid_lines(data: dict[str, Any]) -> list[str]:
    """The table (one line per point and configuration), each variant against its base, then
    each point's checks (the bases' only)."""
    points = sorted_points(data)
    width = config_width(c for _k, p in points for c in ordered_configs(p.get("configs", {})))
    lines = [f"model     {data.get('model')}", table_head(width)]
    for key, point in points:
        configs: dict[str, Any] = point.get("configs", {})
        base = usable(configs, "none")
        for config in ordered_configs(configs):
            lines.append(table_row(key, config, configs[config], base, width))
    compared = [f"  {key} {line}" for key, p in points for line in variant_lines(p)]
    if compared:
        lines += ["", VARIANTS_HEAD, *compared]
    lines.append("")
    lines.append(f"acceptance (issue 24; ratios ours/reference, within {TIE_BAND:.0%} a tie):")
    optima = load_optima() if str(data.get("model")).startswith(OPTIMA_MODEL) else {}
    for key, point in sorted_points(data):
        checks = point_checks(point, optima)
        passed = sum(c.verdict.passes for c in checks)
        decided = sum(c.verdict is not Verdict.MISSING for c in checks)
        lines.append(f"  {key}: {passed} of {decided} checks pass")
        for c in checks:
            lines.append(f"    {c.verdict.value:<6} {c.name}: {c.detail}")
    return lines


# -- plot ---------------------------------------------------------------------------------------


def plot_path(json_path: Path) -> Path:
    return json_path.with_suffix(".png")


def _series(
    points: list[tuple[str, dict[str, Any]]], host: float, config: str, figure: str
) -> tuple[list[int], list[float]]:
    xs: list[int] = []
    ys: list[float] = []
    for _key, point in points:
        if point.get("host_gib") != host:
            continue
        row = usable(point.get("configs", {}), config)
        if row is None:
            continue
        xs.append(int(point["concurrency"]))
        value = row["ttft_ms"]["99"] if figure == "p99" else row["output_tokens_per_s"]
        ys.append(float(value))
    return xs, ys


def _failures(points: list[tuple[str, dict[str, Any]]], host: float) -> list[str]:
    """``config@concurrency`` of the rows that failed at this host size (no marker shows them)."""
    return [
        f"{config}@{point['concurrency']}"
        for _key, point in points
        if point.get("host_gib") == host
        for config, row in point.get("configs", {}).items()
        if isinstance(row, dict) and "error" in row
    ]


def plot_styles(points: list[tuple[str, dict[str, Any]]]) -> dict[str, tuple[str, str, str]]:
    """Each configuration's line style, marker and colour, the same in every panel whichever
    ran there: the bases' colours fixed by ``CONFIGS``, the variants' after them (matplotlib's
    cycle has ten) with a dash-dot line and square markers, told apart from their base."""
    labels = {c for _k, p in points for c in p.get("configs", {})}
    styles: dict[str, tuple[str, str, str]] = {}
    for index, config in enumerate(CONFIGS):
        styles[config] = ("-" if config.startswith("kvtier") else "--", "o", f"C{index}")
    found = [c for c in ordered_configs(labels) if variants.is_variant(c)]
    for index, config in enumerate(found, len(CONFIGS)):
        styles[config] = ("-.", "s", f"C{index % 10}")
    return styles


def write_plot(data: dict[str, Any], path: Path) -> Path | None:
    """p99 TTFT and output tokens/s against concurrency, one line per configuration, one
    column per host pool size. None (and nothing written) without matplotlib or points."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    points = sorted_points(data)
    hosts = sorted({float(p["host_gib"]) for _k, p in points})
    if not hosts:
        return None
    fig, axes = plt.subplots(2, len(hosts), figsize=(4.2 * len(hosts), 7), squeeze=False)
    styles = plot_styles(points)
    for col, host in enumerate(hosts):
        for row_index, (figure, label) in enumerate(
            (("p99", "TTFT p99 (ms)"), ("tok/s", "output tokens/s"))
        ):
            ax = axes[row_index][col]
            for config, (style, marker, color) in styles.items():
                xs, ys = _series(points, host, config, figure)
                if xs:
                    ax.plot(xs, ys, style, marker=marker, label=config, color=color)
            ax.set_ylim(bottom=0)
            failed = _failures(points, host)
            if failed and row_index == 1:
                ax.text(
                    0.02,
                    0.02,
                    "failed: " + ", ".join(failed),
                    transform=ax.transAxes,
                    fontsize="x-small",
                    color="firebrick",
                )
            ax.set_xscale("log", base=2)
            concurrencies = sorted({int(p["concurrency"]) for _k, p in points})
            ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
            ax.set_xlabel("conversations in flight")
            ax.set_ylabel(label)
            ax.grid(True, alpha=0.3)
            if row_index == 0:
                ax.set_title(f"host pool {host:g} GiB")
    # One legend for every line drawn: a variant may run at points the first panel lacks.
    shown: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, name in zip(*ax.get_legend_handles_labels(), strict=True):
            shown.setdefault(name, handle)
    # Below the panels, where it covers no line (variants' labels are long).
    columns = 2
    rows = -(-len(shown) // columns)
    legend_inches = 0.3 + 0.17 * rows
    fig.set_figheight(7 + legend_inches)
    fig.legend(
        list(shown.values()), list(shown), loc="lower center", ncol=columns, fontsize="x-small"
    )
    fig.suptitle(f"vLLM GPU bench grid: {data.get('model', '')}", fontsize="medium")
    fig.tight_layout(rect=(0, legend_inches / (7 + legend_inches), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
