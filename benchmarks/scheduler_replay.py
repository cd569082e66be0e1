#!/usr/bin/env python3
"""Replay the GPU grid's request sequence through vLLM's real scheduler on a simulated clock.

``benchmarks/vllm_gpu_bench.py --grid`` needs an H100. This replays the same requests
(``vllm_bench_engine.build_point``: the same prompts, conversations and order, a conversation's
next turn sent when its previous one ends) through vLLM's own ``AsyncScheduler`` with the
connectors' real scheduler halves (kvtier's ``KVTierConnector``, vLLM's ``OffloadingConnector``),
driven as ``EngineCore.step_with_batch_queue`` drives it. Only time is emulated: the GPU's steps,
the copy engines and the CPU's share of a step follow a cost model fitted to the H100's rows
(``scheduler_replay_engine.Cost``), and the connectors' workers act on the metadata their
scheduler halves send. Who is scheduled when, what is cached, loaded, stored and evicted, is
vLLM's and kvtier's code deciding.

The replay's KV cache is one layer of Llama-3.1-8B's shape (a GPU cache of 1,024 blocks of 16
tokens, as the grid's 2 GiB), host pools scaled by the 32 layers it leaves out, so they hold as
many blocks as the real ones. Configurations: ``none``, ``native``, ``kvtier``, ``kvtier_fs``
(the pool plus kvtier's fs tier: the real ``FsTier`` on a temporary directory with its jobs'
time emulated, ``scheduler_replay_fs``; its speeds are ``--fs``, its capacity ``--fs-gib``), and
variants of kvtier with config keys set after ``+`` (``kvtier+vllm.async_loads=true``,
``kvtier_fs+pool.promotion_budget=0.25``). vLLM's fs tiering is not emulated.

Prints a table per point (TTFT p50/p90/p99, mean, output tokens/s, prompt tokens cached, the
time steps waited for synchronous loads; the JSON also has where requests waited before they
were scheduled, ``queue_wait_ms`` by ``scheduler_replay_engine.WAIT_KINDS``) and, where
``--measured`` has the point, the measured row and the per-request TTFT correlation with it;
then each kvtier row against native on issue 24's figures (within 3% a tie). Writes the rows as
JSON in the grid's shape (``--json``).
``--hold EVERY:MS`` keeps every EVERY-th request sent (a later turn) out of vLLM for MS: the
stalls of vLLM's fs tiering in the H100 grid, without its fs tier.

``KVTIER_BENCH_PROFILE=DIR[,MS]`` profiles the connector's hooks in the steps slower than MS,
as in the GPU benchmark (``DIR/<config>-<point>.prof``; kvtier + fs's include the emulated fs
tier's jobs, which run on the scheduler's thread here).

Each row has the connector's time per engine step as the grid measures it (every scheduler-side
connector call, ``vllm_bench_engine.SCHEDULER_HOOKS``, a step ending with
``build_connector_meta``): ``connector_step_us`` wall time, as the grid, and
``connector_step_cpu_us`` the scheduler thread's CPU time (``time.thread_time``), which other
processes on a shared machine do not add to. Both connectors' scheduler halves run their real
code, so the CPU ratio to native is the grid's acceptance figure on this machine.

It runs against the installed vLLM, or an unpacked wheel with ``--vllm-path``. The GPU grid runs
vLLM 0.25.1; to replay with it (the wheel from the offline wheelhouse, ``.whl``)::

    mkdir -p /tmp/wh && cat .whl/parts/wheelhouse.tar.part-* | tar -x -C /tmp/wh \\
        vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl
    python3 -m zipfile -e /tmp/wh/vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl /tmp/vllm0251
    PYTHONPATH=src python3 benchmarks/scheduler_replay.py --vllm-path /tmp/vllm0251 \\
        --points 4x8,8x4 --configs none,native,kvtier,kvtier+vllm.async_loads=true

(``.whl/wheels/`` holds the same wheel once ``vllm_offline_wheelhouse.py build`` has run.) A 4x
point takes about 15 s per configuration on two cores, 8x4 and 16x2 one to two minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import config_variants as variants
import scheduler_replay_engine as replay
import scheduler_replay_fs as rfs
import scheduler_replay_vllm as rv
import vllm_bench_engine as eng
import vllm_grid as grid
import vllm_grid_report as gr
from config_variants import ConfigSpec as ConfigSpec  # re-exported: steady and tests name it

REPO = Path(__file__).resolve().parent.parent
DEFAULT_POINTS = "4x2,4x4,4x8,8x4,16x2"
"""The grid points measured on the H100 (``docs/results/vllm_gpu_bench_grid.json``)."""
MEASURED_JSON = REPO / "docs/results/vllm_gpu_bench_grid.json"
FIGURES = (("TTFT p50", "50", False), ("TTFT p90", "90", False), ("TTFT p99", "99", False))
REPLAY_CONFIGS = ("none", "native", "kvtier", "kvtier_fs")
"""The bases the replay runs (vLLM's fs tiering is not emulated)."""


def parse_config(text: str) -> ConfigSpec:
    """A replay configuration: one of ``REPLAY_CONFIGS``, kvtier's with ``+key=value``
    settings (``config_variants``). ``beside.`` keys are refused, not ignored: the replay runs
    no engine process for anything to run beside, and a row under that label would claim it."""
    spec = variants.parse_config(text, REPLAY_CONFIGS)
    if spec.beside:
        raise ValueError(
            f"config {text!r}: {', '.join(spec.beside)} run beside vLLM's engine in the GPU "
            "benchmark (vllm_gpu_bench.py); the replay cannot"
        )
    return spec


def kvtier_extra(
    host_bytes: int, overrides: dict[str, Any], tiers: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The grid's kvtier config (a pool of the host size and ``tiers``, none by default) with
    dotted keys set (a number picks a list's item: ``tiers.0.write=on_evict``)."""
    extra: dict[str, Any] = {"pool": {"size": host_bytes}, "tiers": tiers or [], "vllm": {}}
    return variants.apply_overrides(extra, overrides)


@dataclass(frozen=True, slots=True)
class Point:
    key: str
    concurrency: int
    host_gib: float
    requests: int


def run_config(
    point: Point,
    spec: ConfigSpec,
    settings: eng.Settings,
    cost: replay.Cost,
    workdir: Path,
    hold: tuple[int, float] | None = None,
    fs: rfs.FsSetup | None = None,
    warmup: bool = False,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One configuration at one point: its row (the grid's keys) and the workload summary;
    ``hold``: ``replay.replay``'s; ``fs``: the emulated fs tier of ``kvtier_fs``; ``warmup``:
    the GPU benchmark's warm-up first (what it stores stays in the connectors)."""
    model = eng.make_model("llama8b", workdir)
    prompts, summary = eng.build_point(settings, model, point.concurrency, point.requests)
    shape = rv.EngineShape(
        gpu_blocks=summary["gpu_kv_bytes"] // (model.kv_bytes_per_token * rv.BLOCK_TOKENS),
        max_num_seqs=max(point.concurrency, 8),  # vllm_bench_engine.engine_kwargs
        max_model_len=summary["max_model_len"],
    )
    host_bytes = int(point.host_gib * (1 << 30)) // rv.LLAMA_LAYERS
    machine = replay.Machine(cost)
    emulation = None
    if spec.kind == "kvtier_fs":
        emulation = rfs.Emulation(machine, fs or rfs.FsSetup(), workdir)
    kind = "kvtier" if spec.kind.startswith("kvtier") else spec.kind
    tiers = emulation.tier_configs() if emulation is not None else None
    extra = kvtier_extra(host_bytes, spec.overrides, tiers) if kind == "kvtier" else None
    with rfs.emulated(emulation):
        engine = rv.make_engine(shape, model.path, rv.ConnectorChoice(kind, host_bytes, extra))
    worker = replay.make_worker(kind, machine, engine.version)
    loop = replay.EngineLoop(engine, machine, worker)
    connector = engine.connector
    profile = eng.profile_setting()
    timer = None
    if connector is not None:
        timer = eng.HookTimer(connector, enabled=True, profile_s=profile[1] if profile else None)
    started = time.perf_counter()
    try:
        if warmup:
            lengths = sorted(len(p) for p in prompts.all())
            warm, again = eng.warmup_prompts(model, eng.warmup_lengths(lengths))
            replay.warm_up(loop, warm, again, eng.WARMUP_TOKENS)
        convs = prompts.conversations()
        done = replay.replay(loop, convs, point.concurrency, settings.max_tokens, hold)
        counters = connector_counters(engine.connector)
    finally:
        if timer is not None:
            timer.close()
        if emulation is not None:
            emulation.draining = True  # shutdown settles every job at once
        if engine.connector is not None:
            engine.connector.shutdown()
        if emulation is not None:
            emulation.remove()
    row = row_of(done, counters, time.perf_counter() - started)
    if emulation is not None:
        row["fs_model"] = emulation.summary()
    if profile is not None and timer is not None:
        eng.save_slow_profile(timer, profile[0], f"{spec.label}-{point.key}.prof")
        row["profiled_steps"] = timer.profiled_steps
    return {**row, **(eng.connector_figures(timer) if timer is not None else {})}, summary


def connector_counters(connector: Any) -> dict[str, int] | None:
    """kvtier's planner and cache counters that say what was hit, loaded and stored."""
    snapshot = getattr(connector, "stats_snapshot", None)
    if snapshot is None:
        return None
    stats = snapshot()
    c, cache = stats["connector"], stats["cache"]
    out = {
        "hit_tokens": int(c["hit_tokens"]),
        "loads_ordered": int(c["loads_ordered"]),
        "stores_ordered": int(c["stores_ordered"]),
        "loaded_blocks": int(cache["loaded_blocks"]),
        "stored_blocks": int(cache["stored_blocks"]),
        "pool_evictions": int(cache["pool_evictions"]),
        "load_failed": int(cache["load_failed"]),
    }
    return {**out, **rfs.tier_counters(stats)}


def row_of(
    done: replay.Replayed, counters: dict[str, int] | None, elapsed: float
) -> dict[str, Any]:
    ttft = [s.ttft_ms for s in done.served]
    records = [
        gr.RequestRecord(s.request_id, s.ttft_ms, s.prompt, s.cached, "")
        for s in sorted(done.served, key=lambda s: s.request_id)
    ]
    row: dict[str, Any] = {
        "requests": len(ttft),
        "ttft_ms": {str(q): round(gr.percentile(ttft, q), 2) for q in (50, 90, 99)},
        "ttft_mean_ms": round(statistics.fmean(ttft), 2),
        "output_tokens_per_s": round(done.output_tokens / done.wall_s, 1),
        "wall_s": round(done.wall_s, 2),
        "prompt_tokens": sum(s.prompt for s in done.served),
        "prompt_tokens_cached": sum(s.cached for s in done.served),
        "external_tokens": sum(s.external for s in done.served),
        "steps": done.steps,
        "sync_load_wait_ms": round(done.sync_wait_ms, 1),
        "queue_wait_ms": {kind: round(ms) for kind, ms in done.waits_ms.items()},
        "held_requests": done.held,
        "replay_s": round(elapsed, 1),
        "per_request": gr.per_request(records),
        "slowest": slowest(done),
    }
    if counters is not None:
        row["kvtier"] = counters
    return row


SLOWEST = 12


def slowest(done: replay.Replayed) -> list[dict[str, Any]]:
    """The ``SLOWEST`` requests by TTFT: prompt and cached tokens and where they waited before
    they were scheduled (``queue_wait_ms``'s kinds, milliseconds)."""
    out = []
    for s in sorted(done.served, key=lambda s: -s.ttft_ms)[:SLOWEST]:
        waits = done.request_waits.get(s.request_id, {})
        out.append(
            {
                "id": s.request_id,
                "ttft_ms": s.ttft_ms,
                "prompt": s.prompt,
                "cached": s.cached,
                "waits_ms": {kind: round(ms) for kind, ms in waits.items()},
            }
        )
    return out


# -- against the measured grid ------------------------------------------------------------------


def correlation(row: dict[str, Any], measured: dict[str, Any] | None) -> float | None:
    """Pearson correlation of the per-request TTFTs with the measured row's (same request ids)."""
    if measured is None:
        return None
    ours, theirs = gr.request_records(row), gr.request_records(measured)
    ids = sorted(set(ours) & set(theirs))
    if len(ids) < 3:
        return None
    try:
        return statistics.correlation(
            [ours[i].ttft_ms for i in ids], [theirs[i].ttft_ms for i in ids]
        )
    except statistics.StatisticsError:  # constant TTFTs
        return None


def figures(row: dict[str, Any]) -> list[tuple[str, float, bool]]:
    """Issue 24's figures of a row: (name, value, higher is better)."""
    out = [(name, float(row["ttft_ms"][q]), higher) for name, q, higher in FIGURES]
    out.append(("tok/s", float(row["output_tokens_per_s"]), True))
    out.append(("cached", float(row["prompt_tokens_cached"]), True))
    return out


def against_native(row: dict[str, Any], native: dict[str, Any]) -> tuple[bool, list[str]]:
    """Whether ``row`` is at or above native on every figure (within 3% a tie), and each
    figure's ratio and verdict."""
    cells, ok = [], True
    for (name, ours, higher), (_n, theirs, _h) in zip(figures(row), figures(native), strict=True):
        verdict, ratio = gr.compare(ours, theirs, higher_is_better=higher)
        ok &= verdict.passes
        cells.append(f"{name} {ratio:.3f}x {verdict.value}")
    return ok, cells


HEAD = (
    f"{'config':34s} {'p50':>7s} {'p90':>7s} {'p99':>7s} {'mean':>7s} {'tok/s':>6s} "
    f"{'cached':>8s} {'sync ms':>8s} {'corr':>5s}"
)


def line(label: str, row: dict[str, Any], corr: float | None) -> str:
    t = row["ttft_ms"]
    mean = row.get("ttft_mean_ms")
    if mean is None:
        records = gr.request_records(row).values()
        mean = statistics.fmean(r.ttft_ms for r in records) if records else float("nan")
    sync = row.get("sync_load_wait_ms")
    return (
        f"{label:34s} {t['50']:7,.0f} {t['90']:7,.0f} {t['99']:7,.0f} {mean:7,.0f} "
        f"{row['output_tokens_per_s']:6.1f} {row['prompt_tokens_cached']:8,d} "
        f"{'' if sync is None else f'{sync:,.0f}':>8s} {'' if corr is None else f'{corr:.2f}':>5s}"
    )


def point_lines(key: str, rows: dict[str, dict[str, Any]], measured: dict[str, Any]) -> list[str]:
    out = [f"== {key}", HEAD]
    for label, row in rows.items():
        base = parse_config(label).measured_as
        out.append(line(label, row, correlation(row, measured.get(base))))
    for name in ("none", "native", "kvtier", "kvtier_fs"):
        if name in measured:
            out.append(line(f"  measured {name}", measured[name], None))
    native = rows.get("native")
    for label, row in rows.items():
        if native is not None and label.startswith("kvtier"):
            ok, cells = against_native(row, native)
            out.append(f"  {label} vs native: {'PASS' if ok else 'FAIL'}  " + ", ".join(cells))
    out += connector_lines(rows)
    return out


def connector_lines(rows: dict[str, dict[str, Any]]) -> list[str]:
    """Each connector's CPU time per step, and a kvtier row's ratio to native's."""
    out = []
    native = rows.get("native", {}).get("connector_step_cpu_us")
    for label, row in rows.items():
        cpu = row.get("connector_step_cpu_us")
        if cpu is None:
            continue
        p50, p99 = cpu["p50"], cpu["p99"]
        text = f"  {label} connector CPU per step p50 / p99: {p50:,.0f} / {p99:,.0f} us"
        if native is not None and label != "native":
            text += f" ({p50 / native['p50']:.2f}x / {p99 / native['p99']:.2f}x native)"
        out.append(text)
    return out


def load_measured(path: Path | None) -> dict[str, Any]:
    if path is None or not path.is_file():
        return {}
    points = json.loads(path.read_text()).get("points", {})
    return {key: point.get("configs", {}) for key, point in points.items()}


# -- command line -------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--points", default=DEFAULT_POINTS, help="CONCURRENCYxHOST_GIB,...")
    p.add_argument("--configs", default="none,native,kvtier")
    p.add_argument(
        "--requests",
        default=",".join(f"{c}:{n}" for c, n in grid.DEFAULT_REQUESTS.items()),
        help="requests per concurrency (others: 10 per conversation in flight)",
    )
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--context-blocks", type=int, default=40)
    p.add_argument("--widen", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--gpu-kv-gib", type=float, default=2.0)
    p.add_argument("--cost", default="", help="Cost fields, e.g. base_ms=7,load_gate=0")
    p.add_argument(
        "--hold",
        default="",
        help="EVERY:MS: every EVERY-th request sent, if a later turn, reaches vLLM MS later",
    )
    p.add_argument(
        "--fs",
        default="",
        help="kvtier_fs's fs tier speeds, FsTiming fields: read_ms=1,write_ms=4,threads=4",
    )
    p.add_argument("--fs-gib", type=float, default=rfs.DEFAULT_FS_GIB, help="its capacity")
    p.add_argument("--vllm-path", type=Path, default=None, help="an unpacked vLLM wheel")
    p.add_argument(
        "--warmup",
        action="store_true",
        help="the GPU benchmark's warm-up first; what it stores stays in the connectors",
    )
    p.add_argument(
        "--workdir", type=Path, default=None, help="the model's directory (default: a new one)"
    )
    p.add_argument("--measured", type=Path, default=MEASURED_JSON, help="the GPU grid's JSON")
    p.add_argument("--json", type=Path, default=None, help="write the rows here")
    return p


def settings_of(args: argparse.Namespace, workdir: Path) -> eng.Settings:
    return eng.Settings(
        turns=args.turns,
        context_blocks=args.context_blocks,
        widen=args.widen,
        max_tokens=args.max_tokens,
        max_model_len=args.max_model_len,
        gpu_kv_gib=args.gpu_kv_gib,
        workdir=workdir,
    )


def parse_hold(text: str) -> tuple[int, float] | None:
    """``--hold EVERY:MS`` (empty: None)."""
    if not text:
        return None
    every, sep, ms = text.partition(":")
    try:
        hold = (int(every), float(ms))
    except ValueError:
        hold = (0, 0.0)
    if not sep or hold[0] < 1 or hold[1] < 0:
        raise ValueError(f"--hold {text!r}: expected EVERY:MS, EVERY >= 1")
    return hold


def run_points(
    points: list[Point],
    specs: list[ConfigSpec],
    settings: eng.Settings,
    cost: replay.Cost,
    measured: dict[str, Any],
    hold: tuple[int, float] | None = None,
    fs: rfs.FsSetup | None = None,
    warmup: bool = False,
) -> dict[str, Any]:
    """Every configuration at every point; prints each point's table as it ends."""
    out: dict[str, Any] = {}
    for point in points:
        rows: dict[str, dict[str, Any]] = {}
        summary: dict[str, Any] = {}
        for spec in specs:
            rows[spec.label], summary = run_config(
                point, spec, settings, cost, settings.workdir, hold, fs, warmup
            )
            took = rows[spec.label]["replay_s"]
            print(f"  {point.key} {spec.label}: {took} s", file=sys.stderr)
        out[point.key] = {"workload": summary, "configs": rows}
        print("\n".join(point_lines(point.key, rows, measured.get(point.key, {}))), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    try:
        specs = [parse_config(c) for c in args.configs.split(",") if c.strip()]
        table = grid.parse_requests(args.requests)
        points = [
            Point(g.key, g.concurrency, g.host_gib, grid.requests_for(g.concurrency, table))
            for g in grid.parse_points(args.points)
        ]
        cost = replay.parse_cost(args.cost)
        hold = parse_hold(args.hold)
        fs = rfs.FsSetup(rfs.parse_timing(args.fs), args.fs_gib)
        version = rv.use_vllm(args.vllm_path)
    except (ValueError, RuntimeError) as exc:
        p.error(str(exc))
    out: dict[str, Any] = {
        "vllm": version,
        "cost": args.cost or "default",
        "hold": args.hold or None,
        "fs": fs.describe(),
        "warmup": args.warmup,
        "date": grid.now_utc(),
        "commit": grid.git_commit(REPO),
    }
    with tempfile.TemporaryDirectory(prefix="kvtier-replay-") as tmp:
        workdir = Path(tmp)
        if args.workdir is not None:
            # kvtier's block keys follow the model's path: the same directory, the same keys,
            # and (with the fixed hash seed) the same decisions from run to run.
            args.workdir.mkdir(parents=True, exist_ok=True)
            workdir = args.workdir
        settings = settings_of(args, workdir)
        measured = load_measured(args.measured)
        out["points"] = run_points(points, specs, settings, cost, measured, hold, fs, args.warmup)
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


HASH_SEED = "0"
"""Python's hash seed for the replay, so that a set iterated in hash order anywhere (vLLM's
scheduler, a connector) cannot make two runs differ. Seeds 0, 1 and 2 gave the same table for
kvtier + fs at eight points (2026-11-28): the replay's schedule follows the decisions alone, and
a variant's table differs from another's by the decisions it changes and the schedule those
reorder."""


def fixed_hash_seed() -> None:
    """Run again with ``PYTHONHASHSEED`` = ``HASH_SEED`` unless it is set so."""
    if os.environ.get("PYTHONHASHSEED") != HASH_SEED:
        os.environ["PYTHONHASHSEED"] = HASH_SEED
        os.execv(sys.executable, [sys.executable, *sys.argv])


if __name__ == "__main__":
    fixed_hash_seed()
    sys.exit(main())
