"""A stats snapshot (the vLLM connector's ``vllm.stats_path`` file) as a short text report."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvtier.errors import KVTierError, shown
from kvtier.safe_files import read_text
from kvtier.validation import INT64_MAX, INT64_MIN, format_size

STATS_MAX_BYTES = 16 * 2**20
"""Largest stats file written or read (a snapshot of a few tiers is a few KiB)."""


class StatsFileError(KVTierError):
    """The file is missing, not JSON, or not a kvtier stats snapshot."""


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a snapshot holds")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400
        raise ValueError(f"{shown(text)} is beyond a float")
    return value


def read_snapshot(path: Path) -> dict[str, Any]:
    """The snapshot in ``path`` (read through ``kvtier.safe_files``: a regular file of at most
    ``STATS_MAX_BYTES``). Anything else is one ``StatsFileError`` line."""
    try:
        text = read_text(path, STATS_MAX_BYTES)
    except FileNotFoundError:
        raise StatsFileError(f"{path}: no such file") from None
    except OSError as exc:
        raise StatsFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise StatsFileError(f"{path}: not a JSON stats snapshot ({exc.reason})") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite)
    except json.JSONDecodeError as exc:
        raise StatsFileError(f"{path}: not a JSON stats snapshot ({exc})") from None
    except RecursionError:
        raise StatsFileError(f"{path}: not a JSON stats snapshot (nested too deeply)") from None
    except ValueError as exc:  # a refused constant or float, or an int of over 4,300 digits
        raise StatsFileError(f"{path}: not a JSON stats snapshot ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("cache"), dict):
        raise StatsFileError(f"{path}: not a kvtier stats snapshot (no 'cache' section)")
    return data


def _int(section: dict[str, Any], key: str) -> int:
    """A count of the snapshot, 0 where it holds anything but a 64-bit number."""
    value = section.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0
    return int(value) if INT64_MIN <= value <= INT64_MAX else 0


def _name(value: object) -> str:
    """A name or value from the file as printable text (no terminal escapes), cut short."""
    if isinstance(value, str) and value.isprintable() and len(value) <= 64:
        return value
    return shown(value)


def _ratio(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def format_snapshot(data: dict[str, Any]) -> str:
    cache: dict[str, Any] = data["cache"]
    looked = _int(cache, "lookup_blocks")
    hits = _int(cache, "hit_blocks")
    promoted = _int(cache, "promoted_blocks")
    lines = [
        f"pool      {_int(data, 'pool_used')} of {_int(data, 'pool_slots')} slots used, "
        f"{_int(data, 'pool_pinned')} pinned; {_int(cache, 'pool_evictions')} evictions",
        f"lookups   {_int(cache, 'lookups')} ({looked} blocks): {hits} hit "
        f"({_ratio(hits, looked)}), {hits - promoted} from the pool, {promoted} promoted "
        f"from tiers; {_int(cache, 'pending_lookups')} answered pending",
        f"loads     {_int(cache, 'loaded_blocks')} blocks copied to the engine, "
        f"{_int(cache, 'load_failed')} failed",
        f"stores    {_int(cache, 'stored_blocks')} blocks; skipped: "
        f"{_int(cache, 'store_skipped_present')} present, "
        f"{_int(cache, 'store_skipped_admission')} admission, "
        f"{_int(cache, 'store_skipped_full')} pool full; {_int(cache, 'store_failed')} failed",
    ]
    rate = _int(data, "prefill_tokens_per_s")
    if rate > 0:
        line = f"costs     a tier read must beat a request's prefill, {rate:,} tokens/s"
        reads = data.get("read_tokens_per_s")
        if isinstance(reads, dict):
            measured = [(name, _int(reads, name)) for name in reads]
            line += "".join(f"; {_name(n)} reads {r:,} tokens/s" for n, r in measured if r > 0)
        lines.append(line)
    tiers = data.get("tiers")
    if isinstance(tiers, dict) and tiers:
        lines.append(
            f"{'tier':<10} {'lookups':>9} {'hits':>7} {'read':>10} {'written':>10} "
            f"{'evictions':>9} {'errors':>6} {'corrupt':>7} {'timeouts':>8}"
        )
        for name, tier in tiers.items():
            if not isinstance(tier, dict):
                continue
            lines.append(
                f"{_name(name):<10} {_int(tier, 'lookups'):>9} {_int(tier, 'lookup_hits'):>7} "
                f"{format_size(_int(tier, 'read_bytes')):>10} "
                f"{format_size(_int(tier, 'write_bytes')):>10} {_int(tier, 'evictions'):>9} "
                f"{_int(tier, 'errors'):>6} {_int(tier, 'corrupt'):>7} {_int(tier, 'timeouts'):>8}"
            )
    connector = data.get("connector")
    if isinstance(connector, dict):
        lines.append(
            "connector "
            + ", ".join(
                f"{_name(key)} {_name(value)}"
                for key, value in connector.items()
                if value or key == "hit_tokens"
            )
        )
    lines.append(
        f"in flight {_int(data, 'jobs_in_flight')} copy jobs, {_int(data, 'pinned_plans')} plans "
        "waiting for vLLM's allocation"
    )
    return "\n".join(lines)
