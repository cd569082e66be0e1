"""Config loading and validation (dict, JSON, YAML) and building a cache from a config."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_type_hints

import pytest
import yaml

from kvtier.cache import factory
from kvtier.cli import owned_sections
from kvtier.config import (
    AdmissionConfig,
    KVTierConfig,
    PoolConfig,
    bundled_config_mapping,
    load_config,
)
from kvtier.copy.options import CopyConfig, CopyStrategy
from kvtier.engine.load_mode import LoadMode
from kvtier.engine.planner_settings import PlannerSettings
from kvtier.errors import HIDDEN_VALUE, ConfigError, shown
from kvtier.integrations.vllm.settings import VllmSettings
from kvtier.keys import BlockKey, Namespace, keys_from_hashes
from kvtier.pool import NAME_PREFIX, HostPool
from kvtier.registry import TIERS
from kvtier.tiers import tier_class
from kvtier.tiers.base import Tier, TierJob, TierJobKind, WriteMode
from kvtier.tiers.fs.tier import FsTier
from kvtier.tiers.memory import MemoryTier
from kvtier.validation import Section

# -- a tier kind of the tests' own, so config parsing is tested independently of real tiers -------


@dataclass(frozen=True, slots=True)
class FakeOptions:
    capacity: int
    color: str = "blue"

    @classmethod
    def parse(cls, section: Section) -> FakeOptions:
        # No section.done(): config must reject unknown keys even when a tier forgets to.
        return cls(
            capacity=section.size("capacity", minimum=1), color=section.string("color", "blue")
        )


class FakeTier(Tier):
    Options = FakeOptions
    instances: list[FakeTier] = []
    fail_on_create: set[str] = set()

    def __init__(self, name: str, namespace: Namespace, pool: HostPool, options: FakeOptions):
        if name in FakeTier.fail_on_create:
            raise OSError(f"cannot open tier {name}")
        super().__init__(name, namespace, pool)
        self.options = options
        self.closed = False
        self.stored: dict[BlockKey, bytes] = {}
        FakeTier.instances.append(self)

    def lookup(self, keys: Sequence[BlockKey]) -> list[bool | None]:
        return [key in self.stored for key in keys]

    def submit(self, job: TierJob) -> None:
        if job.kind is TierJobKind.WRITE:
            for key, slot in zip(job.keys, job.slots, strict=True):
                self.stored[key] = bytes(self.pool.view(slot))
        self._finish(job.job_id, [True] * len(job.keys))

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_kind(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setitem(TIERS.entries, "fake", f"{FakeTier.__module__}:FakeTier")
    monkeypatch.setattr(FakeTier, "instances", [])
    monkeypatch.setattr(FakeTier, "fail_on_create", set())
    return "fake"


def error_of(source: Any) -> ConfigError:
    """The error of the whole file: the core config, then the sections their owners parse
    (``copy``, ``vllm``), as ``check-config`` and a run see it."""
    with pytest.raises(ConfigError) as info:
        owned_sections(load_config(source))
    return info.value


# -- defaults and a full config -------------------------------------------------------------------


def test_empty_mapping_gives_documented_defaults() -> None:
    config = load_config({})
    assert config.model is None
    assert config.tenant == "default"
    assert config.pool.size == 64 * 1024**3
    assert config.pool.shm_dir == "/dev/shm"
    assert config.pool.allow_pageable is False
    assert (config.block.tokens, config.block.bytes) == (512, 64 * 1024**2)
    assert config.eviction == "hinted"
    assert config.admission == AdmissionConfig(min_seen=1, max_tracked=1_000_000)
    assert not config.admission.enabled
    assert config.tiers == ()
    assert config.job_timeout_s == 30.0
    assert config.events is True
    assert dict(config.copy) == {} and dict(config.vllm) == {}
    assert owned_sections(config) == CopyConfig(CopyStrategy.AUTO, max_sms=0)
    assert VllmSettings.parse(config.vllm, tiered=True) == VllmSettings()


FULL: dict[str, Any] = {
    "model": "meta-llama/Llama-3.1-8B-Instruct",
    "tenant": "team-a",
    "pool": {"size": "2GiB", "shm_dir": "/dev/shm", "allow_pageable": True},
    "block": {"tokens": 256, "bytes": "32MiB"},
    "eviction": "arc",
    "admission": {"min_seen": 2, "max_tracked": 5000},
    "tiers": [
        {"kind": "memory", "capacity": "1GiB", "latency_ms": 2},
        {"kind": "fs", "name": "nvme", "write": "on_evict", "path": "/tmp/x", "capacity": "1TB"},
    ],
    "job_timeout_s": 5,
    "events": False,
    "copy": {"strategy": "kernel", "max_sms": 8},
    "vllm": {"blocks_per_slot": 16, "store_generated": True},
}


def test_full_config_is_parsed_into_typed_records() -> None:
    config = load_config(FULL)
    assert config.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert config.tenant == "team-a"
    assert config.pool.size == 2 * 1024**3
    assert config.pool.allow_pageable is True
    assert (config.block.tokens, config.block.bytes) == (256, 32 * 1024**2)
    assert config.eviction == "arc"
    assert config.admission.enabled and config.admission.min_seen == 2
    assert config.admission.max_tracked == 5000
    memory, fs = config.tiers
    assert (memory.kind, memory.name, memory.write) == ("memory", "memory", WriteMode.THROUGH)
    assert memory.options.capacity == 1024**3 and memory.options.latency_ms == 2.0
    assert (fs.kind, fs.name, fs.write) == ("fs", "nvme", WriteMode.ON_EVICT)
    assert fs.options.path == "/tmp/x" and fs.options.capacity == 10**12
    assert config.job_timeout_s == 5.0
    assert config.events is False
    assert owned_sections(config) == CopyConfig(CopyStrategy.KERNEL, max_sms=8)
    assert dict(config.vllm) == {"blocks_per_slot": 16, "store_generated": True}
    planner = VllmSettings.parse(config.vllm, tiered=bool(config.tiers)).planner
    assert (planner.blocks_per_slot, planner.store_generated) == (16, True)
    assert planner.load_mode is LoadMode.SYNC  # left out, with secondary tiers


@pytest.mark.parametrize(
    ("value", "mode"),
    [(False, LoadMode.SYNC), (True, LoadMode.ASYNC), ("auto", LoadMode.AUTO)],
)
def test_vllm_async_loads_is_a_load_mode(value: object, mode: LoadMode) -> None:
    for tiered in (False, True):  # as given, whatever the default
        section = load_config({"vllm": {"async_loads": value}}).vllm
        planner = VllmSettings.parse(section, tiered=tiered).planner
        assert planner.load_mode is mode
        assert planner.async_loads is (mode is LoadMode.ASYNC)


def test_vllm_async_loads_left_out_is_auto_for_a_pool_alone_and_sync_with_tiers() -> None:
    alone = load_config({})
    assert VllmSettings.parse(alone.vllm, tiered=bool(alone.tiers)).planner.load_mode is (
        LoadMode.AUTO
    )
    tiered = load_config({"tiers": [{"kind": "memory", "capacity": "1GiB"}]})
    assert VllmSettings.parse(tiered.vllm, tiered=bool(tiered.tiers)).planner.load_mode is (
        LoadMode.SYNC
    )


def test_config_records_are_frozen() -> None:
    config = load_config(FULL)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.pool.size = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.eviction = "lru"  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.vllm["blocks_per_slot"] = 1  # type: ignore[index]
    assert isinstance(config.tiers, tuple)


def test_json_and_yaml_files_equal_the_dict(tmp_path: Path) -> None:
    as_json = tmp_path / "kvtier.json"
    as_json.write_text(json.dumps(FULL))
    as_yaml = tmp_path / "kvtier.yaml"
    as_yaml.write_text(yaml.safe_dump(FULL))
    expected = load_config(FULL)
    assert load_config(as_json) == expected
    assert load_config(str(as_yaml)) == expected


def test_empty_yaml_file_gives_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing set\n")
    assert load_config(path) == load_config({})


def test_bundled_simulate_config_is_valid_and_holds_4000_blocks() -> None:
    config = load_config(bundled_config_mapping())
    assert config.pool.size // config.block.bytes == 4000
    assert config.eviction == "hinted"
    assert config.tiers == ()


def test_tier_options_parse_through_the_tier_kind(fake_kind: str) -> None:
    config = load_config({"tiers": [{"kind": fake_kind, "capacity": "1KiB", "color": "red"}]})
    (tier,) = config.tiers
    assert tier.options == FakeOptions(capacity=1024, color="red")
    assert tier.name == "fake" and tier.write is WriteMode.THROUGH


# -- every kind of bad value names its field, the value and what is allowed -----------------------


BAD: list[tuple[dict[str, Any], str, object, str]] = [
    # (config, field, value, part of what is allowed)
    ({"model": 5}, "model", 5, "a string"),
    ({"model": ""}, "model", "", "non-empty"),
    ({"tenant": ""}, "tenant", "", "non-empty"),
    ({"evictoin": "lru"}, "evictoin", "lru", "not a known option"),
    ({"pool": []}, "pool", [], "a mapping"),
    ({"pool": {"size": "64 GB!"}}, "pool.size", "64 GB!", "64GiB"),
    ({"pool": {"size": 0}}, "pool.size", 0, "at least"),
    ({"pool": {"size": True}}, "pool.size", True, "a byte count"),
    ({"pool": {"size": "-1GiB"}}, "pool.size", "-1GiB", "a byte count"),
    (
        {"pool": {"sise": "1GiB"}},
        "pool.sise",
        "1GiB",
        "known: allow_pageable, promotion_budget, promotion_costs, share, share_lock_timeout_s, "
        "share_quota, shm_dir, size, writeback_window",
    ),
    ({"pool": {"shm_dir": 3}}, "pool.shm_dir", 3, "a non-empty string"),
    ({"pool": {"allow_pageable": "no"}}, "pool.allow_pageable", "no", "true or false"),
    ({"block": {"tokens": 0}}, "block.tokens", 0, "an integer >= 1"),
    ({"block": {"tokens": "512"}}, "block.tokens", "512", "an integer"),
    ({"block": {"tokens": 2.5}}, "block.tokens", 2.5, "an integer"),
    ({"block": {"bytes": "big"}}, "block.bytes", "big", "512MiB"),
    ({"block": {"bytes": 0}}, "block.bytes", 0, "at least"),
    ({"eviction": "fifo"}, "eviction", "fifo", "one of 'arc', 'hinted', 'lru'"),
    ({"eviction": None}, "eviction", None, "one of 'arc', 'hinted', 'lru'"),
    ({"admission": {"min_seen": 0}}, "admission.min_seen", 0, ">= 1"),
    ({"admission": {"max_tracked": True}}, "admission.max_tracked", True, "an integer"),
    ({"admission": {"min_sen": 2}}, "admission.min_sen", 2, "not a known option"),
    ({"tiers": {"kind": "fs"}}, "tiers", {"kind": "fs"}, "a list"),
    ({"tiers": ["fs"]}, "tiers[0]", "fs", "a mapping"),
    ({"tiers": [{"capacity": "1GiB"}]}, "tiers[0].kind", None, "a non-empty string"),
    ({"tiers": [{"kind": "s3"}]}, "tiers[0].kind", "s3", "one of 'fs', 'memory', 'redis'"),
    (
        {"tiers": [{"kind": "memory", "write": "sometimes"}]},
        "tiers[0].write",
        "sometimes",
        "one of 'through', 'on_evict'",
    ),
    ({"tiers": [{"kind": "memory", "name": "pool"}]}, "tiers[0].name", "pool", "other than"),
    ({"tiers": [{"kind": "memory", "name": "../etc"}]}, "tiers[0].name", "../etc", "letters"),
    ({"tiers": [{"kind": "memory", "name": ""}]}, "tiers[0].name", "", "non-empty"),
    ({"tiers": [{"kind": "memory"}, {"kind": "memory"}]}, "tiers[1].name", "memory", "unique"),
    (
        {"tiers": [{"kind": "memory"}, {"kind": "fs", "path": "/tmp/kv", "capacity": "lots"}]},
        "tiers[1].capacity",
        "lots",
        "512MiB",
    ),
    ({"tiers": [{"kind": "fs", "capacity": "1GiB"}]}, "tiers[0].path", None, "non-empty"),
    ({"tiers": [{"kind": "memory", "latency": 5}]}, "tiers[0].latency", 5, "not a known option"),
    (
        {"tiers": [{"kind": "memory", "failure_rate": 1.5}]},
        "tiers[0].failure_rate",
        1.5,
        "a finite number in [0.0, 1.0]",
    ),
    ({"job_timeout_s": 0}, "job_timeout_s", 0, "a finite number in [0.001, 86400.0]"),
    ({"job_timeout_s": 1e9}, "job_timeout_s", 1e9, "in [0.001, 86400.0]"),
    ({"job_timeout_s": 10**400}, "job_timeout_s", 10**400, "a finite number"),
    ({"job_timeout_s": "30"}, "job_timeout_s", "30", "a finite number"),
    ({"events": "yes"}, "events", "yes", "true or false"),
    (
        {"copy": {"strategy": "fast"}},
        "copy.strategy",
        "fast",
        "one of 'auto', 'dma', 'staged', 'kernel'",
    ),
    ({"copy": {"max_sms": -1}}, "copy.max_sms", -1, ">= 0"),
    ({"copy": {"streams": 2}}, "copy.streams", 2, "not a known option"),
    ({"vllm": "on"}, "vllm", "on", "a mapping"),
    # sizes and integers beyond 64 bits (a float conversion once raised OverflowError)
    ({"pool": {"size": "1" * 400}}, "pool.size", "1" * 400, "at most 9223372036854775807"),
    ({"pool": {"size": "1" * 400 + "GiB"}}, "pool.size", "1" * 400 + "GiB", "at most"),
    ({"pool": {"size": 10**400}}, "pool.size", 10**400, "at most 9223372036854775807"),
    ({"pool": {"size": "8EiB"}}, "pool.size", "8EiB", "64GiB"),
    ({"block": {"tokens": 2**64}}, "block.tokens", 2**64, "an integer >= 1 (64-bit)"),
    ({"tiers": [{"kind": "memory", "seed": -(2**70)}]}, "tiers[0].seed", -(2**70), "64-bit"),
    # unknown keys of mixed types (sorting them once raised TypeError)
    ({1: "x", 2: "y"}, "1", "x", "not a known option"),
    ({1: "x", "zz": 2}, "zz", 2, "not a known option"),
    ({None: 1, "pool": {7: 1, "sise": 2}}, "pool.sise", 2, "not a known option"),
    ({None: 1, "tenant": "t"}, "None", 1, "not a known option"),
    # paths with a NUL byte (the OS call once said "embedded null byte", naming no field)
    (
        {"tiers": [{"kind": "fs", "path": "/tmp/a\0b", "capacity": 1}]},
        "tiers[0].path",
        "/tmp/a\0b",
        "without a NUL",
    ),
    ({"pool": {"shm_dir": "/dev/shm\0"}}, "pool.shm_dir", "/dev/shm\0", "without a NUL"),
    ({"vllm": {"stats_path": "s\0"}}, "vllm.stats_path", "s\0", "without a NUL"),
    # the vllm section is validated with the rest (typos there once passed as valid)
    (
        {"vllm": {"blocks_per_slt": 2}},
        "vllm.blocks_per_slt",
        2,
        "known: async_loads, blocks_per_slot",
    ),
    ({"vllm": {"blocks_per_slot": 0}}, "vllm.blocks_per_slot", 0, "in [1, 1024]"),
    ({"vllm": {"kv_cache_layout": "NHD"}}, "vllm.kv_cache_layout", "NHD", "'engine' or one"),
    ({"vllm": {"store_generated": "yes"}}, "vllm.store_generated", "yes", "true or false"),
    ({"vllm": {"async_loads": "async"}}, "vllm.async_loads", "async", "true, false or 'auto'"),
    # Redis URLs: malformed IPv6 (once a bare ValueError), ports out of range or not numbers
    (
        {"tiers": [{"kind": "redis", "url": "redis://[::1:6379"}]},
        "tiers[0].url",
        "redis://[::1:6379",
        "a valid URL (Invalid IPv6 URL)",
    ),
    (
        {"tiers": [{"kind": "redis", "url": "redis://h:99999"}]},
        "tiers[0].url",
        "redis://h:99999",
        "Port out of range",
    ),
    (
        {"tiers": [{"kind": "redis", "url": "redis://h:abc/0"}]},
        "tiers[0].url",
        "redis://h:abc/0",
        "a valid URL",
    ),
    (
        {"tiers": [{"kind": "redis", "url": "redis://h:0"}]},
        "tiers[0].url",
        "redis://h:0",
        "1..65535",
    ),
    (
        {"tiers": [{"kind": "redis", "url": "unix:///tmp/r\0.sock"}]},
        "tiers[0].url",
        "unix:///tmp/r\0.sock",
        "without control characters",
    ),
    (
        {"tiers": [{"kind": "redis", "ttl_s": 1e12}]},
        "tiers[0].ttl_s",
        1e12,
        "a finite number in [0.001, 315360000.0]",
    ),
    (
        {"tiers": [{"kind": "memory", "latency_ms": 1e300}]},
        "tiers[0].latency_ms",
        1e300,
        "in [0.0, 3600000.0]",
    ),
]


@pytest.mark.parametrize(("data", "field", "value", "allowed"), BAD, ids=[b[1] for b in BAD])
def test_bad_value_names_field_value_and_what_is_allowed(
    data: dict[str, Any], field: str, value: object, allowed: str
) -> None:
    error = error_of(data)
    assert error.field == field
    assert error.value == value and type(error.value) is type(value)
    assert allowed in error.allowed
    # An unknown key's value is not printed: it may be a misspelt secret.
    text = HIDDEN_VALUE if error.allowed.startswith("not a known option") else shown(value)
    assert str(error).startswith(f"invalid config {field}={text}: ")


# -- NaN and infinity: every decimal option of every record refuses them ------------------------


def _float_fields(record: type) -> list[str]:
    hints = get_type_hints(record)
    return [f.name for f in dataclasses.fields(record) if hints[f.name] in (float, float | None)]


def _decimal_options() -> list[tuple[str, dict[str, Any]]]:
    """(field path, base config) for every float field of every config record, found from the
    records' types: a decimal option added later is covered without touching this test."""
    out: list[tuple[str, dict[str, Any]]] = []
    for name in _float_fields(KVTierConfig):
        out.append((name, {}))
    for name in _float_fields(PoolConfig):
        out.append((f"pool.{name}", {"pool": {}}))
    for name in _float_fields(VllmSettings) + _float_fields(PlannerSettings):
        out.append((f"vllm.{name}", {"vllm": {}}))
    required = {"fs": {"path": "/tmp/kvtier-nan-test", "capacity": 1}}
    for kind in TIERS:
        options = tier_class(kind).Options
        for name in _float_fields(options):
            out.append((f"tiers[0].{name}", {"tiers": [{"kind": kind, **required.get(kind, {})}]}))
    return out


