"""The ``kvtier`` command line.

    kvtier simulate [--trace FILE] [--config FILE] [--pool-blocks N | --pool-size SIZE] ...
    kvtier check-config FILE
    kvtier stats FILE
    kvtier --version

Options given on the command line override the config file (or the embedded default); the merged
mapping is validated like any config, so a bad option gets the same field-named error.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kvtier.cli_metrics import add_metrics_arguments, replay_metrics
from kvtier.config import (
    KVTierConfig,
    bundled_config_mapping,
    parse_config,
    read_config_file,
)
from kvtier.copy.options import CopyConfig
from kvtier.errors import ConfigError, KVTierError
from kvtier.redaction import printable, redact_text, yaml_problem
from kvtier.registry import PLUGIN_FORM, POLICIES, TIERS, is_plugin_path
from kvtier.sim.conversations import trace_requests
from kvtier.sim.optimal import OPTIMAL_POLICY, format_optimal, optimal_hit_ratio
from kvtier.sim.replay import ReplayResult, TierResult
from kvtier.sim.simulate import DEFAULT_PAYLOAD_BYTES, simulate
from kvtier.sim.trace import bundled_trace_path
from kvtier.stats_report import format_snapshot, read_snapshot
from kvtier.validation import format_size, parse_size, written_size

EXIT_OK = 0
EXIT_MISMATCH = 1
"""The replay loaded a payload that differs from what was stored for its key."""
EXIT_USAGE = 2


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except (KVTierError, ValueError) as exc:
        # ConfigError, PoolError, TraceError: a message, never a traceback; one line, redacted
        # (kvtier.redaction: no password, no control character reaches the terminal).
        print("kvtier: error: " + redact_text(" ".join(str(exc).split())), file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # stdout closed early (`kvtier simulate | head`): not an error worth a traceback.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier", description="kvtier: a multi-tier KV cache for LLM inference engines."
    )
    parser.add_argument("--version", action="version", version=f"kvtier {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_simulate(commands)
    _add_check_config(commands)
    _add_stats(commands)
    return parser


_Commands = argparse._SubParsersAction  # the type add_subparsers returns (no public name)


def _add_simulate(commands: _Commands[argparse.ArgumentParser]) -> None:
    sim = commands.add_parser(
        "simulate",
        help="replay a Mooncake-format trace through the real cache manager",
        description=(
            "Replay a Mooncake-format trace (one JSON object per line with hash_ids of 512-token "
            "blocks) through the real TieredCache: per request, look up its blocks, load the "
            "leading hits (verifying every payload), then store all its blocks."
        ),
    )
    sim.add_argument(
        "--trace", type=Path, default=None, help="trace file (default: the bundled synthetic one)"
    )
    _add_cache_arguments(sim)
    _add_run_arguments(sim)
    sim.set_defaults(func=cmd_simulate)


def _add_cache_arguments(sim: argparse.ArgumentParser) -> None:
    """simulate's options that say what cache to build (config, pool, policy, tiers)."""
    sim.add_argument(
        "--config", type=Path, default=None, help="JSON or YAML config (default: embedded)"
    )
    size = sim.add_mutually_exclusive_group()
    size.add_argument(
        "--pool-blocks", type=_positive_int, default=None, metavar="N", help="pool capacity"
    )
    size.add_argument(
        "--pool-size",
        default=None,
        metavar="SIZE",
        help="pool capacity in bytes of block.bytes each, e.g. 250GiB (default: pool.size)",
    )
    sim.add_argument(
        "--policy",
        type=_policy_name,
        default=None,
        metavar="{" + ",".join([*POLICIES.names(), OPTIMAL_POLICY]) + "}",
        help=f"eviction policy (or {PLUGIN_FORM}); "
        f"{OPTIMAL_POLICY}: the offline optimum of the pool alone (a bound)",
    )
    sim.add_argument(
        "--admission",
        type=_positive_int,
        default=None,
        metavar="N",
        help="store a block only once seen N times (1: always)",
    )
    sim.add_argument(
        "--tier",
        action="append",
        default=None,
        metavar="SPEC",
        help=(
            "secondary tier, repeatable, fastest first; replaces the config's tiers: "
            "memory:CAPACITY, fs:PATH:CAPACITY, redis:URL, or KIND:key=value,key=value "
            f"(KIND: {', '.join(TIERS.names())} or {PLUGIN_FORM})"
        ),
    )
    sim.add_argument(
        "--write",
        choices=["through", "on_evict"],
        default=None,
        help="when blocks are copied to the secondary tiers (all of them)",
    )
    sim.add_argument(
        "--payload-bytes",
        type=_positive_int,
        default=DEFAULT_PAYLOAD_BYTES,
        metavar="N",
        help=f"real bytes per simulated block (default {DEFAULT_PAYLOAD_BYTES})",
    )


