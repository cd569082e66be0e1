"""The declarative kvtier configuration: one mapping (a Python dict, a JSON file or a YAML file),
validated up front into frozen records.

The core sections (``pool``, ``block``, ``eviction``, ``admission``, ``tiers``, ...) are parsed
here, each tier's options by its own class (``Options.parse``). A section that belongs to one
component above the cache is handed to it as given, a read-only mapping: ``copy`` to the copy
backends (``kvtier.copy.cuda.options.CopyConfig.parse_mapping``), ``vllm`` to the vLLM connector
(``kvtier.integrations.vllm.settings.VllmSettings.parse``). The component that uses such a section
parses it, once; ``kvtier check-config`` asks each owner (``kvtier.cli.owned_sections``).

Every bad value raises ``ConfigError`` naming the full field path (``tiers[1].capacity``), the value
and what is allowed; unknown keys are rejected so that a typo never passes silently. The schema is
documented key by key in ``docs/configuration.md``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from kvtier.errors import ConfigError
from kvtier.policies import DEFAULT_EVICTION, parse_eviction
from kvtier.pool import DEFAULT_SHM_DIR, SLOT_ALIGN
from kvtier.redaction import yaml_problem
from kvtier.registry import is_plugin_path, parse_tier_options
from kvtier.safe_files import read_text
from kvtier.tiers import tier_class
from kvtier.tiers.base import WriteMode
from kvtier.validation import Section

SIMULATE_CONFIG = "simulate.yaml"
"""The embedded config ``kvtier simulate`` uses by default (``kvtier/data/simulate.yaml``)."""

_TIER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
RESERVED_TIER_NAMES = frozenset({"pool"})
"""``pool`` names the host pool in stats and simulate results."""
MAX_NESTING = 32
"""Deepest nesting of mappings and lists a config may have (a real one has 3): deeper input is
refused before anything recurses over it (copying, printing)."""
MAX_JOB_TIMEOUT_S = 86_400.0


@dataclass(frozen=True, slots=True)
class PoolConfig:
    size: int
    """Bytes of shared host memory; the pool holds ``size // slot_stride`` blocks
    (``slot_stride``: a block's bytes rounded up to 256), so it never takes more."""
    shm_dir: str = DEFAULT_SHM_DIR
    allow_pageable: bool = False
    """Keep running with pageable memory where pinning (page-locking for DMA) fails."""
    writeback_window: float = 0.25
    """Fraction of the pool, coldest first, copied ahead of eviction to write-on-evict tiers."""
    promotion_budget: float = 0.5
    """Fraction of the pool that blocks promoted for waiting requests may hold
    (``kvtier.cache.promotion``)."""
    promotion_costs: bool = True
    """Promote only as far as reading beats computing, and stop waiting when computing would
    have finished (``kvtier.cache.promotion``)."""
    share: str | None = None
    """Engines on the node with this name and the same namespace share one pool and one block
    index (``kvtier.shared_pool``); None: the pool is this engine's own."""
    share_lock_timeout_s: float = 0.1
    """Longest wait for the shared index's lock: a pin or store that waits longer is a miss."""
    share_quota: float = 0.0
    """Fraction of a shared pool past which an engine evicts its own blocks first (0: none)."""


@dataclass(frozen=True, slots=True)
class BlockConfig:
    tokens: int
    """Tokens per kvtier block (a multiple of the engine's block size)."""
    bytes: int
    """Payload bytes per block, used where no engine gives the geometry (``kvtier simulate``)."""


@dataclass(frozen=True, slots=True)
class AdmissionConfig:
    min_seen: int = 1
    """Store a block only once it was offered this many times (1: store everything)."""
    max_tracked: int = 1_000_000
    """How many not-yet-admitted keys the filter remembers (oldest forgotten first)."""

    @property
    def enabled(self) -> bool:
        return self.min_seen > 1


@dataclass(frozen=True, slots=True)
class TierConfig:
    kind: str
    name: str
    write: WriteMode
    options: Any
    """The tier class's own ``Options`` record (``tier_class(kind).Options.parse``'s result)."""


@dataclass(frozen=True, slots=True)
class KVTierConfig:
    pool: PoolConfig
    block: BlockConfig
    model: str | None = None
    """Namespace model name; engine adapters take it from the engine instead."""
    tenant: str = "default"
    eviction: str = DEFAULT_EVICTION
    """A name in ``kvtier.registry.POLICIES`` or a policy class as ``package.module:Class``."""
    admission: AdmissionConfig = AdmissionConfig()
    tiers: tuple[TierConfig, ...] = ()
    """Secondary tiers, fastest first."""
    job_timeout_s: float = 30.0
    events: bool = True
    copy: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """The ``copy`` section as given, parsed by the copy backends (``CopyConfig.parse_mapping``)."""
    vllm: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """The ``vllm`` section as given, parsed by the vLLM connector (``VllmSettings.parse``)."""


DEFAULT_POOL_SIZE = "64GiB"
DEFAULT_BLOCK_TOKENS = 512
DEFAULT_BLOCK_BYTES = "64MiB"
"""512 tokens of an 8B Llama-3 model in bf16 (32 layers x 8 KV heads x 128 x 2 x 2 bytes/token)."""


def load_config(source: Mapping[str, Any] | str | Path) -> KVTierConfig:
    """Validated config from a mapping or from a JSON / YAML file (by path).

    Raises ``ConfigError`` for a missing or unreadable file, bad JSON/YAML and every bad value.
    """
    raw = source if isinstance(source, Mapping) else read_config_file(source)
    return parse_config(raw)


CONFIG_MAX_BYTES = 16 * 2**20
"""Largest config file read (one of a few tiers is a few hundred bytes)."""


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The raw mapping in a JSON (``.json``) or YAML file (anything else), not yet validated."""
    path = Path(path)
    try:
        text = read_text(path, CONFIG_MAX_BYTES)  # a regular file: never a FIFO or a device
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("config file", str(path), f"a readable UTF-8 file ({exc})") from exc
    return _parse_text(text, str(path), json_syntax=path.suffix.lower() == ".json")


def bundled_config_mapping(name: str = SIMULATE_CONFIG) -> dict[str, Any]:
    """The raw mapping of a configuration embedded in the package (``kvtier/data/<name>``)."""
    text = resources.files("kvtier.data").joinpath(name).read_text("utf-8")
    return _parse_text(text, f"kvtier/data/{name}", json_syntax=name.endswith(".json"))


def _parse_text(text: str, where: str, json_syntax: bool) -> dict[str, Any]:
    data: object
    syntax = "JSON" if json_syntax else "YAML"
    try:
        data = json.loads(text) if json_syntax else yaml.safe_load(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("config file", where, f"valid {syntax} ({_one_line(exc)})") from exc
    except yaml.YAMLError as exc:
        # Not str(exc): PyYAML quotes the offending line, which can be the password's.
        raise ConfigError("config file", where, f"valid {syntax} ({yaml_problem(exc)})") from exc
    except RecursionError as exc:
        raise ConfigError("config file", where, f"valid {syntax} (nested too deeply)") from exc
    except ValueError as exc:  # an integer of more digits than Python converts (4,300)
        raise ConfigError("config file", where, f"valid {syntax} ({_one_line(exc)})") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("config file", where, "a mapping of options at the top level")
    return data


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _check_nesting(data: object) -> None:
    """Refuse mappings and lists nested deeper than ``MAX_NESTING`` (without recursing: the
    input may be nested 100,000 deep, or be a YAML alias bomb whose shared nodes are visited
    once each)."""
    seen: set[int] = set()
    stack: list[tuple[object, int, str]] = [(data, 0, "")]
    while stack:
        node, depth, path = stack.pop()
        if not isinstance(node, Mapping | list) or id(node) in seen:
            continue
        if depth > MAX_NESTING:
            raise ConfigError(path or "config", "...", f"nested at most {MAX_NESTING} deep")
        seen.add(id(node))
        if isinstance(node, list):
            stack.extend((v, depth + 1, f"{path}[{i}]") for i, v in enumerate(node))
        else:
            stack.extend((v, depth + 1, f"{path}.{k}" if path else str(k)) for k, v in node.items())


def parse_config(data: Mapping[str, Any]) -> KVTierConfig:
    """Validate a raw mapping (as read from JSON/YAML) into a ``KVTierConfig``."""
    _check_nesting(data)
    root = Section(data, "")
    model = root.optional_string("model")
    if model is not None and not model:
        raise ConfigError("model", model, "a non-empty model name (or leave it out)")
    config = KVTierConfig(
        model=model,
        tenant=root.string("tenant", "default"),
        pool=_pool(root.section("pool")),
        block=_block(root.section("block")),
        eviction=parse_eviction(root),
        admission=_admission(root.section("admission")),
        tiers=_tiers(root),
        job_timeout_s=root.number("job_timeout_s", 30.0, minimum=0.001, maximum=MAX_JOB_TIMEOUT_S),
        events=root.boolean("events", True),
        copy=_as_given(root.section("copy")),
        vllm=_as_given(root.section("vllm")),
    )
    root.done()
    return config


def _pool(s: Section) -> PoolConfig:
    pool = PoolConfig(
        size=_pool_size(s),
        shm_dir=s.file_path("shm_dir", DEFAULT_SHM_DIR),
        allow_pageable=s.boolean("allow_pageable", False),
        writeback_window=s.number("writeback_window", 0.25, minimum=0.0, maximum=1.0),
        promotion_budget=s.number("promotion_budget", 0.5, minimum=0.0, maximum=1.0),
        promotion_costs=s.boolean("promotion_costs", True),
        share=_share_name(s),
        share_lock_timeout_s=s.number("share_lock_timeout_s", 0.1, minimum=0.001, maximum=10.0),
        share_quota=s.number("share_quota", 0.0, minimum=0.0, maximum=1.0),
    )
    s.done()
    return pool


MIN_POOL_SIZE = SLOT_ALIGN
"""The smallest ``pool.size``: one slot. Every block takes a whole number of ``SLOT_ALIGN``-byte
units in the pool (``kvtier.pool.slot_stride``), so a smaller pool holds no block of any engine,
whatever its model; the block size itself is known only where the pool is built (the engine
adapter's geometry, ``block.bytes`` for ``kvtier simulate``), which refuses a pool under one of
its blocks."""


def _pool_size(s: Section) -> int:
    size = s.size("size", DEFAULT_POOL_SIZE)
    if size < MIN_POOL_SIZE:
        raise ConfigError(
            s.field("size"),
            s.data["size"],
            f"at least {MIN_POOL_SIZE} bytes (one block's slot: a block takes a multiple of "
            f"{SLOT_ALIGN} bytes, so a smaller pool holds none)",
        )
    return size


SHARE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""What ``pool.share`` may be: it becomes part of the pool's file name."""


def _share_name(s: Section) -> str | None:
    name = s.optional_string("share")
    if name is not None and not SHARE_NAME.fullmatch(name):
        raise ConfigError(
            "pool.share",
            name,
            "1-64 letters, digits, '_', '.', '-', starting with a letter or digit",
        )
    return name


def _block(s: Section) -> BlockConfig:
    block = BlockConfig(
        tokens=s.integer("tokens", DEFAULT_BLOCK_TOKENS, minimum=1),
        bytes=s.size("bytes", DEFAULT_BLOCK_BYTES, minimum=1),
    )
    s.done()
    return block


def _admission(s: Section) -> AdmissionConfig:
    admission = AdmissionConfig(
        min_seen=s.integer("min_seen", 1, minimum=1),
        max_tracked=s.integer("max_tracked", 1_000_000, minimum=1),
    )
    s.done()
    return admission


_TIER_COMMON = ("kind", "name", "write")


def _tiers(root: Section) -> tuple[TierConfig, ...]:
    out: list[TierConfig] = []
    seen: set[str] = set()
    for i, entry in enumerate(root.items("tiers")):
        path = f"tiers[{i}]"
        s = Section(entry, path)
        kind = s.string("kind")
        cls = tier_class(kind, field=f"{path}.kind")
        # A plugin's default name is its class name: a module path is no valid tier name.
        default = kind.rpartition(":")[2].rpartition(".")[2] if is_plugin_path(kind) else kind
        name = s.string("name", default)
        if not _TIER_NAME.match(name):
            raise ConfigError(
                f"{path}.name",
                name,
                "letters, digits, '_', '.', '-' (starting with a letter or digit)",
            )
        if name in RESERVED_TIER_NAMES:
            raise ConfigError(f"{path}.name", name, "a name other than 'pool' (the host pool's)")
        if name in seen:
            raise ConfigError(f"{path}.name", name, "a name no other tier has (names are unique)")
        seen.add(name)
        write = s.choice("write", WriteMode, WriteMode.THROUGH)
        option_keys = {k: v for k, v in s.data.items() if k not in _TIER_COMMON}
        options_section = Section(option_keys, path)
        options = parse_tier_options(cls, options_section, f"{path}.kind", kind)
        options_section.done()  # in case a tier's parse forgot: unknown keys never pass
        out.append(TierConfig(kind=kind, name=name, write=write, options=options))
    return tuple(out)


def _as_given(section: Section) -> Mapping[str, Any]:
    """A section its owner parses (see the module docstring): a mapping, kept read-only."""
    return MappingProxyType(dict(section.data))