DECIMAL_OPTIONS = _decimal_options()


def test_every_config_record_with_decimals_is_covered() -> None:
    fields = {path for path, _ in DECIMAL_OPTIONS}
    assert {"job_timeout_s", "pool.writeback_window", "tiers[0].ttl_s"} <= fields
    assert {"tiers[0].latency_ms", "tiers[0].failure_rate", "tiers[0].health_interval_s"} <= fields
    assert len(fields) >= 11


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(("field", "base"), DECIMAL_OPTIONS, ids=[d[0] for d in DECIMAL_OPTIONS])
def test_nan_and_infinity_are_refused_naming_the_field(
    field: str, base: dict[str, Any], bad: float
) -> None:
    data = json.loads(json.dumps(base))
    *parents, key = field.replace("tiers[0]", "tiers.0").split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[key] = bad
    error = error_of(data)
    assert error.field == field
    assert "a finite number" in error.allowed


def test_nan_in_a_yaml_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "inf.yaml"
    path.write_text("job_timeout_s: .inf\n")
    error = error_of(path)
    assert error.field == "job_timeout_s" and error.value == math.inf
    path.write_text("pool:\n  writeback_window: .NaN\n")
    error = error_of(path)
    assert error.field == "pool.writeback_window" and math.isnan(error.value)