def _add_run_arguments(sim: argparse.ArgumentParser) -> None:
    """simulate's options that say how to replay and what to report."""
    sim.add_argument(
        "--overlap",
        action="store_true",
        help=(
            "start each request at once instead of letting tier jobs finish first (results then "
            "depend on tier speed)"
        ),
    )
    sim.add_argument("--limit", type=_positive_int, default=None, metavar="N", help="requests")
    sim.add_argument(
        "--concurrency",
        type=_positive_int,
        default=None,
        metavar="N",
        help="replay with N conversations in flight (requests sharing their first block), each "
        "turn after the conversation's previous one, round robin; the optimum and --sweep see "
        "the same order (default: trace order)",
    )
    sim.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    sim.add_argument(
        "--sweep",
        default=None,
        metavar="SIZES",
        help="replay at several pool sizes (blocks, comma-separated, or 'auto': 8 sizes up to the "
        "trace's distinct blocks) next to the offline optimum and the ceiling",
    )
    sim.add_argument(
        "--sweep-tier",
        default="",
        metavar="NAME",
        help="sweep this tier's capacity (blocks) instead of the pool, the pool at --pool-blocks",
    )
    sim.add_argument(
        "--sweep-json", type=Path, default=None, metavar="FILE", help="the sweep as JSON"
    )
    sim.add_argument(
        "--sweep-png",
        type=Path,
        default=None,
        metavar="FILE",
        help="the sweep as a plot (needs kvtier[plot])",
    )
    add_metrics_arguments(sim)
    sim.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _add_check_config(commands: _Commands[argparse.ArgumentParser]) -> None:
    check = commands.add_parser("check-config", help="validate a config file and print it")
    check.add_argument("config", type=Path)
    check.add_argument(
        "--simulate",
        action="store_true",
        help="check it as kvtier simulate --config uses it: the pool in blocks of block.bytes "
        "(at least one), none of pool.size allocated in pool.shm_dir",
    )
    check.set_defaults(func=cmd_check_config)


def _add_stats(commands: _Commands[argparse.ArgumentParser]) -> None:
    stats = commands.add_parser(
        "stats", help="print a stats snapshot (the vLLM connector's vllm.stats_path file)"
    )
    stats.add_argument("file", type=Path)
    stats.set_defaults(func=cmd_stats)


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvtier")
    except PackageNotFoundError:  # run from a checkout without installing
        return "(not installed)"


def cmd_stats(args: argparse.Namespace) -> int:
    print(printable(format_snapshot(read_snapshot(args.file)), keep_newlines=True))
    return EXIT_OK


def _policy_name(text: str) -> str:
    """A ``--policy`` value: a registered policy, the offline optimum or a plugin class path
    (imported when the config is validated, which names the field if it does not load)."""
    if text == OPTIMAL_POLICY or text in POLICIES or is_plugin_path(text):
        return text
    known = ", ".join(repr(name) for name in [*POLICIES.names(), OPTIMAL_POLICY])
    raise argparse.ArgumentTypeError(
        f"invalid choice: {text!r} (choose from {known} or {PLUGIN_FORM})"
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {value}")
    return value


# -- simulate ---------------------------------------------------------------------------------


def cmd_simulate(args: argparse.Namespace) -> int:
    raw = read_config_file(args.config) if args.config else bundled_config_mapping()
    config = parse_config(apply_overrides(raw, args))
    owned_sections(config)  # a file a run refuses is not simulated
    if args.sweep is not None:
        return cmd_sweep(config, args)
    pool_blocks = simulate_pool_blocks(config, args.pool_blocks, args.pool_size)
    trace = args.trace if args.trace is not None else bundled_trace_path()
    if args.policy == OPTIMAL_POLICY:
        # Offline: no cache is built, the trace's future decides (a bound, not a policy).
        bound = optimal_hit_ratio(trace_requests(trace, args.limit, args.concurrency), pool_blocks)
        print(format_optimal(bound, Path(trace).name, args.concurrency))
        return EXIT_OK
    metrics = replay_metrics(args) if args.metrics_port is not None else None
    result = simulate(
        config,
        trace,
        pool_blocks=pool_blocks,
        payload_bytes=args.payload_bytes,
        limit=args.limit,
        concurrency=args.concurrency,
        overlap=args.overlap,
        progress=not args.no_progress,
        on_request=metrics.after_request if metrics is not None else None,
    )
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_result(result))
    if metrics is not None:
        sys.stdout.flush()
        metrics.hold(args.metrics_hold)
    return EXIT_MISMATCH if result.mismatched_blocks else EXIT_OK


