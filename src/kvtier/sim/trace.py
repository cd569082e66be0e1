"""Mooncake-format request traces: one JSON object per line with ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids`` (prefix-aware ids of the prompt's 512-token
blocks: equal ids mean equal prefixes).

Every malformed line, whatever it holds (bytes that are not UTF-8, JSON nested 100,000 deep,
5,000-digit numbers, NaN, a line over ``TRACE_LINE_MAX_BYTES``), is a ``TraceError`` naming the
file and line. The file is read through :mod:`kvtier.safe_files`: a FIFO, a device or a symbolic
link is refused, never waited on.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvtier.errors import KVTierError, shown
from kvtier.safe_files import LineTooLong, iter_lines
from kvtier.validation import INT64_MAX, finite_float

BUNDLED_TRACE = "synthetic_trace.jsonl"
TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in Mooncake traces."""
HASH_ID_MIN = -(2**127)
HASH_ID_MAX = 2**127 - 1
"""``hash_ids`` become keys as 16-byte signed integers (``keys_from_hashes``)."""
TRACE_LINE_MAX_BYTES = 16 * 2**20
"""Longest trace line read (and recorded): 16 MiB is some 700,000 block ids, a 1 GiB line would
be a ``MemoryError`` on most machines."""


class TraceError(KVTierError):
    """A trace file is missing or has a malformed line (the message names file and line)."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def bundled_trace_path() -> Path:
    """Path of the synthetic trace shipped in the package (3,993 requests)."""
    return Path(str(resources.files("kvtier.data").joinpath(BUNDLED_TRACE)))


def read_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """All requests of a trace (the first ``limit`` when given)."""
    return list(iter_trace(path, limit))


def iter_trace(path: str | Path, limit: int | None = None) -> Iterator[TraceRequest]:
    path = Path(path)
    # Bytes, decoded line by line: a decoding error then names its line.
    lines = iter_lines(path, TRACE_LINE_MAX_BYTES)
    count = 0
    try:
        for lineno, raw in enumerate(lines, 1):
            if limit is not None and count >= limit:
                return
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise TraceError(f"{where}: not UTF-8 (byte {exc.start + 1} of the line)") from exc
            if not line.strip():
                continue
            yield parse_request(line, where)
            count += 1
            if count == limit:  # not a line more is read
                return
    except LineTooLong as exc:
        most = f"{TRACE_LINE_MAX_BYTES // 2**20} MiB"
        raise TraceError(f"{path}:{exc.lineno}: a line longer than {most}") from exc
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the path
        what = getattr(exc, "strerror", None) or exc
        raise TraceError(f"cannot read trace {path}: {what}") from exc
    finally:
        lines.close()


def parse_request(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from exc
    except RecursionError as exc:
        raise TraceError(f"{where}: not valid JSON (nested too deeply)") from exc
    except ValueError as exc:  # an integer of more digits than Python converts (4,300)
        raise TraceError(f"{where}: not valid JSON (a number of too many digits)") from exc
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object per line")
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and HASH_ID_MIN <= h <= HASH_ID_MAX
        for h in hash_ids
    ):
        raise TraceError(
            f"{where}: hash_ids must be a list of 128-bit signed integers, got {shown(hash_ids)}"
        )
    timestamp = finite_float(obj.get("timestamp", 0))
    if timestamp is None:
        raise TraceError(
            f"{where}: timestamp must be a finite number, got {shown(obj.get('timestamp'))}"
        )
    input_length = obj.get("input_length", len(hash_ids) * TRACE_BLOCK_TOKENS)
    output_length = obj.get("output_length", 0)
    for name, value in (("input_length", input_length), ("output_length", output_length)):
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT64_MAX:
            raise TraceError(
                f"{where}: {name} must be a non-negative 64-bit integer, got {shown(value)}"
            )
    return TraceRequest(timestamp, input_length, output_length, tuple(hash_ids))