def test_huge_values_in_errors_are_shown_short() -> None:
    # repr of a 5,000-digit int raises ValueError: the message must still be built.
    error = error_of({"pool": {"size": 10**5000}})
    assert error.field == "pool.size" and len(str(error)) < 500


def test_unknown_tier_option_is_rejected_even_if_the_tier_forgets(fake_kind: str) -> None:
    error = error_of({"tiers": [{"kind": fake_kind, "capacity": 1, "colour": "red"}]})
    assert (error.field, error.value) == ("tiers[0].colour", "red")
    assert "not a known option" in error.allowed


def test_tier_with_missing_dependency_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TIERS.entries, "s3", "kvtier_no_such_module_for_tests:S3Tier")
    error = error_of({"tiers": [{"kind": "s3"}]})
    assert (error.field, error.value) == ("tiers[0].kind", "s3")
    assert "dependency is not installed" in error.allowed


# -- files ---------------------------------------------------------------------------------------


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.yaml"
    error = error_of(path)
    assert (error.field, error.value) == ("config file", str(path))
    assert "readable" in error.allowed


def test_directory_instead_of_file(tmp_path: Path) -> None:
    error = error_of(tmp_path)
    assert error.value == str(tmp_path)


def test_bad_yaml_names_the_path_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("pool:\n  size: [1GiB\nblock: {}\n")
    error = error_of(path)
    assert (error.field, error.value) == ("config file", str(path))
    assert "valid YAML" in error.allowed and "line" in error.allowed