def cmd_sweep(config: KVTierConfig, args: argparse.Namespace) -> int:
    from kvtier.sim import sweep

    sizes = sweep.parse_sizes(args.sweep)
    if args.sweep_png is not None:
        sweep.plotting()  # before the replays: a missing matplotlib fails in a second, not after
    trace = args.trace if args.trace is not None else bundled_trace_path()
    result = sweep.sweep(
        config,
        trace,
        sizes,
        payload_bytes=args.payload_bytes,
        limit=args.limit,
        progress=not args.no_progress,
        tier=args.sweep_tier,
        pool_blocks=simulate_pool_blocks(config, args.pool_blocks, args.pool_size),
        concurrency=args.concurrency,
    )
    print(sweep.format_sweep(result))
    for label, path, write in (
        ("json", args.sweep_json, sweep.write_json),
        ("plot", args.sweep_png, sweep.write_png),
    ):
        if path is None:
            continue
        try:
            write(result, path)
        except OSError as exc:  # a directory that is missing or not writable: one line
            raise KVTierError(f"cannot write {path}: {exc.strerror or exc}") from None
        print(f"{label:<12}{path}")
    return EXIT_OK


def apply_overrides(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The config mapping with the command line's choices merged in (not yet validated)."""
    data = copy.deepcopy(raw)
    if args.policy is not None and args.policy != OPTIMAL_POLICY:
        data["eviction"] = args.policy
    if args.admission is not None:
        admission = data.get("admission")
        data["admission"] = {**(admission if isinstance(admission, dict) else {})}
        data["admission"]["min_seen"] = args.admission
    if args.tier is not None:
        data["tiers"] = [parse_tier_spec(spec) for spec in args.tier]
    if args.write is not None:
        tiers = data.get("tiers")
        if isinstance(tiers, list):
            data["tiers"] = [
                {**tier, "write": args.write} if isinstance(tier, dict) else tier for tier in tiers
            ]
    return data


def parse_tier_spec(spec: str) -> dict[str, Any]:
    """``memory:CAPACITY``, ``fs:PATH:CAPACITY``, ``redis:URL`` or ``KIND:key=value,...``."""
    kind, sep, rest = spec.partition(":")
    if kind not in TIERS and "." in kind:
        # A plugin, package.module:Class[:key=value,...]: the class name is part of the kind.
        name, sep, rest = rest.partition(":")
        kind = f"{kind}:{name}"
    if not kind:
        raise ConfigError("--tier", spec, "KIND:OPTIONS, e.g. memory:1GiB or fs:/tmp/kv:10GiB")
    entry: dict[str, Any] = {"kind": kind}
    if not sep or not rest:
        return entry
    if "=" in rest and not rest.startswith(("redis://", "rediss://", "unix://", "/")):
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key.strip():
                raise ConfigError("--tier", spec, "key=value pairs separated by commas")
            entry[key.strip()] = _spec_value(spec, key.strip(), value)
        return entry
    if kind in ("memory", "fs") and "://" in rest:
        # A URL (maybe with a password) is not a path or a size: refused whole, so the error
        # shows the redacted spec rather than a piece of the URL as a capacity.
        raise ConfigError("--tier", spec, f"{kind}:... takes no URL (redis:URL does)")
    if kind == "memory":
        entry["capacity"] = rest
    elif kind == "fs":
        path, sep2, capacity = rest.rpartition(":")
        if not sep2 or not path:
            raise ConfigError("--tier", spec, "fs:PATH:CAPACITY, e.g. fs:/tmp/kvtier:10GiB")
        entry["path"] = path
        entry["capacity"] = capacity
    elif kind == "redis":
        entry["url"] = rest
    else:
        raise ConfigError(
            "--tier", spec, f"KIND:key=value,... for a tier of kind {kind!r} ({TIERS.allowed()})"
        )
    return entry


def _spec_value(spec: str, key: str, text: str) -> Any:
    """A ``--tier`` value read as YAML (``fsync=true``, ``latency_ms=2.5``); text YAML refuses
    (``capacity=[``) is an error naming the option, not a traceback."""
    if not text.strip():
        return ""
    try:
        return yaml.safe_load(text)
    except (yaml.YAMLError, ValueError, RecursionError) as exc:
        # ValueError: an integer of more than 4,300 digits.
        if isinstance(exc, RecursionError):
            reason = "nested too deeply"
        elif isinstance(exc, yaml.YAMLError):
            reason = yaml_problem(exc)  # not str(exc): it quotes the text (a password's, too)
        else:
            reason = " ".join(str(exc).split())
        raise ConfigError("--tier", spec, f"a YAML value for {key} ({reason})") from exc


def simulate_pool_blocks(config: KVTierConfig, blocks: int | None, size: str | None) -> int:
    """Pool capacity in blocks: ``--pool-blocks``, else ``--pool-size`` or ``pool.size`` divided
    by ``block.bytes``."""
    if blocks is not None:
        return blocks
    field = "--pool-size" if size is not None else "pool.size"
    total = parse_size(size, field) if size is not None else config.pool.size
    n = total // config.block.bytes
    if n < 1:
        raise ConfigError(
            field,
            size or config.pool.size,
            f"at least one block of {format_size(config.block.bytes)}",
        )
    return n


def _tier_label(t: TierResult) -> str:
    size = "" if t.capacity_blocks is None else f", {t.capacity_blocks} blocks"
    return f"{t.kind}, {t.write}{size}"


def format_result(r: ReplayResult) -> str:
    secondary = [t for t in r.tiers if t.name != "pool"]
    lines = [
        f"trace       {r.trace}: {r.requests} requests, {r.blocks} blocks"
        + (f", {r.concurrency} conversations in flight" if r.concurrency else ""),
        f"pool        {r.pool_blocks} blocks of {format_size(r.block_bytes)} "
        f"({format_size(r.pool_blocks * r.block_bytes)}; {r.payload_bytes} B real payload each), "
        f"policy {r.policy}, admission "
        + (f"after {r.admission_min_seen} offers" if r.admission_min_seen > 1 else "off")
        + (", requests overlap tier jobs" if r.overlap else ""),
        "tiers       "
        + " -> ".join(["pool", *(f"{t.name} ({_tier_label(t)})" for t in secondary)]),
        "units       pool and tier capacities in blocks of block.bytes",
        "",
        f"{'tier':<12}{'hit blocks':>12}{'hit ratio':>11}{'evictions':>11}"
        f"{'read':>12}{'written':>12}{'errors':>8}{'corrupt':>9}",
    ]
    for t in r.tiers:
        lines.append(
            f"{t.name:<12}{t.hit_blocks:>12}{t.hit_ratio:>11.4f}{t.evictions:>11}"
            f"{format_size(t.read_bytes):>12}{format_size(t.written_bytes):>12}"
            f"{t.errors + t.timeouts:>8}{t.corrupt:>9}"
        )
    lines += [
        f"{'all':<12}{r.hit_blocks:>12}{r.hit_ratio:>11.4f}",
        "",
        f"hit ratio   {r.hit_ratio:.4f} ({r.hit_blocks} of {r.blocks} blocks)",
        f"stored      {r.stored_blocks} blocks",
        f"checks      {r.mismatched_blocks} mismatched payloads, {r.failed_loads} failed loads, "
        f"{r.pending_timeouts} pending timeouts, {r.drain_timeouts} drain timeouts",
        f"manager     {r.manager_ops} operations in {r.elapsed_s:.2f} s: "
        f"{r.ops_per_s:,.0f} ops/s, {r.blocks_per_s:,.0f} looked-up blocks/s "
        f"(inside the manager {r.manager_s:.2f} s: {r.manager_ops_per_s:,.0f} ops/s)",
        f"machine     {r.machine}",
    ]
    return printable("\n".join(lines), keep_newlines=True)


# -- check-config -----------------------------------------------------------------------------


def cmd_check_config(args: argparse.Namespace) -> int:
    from kvtier.capacity import capacity_warnings

    config = parse_config(read_config_file(args.config))
    copy_section = owned_sections(config)  # each owner's section, as a run parses it
    # Errors before "valid": simulate's "at least one block", a path no filesystem takes.
    blocks = simulate_pool_blocks(config, None, None) if args.simulate else 0
    warnings = capacity_warnings(config, pool=not args.simulate)
    print(f"{printable(str(args.config))}: valid")
    print(describe_config(config, copy_section))
    print(describe_vllm(config))
    if args.simulate:
        print(
            f"simulate: a pool of {blocks} blocks of {written_size(config.block.bytes)} "
            "(none of pool.size allocated: each block holds --payload-bytes of real payload)"
        )
    if not args.simulate and config.pool.size < config.block.bytes:
        print(f"warning: {pool_block_warning(config)}")
    for warning in warnings:
        print(f"warning: {printable(warning)}")
    if any(w.startswith("pool.size ") for w in warnings):
        print(
            "         (an engine's pool claims pool.size at start; kvtier simulate does not: "
            "check-config --simulate)"
        )
    return EXIT_OK


def pool_block_warning(config: KVTierConfig) -> str:
    """For a ``pool.size`` under one block of ``block.bytes``: an engine sizes its blocks from its
    model (``block.bytes`` is not its block size), so the plain check cannot refuse it, only say
    who will (``check-config --simulate`` refuses it, as ``kvtier simulate`` does)."""
    return (
        f"pool.size {written_size(config.pool.size)} holds no block of block.bytes "
        f"({written_size(config.block.bytes)}): kvtier simulate and check-config --simulate "
        "refuse it; an engine's blocks are its model's size (vLLM: block_size x "
        "vllm.blocks_per_slot tokens), and it refuses a pool under one block at start"
    )


def owned_sections(config: KVTierConfig) -> CopyConfig:
    """Parse the sections the core config keeps as given, each by its owner, so that a typo there
    fails ``check-config`` as it would fail a run: ``copy`` (the copy backends) and ``vllm`` (the
    vLLM connector). Returns the ``copy`` section; ``ConfigError`` naming the field."""
    from kvtier.integrations.vllm.settings import VllmSettings

    copy_section = CopyConfig.parse_mapping(config.copy)
    VllmSettings.parse(config.vllm, tiered=bool(config.tiers))
    return copy_section


def describe_config(config: KVTierConfig, copy_section: CopyConfig | None = None) -> str:
    copy_section = copy_section or CopyConfig.parse_mapping(config.copy)
    lines = [
        f"model {config.model or '(from the engine)'}, tenant {config.tenant}",
        f"pool {written_size(config.pool.size)} in {config.pool.shm_dir}"
        + (", pageable allowed" if config.pool.allow_pageable else ""),
        f"block {config.block.tokens} tokens, {written_size(config.block.bytes)}",
        f"eviction {config.eviction}, admission "
        + (f"after {config.admission.min_seen} offers" if config.admission.enabled else "off"),
    ]
    for t in config.tiers:
        # The rule masks any URL password, in a built-in tier's options or a plugin's repr.
        options = describe_options(t.options)
        lines.append(redact_text(f"tier {t.name}: {t.kind}, write {t.write.value}"))
        lines.append(redact_text(f"  {options}"))
    lines.append(
        f"job_timeout_s {config.job_timeout_s:g}, events {'on' if config.events else 'off'}, "
        f"copy {copy_section.strategy.value}"
        + (f" (max {copy_section.max_sms} SMs)" if copy_section.max_sms else "")
    )
    return printable("\n".join(lines), keep_newlines=True)  # paths and names may hold escapes


def describe_vllm(config: KVTierConfig) -> str:
    """The vLLM connector's loads as it will run them: ``vllm.async_loads``, or its default
    (which depends on the tiers: ``settings.default_load_mode``)."""
    from kvtier.integrations.vllm.settings import VllmSettings

    tiered = bool(config.tiers)
    mode = VllmSettings.parse(config.vllm, tiered=tiered).planner.load_mode.value
    given = "async_loads" in config.vllm
    why = "as given" if given else f"the default {'with' if tiered else 'without'} tiers"
    return f"vllm loads {mode} ({why})"


def describe_options(options: object) -> str:
    """A tier's options as a config writes them: ``capacity 2TB (1.8 TiB), file_mode 0o600``.
    By name, as the built-in tiers call them: ``capacity``, ``min_free`` and ``*_bytes`` are
    sizes, ``*_mode`` permission bits. Fields hidden from the repr (a password) and
    ``config_path`` (where the options came from) are left out; options that are no dataclass
    (a plugin's) are shown as their repr."""
    if not dataclasses.is_dataclass(options) or isinstance(options, type):
        return repr(options)
    shown = []
    for f in dataclasses.fields(options):
        if f.repr and f.name != "config_path":
            shown.append(f"{f.name} {_option_text(f.name, getattr(options, f.name))}")
    return ", ".join(shown)


def _option_text(name: str, value: object) -> str:
    if value is None or isinstance(value, bool):
        return {None: "none", True: "true", False: "false"}[value]
    if isinstance(value, int) and (name in ("capacity", "min_free") or name.endswith("_bytes")):
        return written_size(value)
    if isinstance(value, int) and name.endswith("_mode"):
        return f"0o{value:o}"
    return f"{value:g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    sys.exit(main())
