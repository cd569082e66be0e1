"""Mooncake-format request traces: one JSON object per line with ``timestamp`` (ms),
``input_length``, ``output_length`` and ``hash_ids`` (prefix-aware ids of the prompt's 512-token
blocks: equal ids mean equal prefixes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kvtier.errors import KVTierError

BUNDLED_TRACE = "synthetic_trace.jsonl"
TRACE_BLOCK_TOKENS = 512
"""Tokens per ``hash_ids`` block in Mooncake traces."""


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
    try:
        handle = path.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from exc
    count = 0
    with handle:
        for lineno, line in enumerate(handle, 1):
            if limit is not None and count >= limit:
                return
            if not line.strip():
                continue
            yield parse_request(line, f"{path}:{lineno}")
            count += 1


def parse_request(line: str, where: str) -> TraceRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg})") from exc
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object per line")
    hash_ids = obj.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise TraceError(f"{where}: hash_ids must be a list of integers, got {hash_ids!r:.80}")
    timestamp = obj.get("timestamp", 0)
    input_length = obj.get("input_length", len(hash_ids) * TRACE_BLOCK_TOKENS)
    output_length = obj.get("output_length", 0)
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool):
        raise TraceError(f"{where}: timestamp must be a number, got {timestamp!r}")
    for name, value in (("input_length", input_length), ("output_length", output_length)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TraceError(f"{where}: {name} must be a non-negative integer, got {value!r}")
    return TraceRequest(float(timestamp), input_length, output_length, tuple(hash_ids))