def test_bad_json_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"pool": {"size": "1GiB",}}')
    error = error_of(path)
    assert (error.field, error.value) == ("config file", str(path))
    assert "valid JSON" in error.allowed


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- pool\n- block\n")
    error = error_of(path)
    assert "a mapping of options at the top level" in error.allowed


def test_bad_value_in_a_file_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text("tiers:\n  - kind: memory\n  - kind: fs\n    path: /tmp/kv\n    capacity: 0\n")
    error = error_of(path)
    assert (error.field, error.value) == ("tiers[1].capacity", 0)


# -- factory --------------------------------------------------------------------------------------


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    """A private directory for pool files, so leaks are visible."""
    directory = tmp_path / "shm"
    directory.mkdir()
    return directory


def pool_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"{NAME_PREFIX}*"))


NS = Namespace(model="factory-test", dtype="float16", block_tokens=16)


def test_build_cache_sizes_the_pool_and_builds_tiers_in_order(shm: Path, tmp_path: Path) -> None:
    config = load_config(
        {
            "pool": {"size": 10 * 1000 + 999, "shm_dir": str(shm)},
            "tiers": [
                {"kind": "memory", "capacity": "1MiB"},
                {
                    "kind": "fs",
                    "write": "on_evict",
                    "path": str(tmp_path / "fs"),
                    "capacity": "1MiB",
                },
            ],
        }
    )
    pool, cache = factory.build_cache(config, NS, slot_bytes=1000)
    try:
        assert pool.num_slots == 10 and pool.slot_bytes == 1000
        assert len(pool_files(shm)) == 1
        assert list(cache.stats().tiers) == ["memory", "fs"]
        keys = keys_from_hashes(NS, [1, 2, 3])
        reservation = cache.prepare_store(keys)
        assert reservation.keys == keys
        for key, slot in zip(reservation.keys, reservation.slots, strict=True):
            pool.view(slot)[:] = key * (1000 // 16) + key[:8]
        cache.complete_store(reservation.keys)
        assert cache.lookup(keys) == (3, True)
    finally:
        cache.close()
        pool.close()
    assert pool_files(shm) == []
    assert isinstance(pool, HostPool)


def test_build_cache_tier_classes_and_write_modes(shm: Path, tmp_path: Path) -> None:
    config = load_config(
        {
            "pool": {"size": 4096, "shm_dir": str(shm)},
            "tiers": [
                {"kind": "fs", "path": str(tmp_path / "fs"), "capacity": "1MiB"},
                {"kind": "memory", "name": "ram", "write": "on_evict"},
            ],
        }
    )
    pool, cache = factory.build_cache(config, NS, slot_bytes=1024)
    try:
        tiers = [s.tier for s in cache._secondary]
        modes = [s.write_mode for s in cache._secondary]
        assert [type(t) for t in tiers] == [FsTier, MemoryTier]
        assert [t.name for t in tiers] == ["fs", "ram"]
        assert modes == [WriteMode.THROUGH, WriteMode.ON_EVICT]
        assert all(t.pool is pool and t.namespace == NS for t in tiers)
    finally:
        cache.close()
        pool.close()


def test_pool_smaller_than_one_slot_is_a_config_error_and_creates_nothing(shm: Path) -> None:
    config = load_config({"pool": {"size": "1KiB", "shm_dir": str(shm)}})
    with pytest.raises(ConfigError) as info:
        factory.build_cache(config, NS, slot_bytes=4096)
    assert (info.value.field, info.value.value) == ("pool.size", 1024)
    assert "at least one block of 4096 bytes" in info.value.allowed
    assert pool_files(shm) == []


def test_failing_tier_closes_earlier_tiers_and_the_pool(shm: Path, fake_kind: str) -> None:
    FakeTier.fail_on_create.add("second")
    config = load_config(
        {
            "pool": {"size": 8192, "shm_dir": str(shm)},
            "tiers": [
                {"kind": fake_kind, "name": "first", "capacity": 1},
                {"kind": fake_kind, "name": "second", "capacity": 1},
            ],
        }
    )
    with pytest.raises(ConfigError, match=r"tiers\[1\].kind.*OSError: cannot open tier second"):
        factory.build_cache(config, NS, slot_bytes=1024)
    (first,) = FakeTier.instances
    assert first.name == "first" and first.closed
    assert pool_files(shm) == []


def test_unusable_shm_dir_is_a_config_error_naming_the_field(tmp_path: Path) -> None:
    missing = str(tmp_path / "missing")
    config = load_config({"pool": {"size": 8192, "shm_dir": missing}})
    with pytest.raises(ConfigError) as info:
        factory.build_cache(config, NS, slot_bytes=1024)
    assert (info.value.field, info.value.value) == ("pool.shm_dir", missing)


def test_admission_and_eviction_reach_the_cache(shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[tuple[str, int]] = []
    real = factory.make_policy

    def spy(kind: str, capacity: int) -> Any:
        made.append((kind, capacity))
        return real(kind, capacity)

    monkeypatch.setattr(factory, "make_policy", spy)
    config = load_config(
        {
            "pool": {"size": 4096, "shm_dir": str(shm)},
            "eviction": "arc",
            "admission": {"min_seen": 2},
        }
    )
    pool, cache = factory.build_cache(config, NS, slot_bytes=1024)
    try:
        assert made == [("arc", 4)]
        keys = keys_from_hashes(NS, [7])
        assert cache.prepare_store(keys).keys == []  # first offer: not admitted yet
        second = cache.prepare_store(keys)
        assert second.keys == keys
        cache.complete_store(second.keys)
        assert cache.lookup(keys).hits == 1
    finally:
        cache.close()
        pool.close()


def test_configs_compare_by_value() -> None:
    a, b = load_config({"eviction": "arc"}), load_config({"eviction": "arc"})
    assert a == b and a != load_config({})
    assert isinstance(a, KVTierConfig)


# -- the docs match the code ----------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]


def config_keys() -> dict[str, list[str]]:
    """Every key the config reads, by section, from the records themselves."""
    from kvtier.config import BlockConfig, PoolConfig
    from kvtier.tiers import tier_class

    keys = {
        "": [f.name for f in dataclasses.fields(KVTierConfig)],
        "pool": [f.name for f in dataclasses.fields(PoolConfig)],
        "block": [f.name for f in dataclasses.fields(BlockConfig)],
        "admission": [f.name for f in dataclasses.fields(AdmissionConfig)],
        "copy": [f.name for f in dataclasses.fields(CopyConfig)],
        "tiers": ["kind", "name", "write"],
    }

    for kind in TIERS:
        fields = dataclasses.fields(tier_class(kind).Options)
        keys[kind] = [f.name for f in fields if f.compare]  # compare=False: bookkeeping, not keys
    return keys


def test_every_config_key_is_documented() -> None:
    reference = (ROOT / "docs" / "configuration.md").read_text()
    readme = (ROOT / "README.md").read_text()
    sections = ("pool", "block", "admission", "copy")
    for section, keys in config_keys().items():
        for key in keys:
            assert f"`{key}`" in reference, (section, key)
            if section in ("", *sections) and key not in sections:
                dotted = f"{section}.{key}" if section else key
                assert f"`{dotted}`" in readme, dotted


def test_documented_example_config_is_valid() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    example = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    config = load_config(yaml.safe_load(example))
    assert [t.kind for t in config.tiers] == ["fs", "redis"]
    assert config.tiers[1].write is WriteMode.ON_EVICT


def test_readme_python_example_runs(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    code = text.split("```python\n", 1)[1].split("```", 1)[0]
    assert '"/tmp/kv"' in code
    namespace: dict[str, Any] = {}
    exec(code.replace('"/tmp/kv"', repr(str(tmp_path / "kv"))), namespace)
    assert namespace["pool"].num_slots == 1024
    assert namespace["r"] == (0, True)
    assert namespace["res"].keys == namespace["keys"]


@pytest.mark.parametrize("strategy", ["auto", "dma", "staged", "kernel"])
def test_every_copy_strategy_reaches_the_cuda_backend_options(strategy: str) -> None:
    from kvtier.copy.cuda.options import CudaCopyOptions

    config = load_config({"model": "m", "copy": {"strategy": strategy, "max_sms": 4}})
    options = CudaCopyOptions.from_copy(CopyConfig.parse_mapping(config.copy), True)
    assert (options.strategy, options.max_sms, options.allow_pageable) == (strategy, 4, True)


def test_a_misspelt_secret_is_not_printed() -> None:
    error = error_of({"tiers": [{"kind": "redis", "url": "redis://h:6379", "pasword": "hunter2"}]})
    assert error.field == "tiers[0].pasword" and error.value == "hunter2"
    assert "hunter2" not in str(error)


# -- a misspelt key is named as the unknown key, with the known key it is nearest -----------------

MISSPELT: list[tuple[dict[str, Any], str, str]] = [
    # (config, the unknown key's field, its suggestion); a required key, misspelt, was once
    # reported as missing (``tiers[0].capacity=None: required``)
    ({"tiers": [{"kind": "fs", "path": "/x", "capacty": "1GB"}]}, "tiers[0].capacty", "capacity"),
    ({"tiers": [{"kind": "fs", "pth": "/x", "capacity": "1GB"}]}, "tiers[0].pth", "path"),
    ({"tiers": [{"knd": "fs", "path": "/x", "capacity": "1GB"}]}, "tiers[0].knd", "kind"),
    ({"tiers": [{"Kind": "memory"}]}, "tiers[0].Kind", "kind"),
    # an optional key, misspelt: every section suggests its nearest known key
    ({"evictoin": "lru"}, "evictoin", "eviction"),
    ({"pol": {"size": "1GiB"}}, "pol", "pool"),
    ({"pool": {"writeback_windw": 0.5}}, "pool.writeback_windw", "writeback_window"),
    ({"block": {"token": 16}}, "block.token", "tokens"),
    ({"admission": {"min_sen": 2}}, "admission.min_sen", "min_seen"),
    (
        {"tiers": [{"kind": "fs", "path": "/x", "capacity": 1, "fsink": True}]},
        "tiers[0].fsink",
        "fsync",
    ),
    ({"tiers": [{"kind": "memory", "latency": 5}]}, "tiers[0].latency", "latency_ms"),
    ({"tiers": [{"kind": "redis", "pasword": "pw"}]}, "tiers[0].pasword", "password"),
    ({"copy": {"strategie": "dma"}}, "copy.strategie", "strategy"),
    ({"vllm": {"blocks_per_slt": 2}}, "vllm.blocks_per_slt", "blocks_per_slot"),
]


@pytest.mark.parametrize(("data", "field", "near"), MISSPELT, ids=[m[1] for m in MISSPELT])
def test_a_misspelt_key_is_named_with_the_nearest_known_key(
    data: dict[str, Any], field: str, near: str
) -> None:
    error = error_of(data)
    assert error.field == field
    assert error.allowed.startswith(f"not a known option here; did you mean {near}?")
    assert str(error).startswith(f"invalid config {field}={HIDDEN_VALUE}: ")
    assert "pw" not in str(error)  # a misspelt secret stays unprinted


def test_an_unknown_key_like_no_known_one_gets_no_suggestion() -> None:
    error = error_of({"pool": {"xyzzy": 1}})
    assert error.field == "pool.xyzzy" and "did you mean" not in error.allowed
    assert error.allowed.startswith("not a known option here; known: allow_pageable,")


def test_a_missing_required_key_with_no_near_unknown_key_is_still_reported_missing() -> None:
    # "size" is unknown to fs but not near "capacity": the missing capacity is the error.
    error = error_of({"tiers": [{"kind": "fs", "path": "/x", "size": "1GB"}]})
    assert (error.field, error.value) == ("tiers[0].capacity", None)
    assert error.allowed.startswith("required")


def test_a_known_key_near_a_missing_one_is_not_taken_for_its_misspelling() -> None:
    # memory's capacity_blocks is a known key, 0.70 like "capacity": not a typo of it.
    config = load_config({"tiers": [{"kind": "memory", "capacity_blocks": 4}]})
    assert config.tiers[0].options.capacity_blocks == 4
    section = Section({"capacity_blocks": 4}, "t")
    with pytest.raises(ConfigError) as info:
        section.size("capacity")
    assert info.value.field == "t.capacity" and info.value.allowed.startswith("required")


# -- pool.size: under one 256-byte slot the pool holds no block of any engine -------------------


@pytest.mark.parametrize("size", [1, 10, 255, "255B", "0.2KB"])
def test_a_pool_under_one_slot_is_refused_whatever_the_engine(size: object) -> None:
    """Before: ``pool.size: 10`` was valid to ``check-config``, refused by simulate and by every
    engine when the pool was built."""
    error = error_of({"pool": {"size": size}})
    assert (error.field, error.value) == ("pool.size", size)
    assert error.allowed.startswith("at least 256 bytes (one block's slot")


def test_a_pool_of_one_slot_is_valid() -> None:
    assert load_config({"pool": {"size": 256}}).pool.size == 256
