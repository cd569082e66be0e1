"""Tiers and policies outside kvtier, named by module path in config and on the command line.

The parts live in ``tests/plugin_examples`` (on the Python path as ``plugin_examples``) and use
only kvtier's public interfaces, as a package installed next to kvtier would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from plugin_examples.dict_tier import DictTier
from plugin_examples.fifo_policy import FifoPolicy

from kvtier import factory
from kvtier.cli import main, parse_tier_spec
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.policies import make_policy
from kvtier.registry import COPY_BACKENDS, POLICIES, TIERS, Registry

TIER = "plugin_examples.dict_tier:DictTier"
POLICY = "plugin_examples.fifo_policy:FifoPolicy"
NS = Namespace(model="plugin-test", dtype="float16", block_tokens=16)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def shm(tmp_path: Path) -> Path:
    directory = tmp_path / "shm"
    directory.mkdir()
    return directory


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def store(cache: Any, pool: Any, k: bytes) -> None:
    reservation = cache.prepare_store([k])
    assert reservation.keys == [k]
    pool.view(reservation.slots[0])[:] = k * (pool.slot_bytes // len(k))
    cache.complete_store([k])
    cache.step()  # collect the write-through copy, which holds the slot until it is done


# -- tiers ---------------------------------------------------------------------------------------


def test_out_of_tree_tier_is_built_from_its_module_path_with_its_own_options(shm: Path) -> None:
    config = load_config(
        {
            "pool": {"size": 2048, "shm_dir": str(shm)},
            "tiers": [{"kind": TIER, "name": "dict", "capacity_blocks": 3, "threads": 0}],
        }
    )
    assert config.tiers[0].kind == TIER
    pool, cache = factory.build_cache(config, NS, slot_bytes=1024)
    try:
        tier = DictTier.instances[-1]
        assert tier.name == "dict" and tier.options.capacity_blocks == 3
        for i in range(4):  # 2 pool slots: the first keys leave the pool, their copies stay
            store(cache, pool, key(i))
        assert list(tier.blocks) == [key(1), key(2), key(3)]  # its own capacity bound
        first = cache.lookup([key(1)])
        assert (first.hits, first.final) == (0, False)  # not in the pool: promoted from the tier
        cache.step()
        assert cache.lookup([key(1)]).hits == 1
        (slot,) = cache.prepare_load([key(1)])
        assert bytes(pool.view(slot)) == key(1) * (pool.slot_bytes // 16)
        cache.complete_load([key(1)])
    finally:
        cache.close()
        pool.close()


def test_out_of_tree_tier_options_are_validated_by_its_own_parser() -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": [{"kind": TIER, "capacity_blocks": 0}]})
    assert info.value.field == "tiers[0].capacity_blocks"
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": [{"kind": TIER, "colour": "red"}]})
    assert info.value.field == "tiers[0].colour"


def test_simulate_replays_through_an_out_of_tree_tier_and_policy(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        [
            "simulate",
            "--json",
            "--no-progress",
            "--limit",
            "200",
            "--pool-blocks",
            "40",
            "--payload-bytes",
            "256",
            "--policy",
            POLICY,
            "--tier",
            f"{TIER}:capacity_blocks=400",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0, err  # 1 would mean a promoted block came back with other bytes
    result = json.loads(out)
    assert result["policy"] == POLICY
    (tier,) = [t for t in result["tiers"] if t["name"] != "pool"]
    assert tier["kind"] == TIER
    assert tier["hit_blocks"] > 0


@pytest.mark.parametrize(
    ("spec", "entry"),
    [
        (TIER, {"kind": TIER}),
        (f"{TIER}:capacity_blocks=4", {"kind": TIER, "capacity_blocks": 4}),
        ("memory:1GiB", {"kind": "memory", "capacity": "1GiB"}),
    ],
)
def test_tier_spec_with_a_module_path(spec: str, entry: dict[str, Any]) -> None:
    assert parse_tier_spec(spec) == entry


@pytest.mark.parametrize(
    ("kind", "allowed"),
    [
        ("s3", "one of 'memory', 'fs', 'redis' or a tier class given as 'package.module:Class'"),
        ("plugin_examples.no_such_module:S3Tier", "an importable module (No module named"),
        ("plugin_examples.dict_tier:S3Tier", "a class that exists"),
        ("plugin_examples.dict_tier:Options", "a subclass of kvtier.tiers.base:Tier"),
        ("plugin_examples/dict_tier.py:DictTier", "one of 'memory'"),  # no file paths
        ("os:system", "a subclass of kvtier.tiers.base:Tier"),
    ],
)
def test_unknown_or_wrong_tier_kind_is_an_error_naming_the_field(kind: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": [{"kind": "memory"}, {"kind": kind}]})
    assert (info.value.field, info.value.value) == ("tiers[1].kind", kind)
    assert allowed in info.value.allowed


# -- policies ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("eviction", "survivor"), [(POLICY, 0), ("lru", 1)])
def test_out_of_tree_policy_decides_what_the_pool_evicts(
    shm: Path, eviction: str, survivor: int
) -> None:
    """Two slots: store 0 and 1, use 0, store 2. LRU keeps the used block 0; FIFO evicts it."""
    config = load_config({"pool": {"size": 2048, "shm_dir": str(shm)}, "eviction": eviction})
    assert config.eviction == eviction
    pool, cache = factory.build_cache(config, NS, slot_bytes=1024)
    try:
        store(cache, pool, key(0))
        store(cache, pool, key(1))
        cache.touch([key(0)])
        store(cache, pool, key(2))
        assert [cache.lookup([key(i)]).hits for i in (0, 1)] == [survivor, 1 - survivor]
    finally:
        cache.close()
        pool.close()


def test_make_policy_takes_a_module_path_and_passes_the_capacity() -> None:
    policy = make_policy(POLICY, 7)
    assert isinstance(policy, FifoPolicy) and policy.capacity == 7
    assert type(make_policy("lru", 7)).__name__ == "LRUPolicy"  # a constructor without capacity


@pytest.mark.parametrize(
    ("eviction", "allowed"),
    [
        ("fifo", "one of 'lru', 'arc', 'segmented'"),
        ("fifo", "or an eviction policy class given as 'package.module:Class'"),
        ("plugin_examples.fifo_policy:NotAPolicy", "a subclass of kvtier.policies.base:Eviction"),
        ("plugin_examples.nothing:FifoPolicy", "an importable module"),
        (7, "one of 'lru'"),
    ],
)
def test_unknown_or_wrong_policy_is_an_error_naming_the_field(eviction: Any, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config({"eviction": eviction})
    assert (info.value.field, info.value.value) == ("eviction", eviction)
    assert allowed in info.value.allowed


def test_cli_policy_choices_come_from_the_registry(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(POLICIES.entries, "fifo", POLICY)
    code = main(["simulate", "--json", "--no-progress", "--limit", "20", "--policy", "fifo"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["policy"] == "fifo"
    monkeypatch.delitem(POLICIES.entries, "fifo")
    with pytest.raises(SystemExit):
        main(["simulate", "--policy", "fifo"])
    assert "invalid choice: 'fifo'" in capsys.readouterr().err


# -- the registry itself -------------------------------------------------------------------------


def test_register_refuses_bad_names_and_conflicting_targets() -> None:
    registry = Registry("tier", "kvtier.tiers.base:Tier", {"dict": TIER})
    registry.register("dict", TIER)  # the same again: fine
    for name, target in [
        ("dict", "plugin_examples.other:Tier"),  # taken
        ("a:b", TIER),  # a name must not look like a path
        ("", TIER),
        ("other", "not a path"),
    ]:
        with pytest.raises(ValueError):
            registry.register(name, target)
    assert registry.names() == ("dict",)


def test_every_registered_name_is_documented() -> None:
    reference = (ROOT / "docs" / "configuration.md").read_text()
    for name in TIERS:
        assert f"### `kind: {name}`" in reference, name
    for name in POLICIES:
        assert f"`{name}`" in reference.split("| `eviction` |")[1].split("\n")[0], name
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    for name, target in COPY_BACKENDS.entries.items():  # chosen by device, not in the config
        assert f"`{name}` (`{target.split(':')[1]}`)" in architecture, name


def test_registered_targets_resolve_to_their_base_classes() -> None:
    for name in TIERS:
        TIERS.load(name, "kind")
    for name in POLICIES:
        POLICIES.load(name, "eviction")
    COPY_BACKENDS.load("cpu", "copy")  # cuda needs a CUDA build of torch to import
