"""Configuration labels with kvtier settings on top, shared by the scheduler replay
(``scheduler_replay.py``) and the GPU benchmark (``vllm_gpu_bench.py``).

A label is a base configuration followed by ``+key=value`` overrides of kvtier's connector
config dict: ``kvtier_fs+tiers.0.write=on_evict+pool.writeback_window=0.5``. A key is a dotted
path into that dict (a number picks a list's item); a value is read as JSON where it is JSON
(``0.5``, ``true``, ``null``), else kept as the text. Only kvtier bases take overrides: vLLM's own
configurations have no kvtier config to set. The base decides everything else about a variant
(its fs tier, its engine, what it is compared with), so two variants of one base measured in one
run differ only by the keys they set.

Keys under ``beside.`` are not kvtier's: they say what the GPU benchmark runs beside the engine
or how it runs it (``BESIDE_KEYS``; ``kvtier+beside.write_mbps=1000``: another process writing
files at 1000 MB/s, ``disk_writer.py``; ``beside.switch_interval_ms``: the interpreter's switch
interval in the engine's process), so every base takes them, they are kept apart
(``ConfigSpec.beside``) and ``apply_overrides`` never hands them to kvtier. The scheduler replay
refuses them: it runs no engine for anything to run beside.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

KVTIER_PREFIX = "kvtier"
"""Bases whose name starts so run kvtier, and only those take overrides."""
BESIDE_PREFIX = "beside."
"""Keys so named are the benchmark's, not kvtier's: every base takes them."""
WRITE_MBPS = "beside.write_mbps"
WRITE_FSYNC = "beside.write_fsync"
WRITE_SOURCE_MIB = "beside.write_source_mib"
WRITE_CHECKSUM = "beside.write_checksum"
SWITCH_INTERVAL_MS = "beside.switch_interval_ms"
BESIDE_KEYS = {
    WRITE_MBPS: "a number of MB/s above 0",
    WRITE_FSYNC: f"true or false, with {WRITE_MBPS}",
    WRITE_SOURCE_MIB: f"a whole number of MiB of at least 2, with {WRITE_MBPS}",
    WRITE_CHECKSUM: f"true or false, with {WRITE_MBPS}",
    SWITCH_INTERVAL_MS: "a number of milliseconds above 0",
}
"""The ``beside.`` keys and the values each takes: a process beside the engine writes files at
``write_mbps`` (``disk_writer.py``), with ``write_fsync`` syncs each before renaming it, with
``write_source_mib`` takes its blocks in turn from a buffer that large and with
``write_checksum`` hashes each first (the memory the fs tier reads: its pool slots, its hash);
``switch_interval_ms`` is ``sys.setswitchinterval`` in the engine's process for the timed run
(Python's default 5 ms: how long a thread waiting for the interpreter's lock lets the running
one keep it before asking it to let go)."""


@dataclass(frozen=True, slots=True)
class ConfigSpec:
    """``kvtier+vllm.async_loads=true``: a connector and kvtier config keys set on top."""

    label: str
    kind: str
    """The base configuration."""
    overrides: dict[str, Any]
    """kvtier's keys (``apply_overrides``)."""
    beside: dict[str, Any] = field(default_factory=dict)
    """The ``beside.`` keys: what the benchmark runs beside the engine, on any base."""

    @property
    def measured_as(self) -> str:
        """The measured grid's configuration this one is compared with."""
        return self.kind


def base_of(label: str) -> str:
    """The base configuration of a label (the label itself when it sets nothing)."""
    return label.split("+", 1)[0].strip()


def is_variant(label: str) -> bool:
    """Whether ``label`` sets keys on its base (kvtier's, or ``beside.`` ones)."""
    return "+" in label


def parse_value(text: str) -> Any:
    """A setting's value: JSON where it is JSON (``0.5``, ``true``), else the text
    (``on_evict``, which a shell would not let through quoted as JSON)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _one_of(bases: Sequence[str]) -> str:
    return ", ".join(bases[:-1]) + " or " + bases[-1] if len(bases) > 1 else "".join(bases)


def parse_config(text: str, bases: Sequence[str]) -> ConfigSpec:
    """``BASE[+key=value...]`` with BASE one of ``bases``; ValueError, naming the label,
    otherwise."""
    kind, *items = [part.strip() for part in text.split("+")]
    if kind not in bases:
        raise ValueError(f"config {text!r}: {_one_of(bases)}[+key=value...]")
    overrides, beside = _settings(text, items)
    if overrides and not kind.startswith(KVTIER_PREFIX):
        raise ValueError(
            f"config {text!r}: only kvtier takes key=value settings (any base: {BESIDE_PREFIX}*)"
        )
    return ConfigSpec(text.strip(), kind, overrides, beside)


def _settings(text: str, items: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A label's ``key=value`` items: kvtier's keys, and the ``beside.`` ones (checked)."""
    overrides: dict[str, Any] = {}
    beside: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"config {text!r}: {item!r} is not key=value")
        into = beside if key.startswith(BESIDE_PREFIX) else overrides
        into[key] = parse_value(value)
    for key, value in beside.items():
        if key not in BESIDE_KEYS or not _beside_valid(key, value, beside):
            known = "; ".join(f"{k}: {what}" for k, what in BESIDE_KEYS.items())
            raise ValueError(
                f"config {text!r}: {key}={json.dumps(value)}; beside settings: {known}"
            )
    return overrides, beside


def _beside_valid(key: str, value: Any, beside: dict[str, Any]) -> bool:
    if key in (WRITE_FSYNC, WRITE_CHECKSUM):
        return isinstance(value, bool) and WRITE_MBPS in beside
    if key == WRITE_SOURCE_MIB:
        whole = isinstance(value, int) and not isinstance(value, bool)
        return whole and value >= 2 and WRITE_MBPS in beside  # the writer's 2 MiB blocks
    # bool is an int: ``true`` is no number; JSON also reads ``Infinity``
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    return is_number and math.isfinite(value) and value > 0


def apply_overrides(extra: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``extra`` (kvtier's connector config, changed in place and returned) with the dotted
    keys set; a number picks a list's item (``tiers.0.write=on_evict``), a missing mapping on
    the way is made. ``beside.`` keys are left out: they are the benchmark's, not kvtier's."""
    for key, value in overrides.items():
        if key.startswith(BESIDE_PREFIX):
            continue
        node: Any = extra
        *parents, leaf = key.split(".")
        for name in parents:
            node = node[int(name)] if isinstance(node, list) else node.setdefault(name, {})
        node[leaf] = value
    return extra


_UNSAFE = re.compile(r"[^A-Za-z0-9._+=-]")


def file_label(label: str) -> str:
    """``label`` as a file name's part: a variant's value may hold a path (``/``) or spaces;
    those become ``_`` and a short digest of the label keeps two such labels apart."""
    safe = _UNSAFE.sub("_", label)
    if safe == label:
        return label
    return f"{safe}-{hashlib.blake2b(label.encode(), digest_size=3).hexdigest()}"
