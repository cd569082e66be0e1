"""Tiers and policies outside kvtier, named by module path in config and on the command line.

The parts live in ``tests/plugin_examples`` (on the Python path as ``plugin_examples``) and use
only kvtier's public interfaces, as a package installed next to kvtier would.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from plugin_examples import broken_modules
from plugin_examples.dict_tier import DictTier
from plugin_examples.fifo_policy import FifoPolicy

from kvtier.cache import factory
from kvtier.cli import main, parse_tier_spec
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.keys import Namespace
from kvtier.policies import GuardedPolicy, make_policy
from kvtier.registry import COPY_BACKENDS, POLICIES, TIERS, Registry, declared

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


@pytest.mark.parametrize(
    "kind",
    ["plugin_examples.box_tier:BoxTier", "plugin_examples.box_tier.tier:BoxTier", "box_tier"],
)
def test_a_tier_written_as_a_package_loads_by_class_path_and_by_name(
    kind: str, shm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # By name: a registry over ``plugin_examples`` (as TIERS is over ``kvtier.tiers``) lists the
    # package ``box_tier/`` by the class its module ``tier.py`` declares.
    plugins = Registry("tier", "kvtier.tiers.base:Tier", "plugin_examples")
    assert plugins.entries["box_tier"] == "plugin_examples.box_tier.tier:BoxTier"
    monkeypatch.setitem(TIERS.entries, "box_tier", plugins.entries["box_tier"])
    config = load_config(
        {"pool": {"size": 2048, "shm_dir": str(shm)}, "tiers": [{"kind": kind, "boxes": 2}]}
    )
    assert config.tiers[0].name == ("BoxTier" if ":" in kind else "box_tier")
    pool, cache = factory.build_cache(config, NS, slot_bytes=1024)
    try:
        tier = DictTier.instances[-1]
        assert type(tier).__name__ == "BoxTier" and tier.boxes == 2  # type: ignore[attr-defined]
        for i in range(4):
            store(cache, pool, key(i))
        assert list(tier.blocks) == [key(2), key(3)]  # its own options reached it
    finally:
        cache.close()
        pool.close()


@pytest.mark.parametrize(
    ("kind", "target"),
    [
        ("fs", "kvtier.tiers.fs.tier:FsTier"),
        ("redis", "kvtier.tiers.redis.tier:RedisTier"),
        ("memory", "kvtier.tiers.memory:MemoryTier"),
    ],
)
def test_a_built_in_tier_package_loads_by_name_and_by_class_path(kind: str, target: str) -> None:
    assert TIERS.entries[kind] == target
    by_name = TIERS.load(kind, "kind")
    assert by_name.kind == kind
    package_path = target.rpartition(".")[0] if kind != "memory" else target.partition(":")[0]
    assert TIERS.load(target, "kind") is by_name
    assert TIERS.load(f"{package_path}:{by_name.__name__}", "kind") is by_name


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
        ("s3", "one of 'fs', 'memory', 'redis' or a tier class given as 'package.module:Class'"),
        ("plugin_examples.no_such_module:S3Tier", "an importable module (No module named"),
        ("plugin_examples.dict_tier:S3Tier", "a class that exists"),
        ("plugin_examples.dict_tier:Options", "a subclass of kvtier.tiers.base:Tier"),
        ("plugin_examples/dict_tier.py:DictTier", "one of 'fs', 'memory'"),  # no file paths
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
    assert isinstance(policy, GuardedPolicy)  # a plugin runs behind the boundary
    assert isinstance(policy.policy, FifoPolicy) and policy.policy.capacity == 7
    assert type(make_policy("lru", 7)).__name__ == "LRUPolicy"  # a constructor without capacity


@pytest.mark.parametrize(
    ("eviction", "allowed"),
    [
        ("fifo", "one of 'arc', 'hinted', 'lru', 'segmented'"),
        ("fifo", "or an eviction policy class given as 'package.module:Class'"),
        ("plugin_examples.fifo_policy:NotAPolicy", "a subclass of kvtier.policies.base:Eviction"),
        ("plugin_examples.nothing:FifoPolicy", "an importable module"),
        (7, "one of 'arc'"),
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
    registry = Registry("tier", "kvtier.tiers.base:Tier", "plugin_examples")  # box_tier only
    registry.register("dict", TIER)
    registry.register("dict", TIER)  # the same again: fine
    for name, target in [
        ("dict", "plugin_examples.other:Tier"),  # taken
        ("a:b", TIER),  # a name must not look like a path
        ("", TIER),
        ("other", "not a path"),
    ]:
        with pytest.raises(ValueError):
            registry.register(name, target)
    assert registry.names() == ("box_tier", "dict")


def _declaring_modules(package: str) -> dict[str, str]:
    """What the registry should find, found the other way: import every module of ``package``
    (and of each package in it) and keep the classes that declare the name of the module (or of
    the package holding it) as ``kind`` (a module that needs a missing dependency, such as the
    CUDA backend on a CPU build, is left out)."""
    found = {}
    for info in pkgutil.iter_modules(importlib.import_module(package).__path__):
        names = [f"{package}.{info.name}"]
        if info.ispkg:
            try:
                inner = importlib.import_module(names[0]).__path__
            except ImportError:
                continue
            names += [f"{names[0]}.{part.name}" for part in pkgutil.iter_modules(inner)]
        for module_name in names:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                continue
            for cls in vars(module).values():
                declares = isinstance(cls, type) and vars(cls).get("kind") == info.name
                if declares and cls.__module__ == module.__name__:
                    found[info.name] = f"{module.__name__}:{cls.__name__}"
    return found


@pytest.mark.parametrize("registry", [TIERS, POLICIES, COPY_BACKENDS], ids=lambda r: r.what)
def test_every_module_that_declares_its_kind_is_listed_and_resolves(registry: Registry) -> None:
    imported = _declaring_modules(registry.package)
    assert imported, registry.package
    assert {n: t for n, t in registry.entries.items() if n in imported} == imported
    missing = set(registry.entries) - set(imported)
    assert missing <= {"cuda"}  # cuda needs a CUDA build of torch to import
    for name, target in imported.items():
        cls = registry.load(name, "kind")
        assert cls.kind == name
        assert cls.__module__.partition(".")[0] == "kvtier"
        assert f"{cls.__module__}.".startswith(f"{registry.package}.{name}.")
        assert f"{cls.__module__}:{cls.__qualname__}" == target
    assert list(registry.entries) == sorted(registry.entries)
    assert declared("kvtier.policies")["segmented"].endswith(":SegmentedPolicy")  # not the base


def _listed_in_row(reference: str, key: str) -> list[str]:
    """The plain names in the second cell of the table row of ``key`` (``\\|`` separates them)."""
    (row,) = [line for line in reference.splitlines() if line.startswith(f"| `{key}` |")]
    cells = re.split(r"(?<!\\)\|", row)
    return sorted(re.findall(r"`(\w+)`", cells[2]))


def test_documented_names_are_the_listed_names() -> None:
    reference = (ROOT / "docs" / "configuration.md").read_text()
    tier_sections = re.findall(r"^### `kind: (\w+)`", reference, re.MULTILINE)
    assert sorted(tier_sections) == list(TIERS.names())
    assert _listed_in_row(reference, "kind") == list(TIERS.names())
    assert _listed_in_row(reference, "eviction") == list(POLICIES.names())
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    for name, target in COPY_BACKENDS.entries.items():  # chosen by device, not in the config
        assert f"`{name}` (`{target.split(':')[1]}`)" in architecture, name


def test_names_are_listed_without_importing_the_parts_or_the_redis_client() -> None:
    code = textwrap.dedent(
        """
        import sys
        sys.modules["redis"] = None  # the optional client is not installed
        from kvtier.errors import ConfigError
        from kvtier.registry import POLICIES, TIERS
        print(TIERS.names(), POLICIES.names())
        print(sorted(m for m in sys.modules if m.startswith("kvtier.tiers.")))
        TIERS.load("memory", "kind")
        try:
            TIERS.load("redis", "tiers[0].kind")
        except ConfigError as exc:
            print(exc)
        """
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    names, imported, error = run.stdout.splitlines()
    assert names == "('fs', 'memory', 'redis') ('arc', 'hinted', 'lru', 'segmented')"
    assert imported == "['kvtier.tiers.base']"  # the package's own import, no tier module
    assert error.startswith("invalid config tiers[0].kind='redis': its dependency is not installed")


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty package ``kvtier_registry_test_parts`` on the Python path (a new one per test:
    what an earlier test imported from its namesake is forgotten)."""
    directory = tmp_path / "kvtier_registry_test_parts"
    directory.mkdir()
    (directory / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    _forget_modules(directory.name)
    yield directory
    _forget_modules(directory.name)


def _forget_modules(package: str) -> None:
    for name in [m for m in sys.modules if m == package or m.startswith(f"{package}.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


def test_a_module_declares_its_own_name_once(package: Path) -> None:
    (package / "fifo.py").write_text(
        'class Base:\n    kind = "other"\n\n\nclass Fifo(Base):\n    kind: str = "fifo"\n'
    )
    (package / "base.py").write_text('class Shared:\n    kind = "fifo"  # not its module\n')
    (package / "helpers.py").write_text('def kind_of():\n    kind = "helpers"\n    return kind\n')
    (package / "_private.py").write_text('class Hidden:\n    kind = "_private"\n')
    assert declared(package.name) == {"fifo": f"{package.name}.fifo:Fifo"}
    (package / "twice.py").write_text(
        'class A:\n    kind = "twice"\n\n\nclass B:\n    kind = "twice"\n'
    )
    twice = r"\['\w+\.twice:A', '\w+\.twice:B'\] all declare kind 'twice'"
    with pytest.raises(ValueError, match=twice):
        declared(package.name)


def test_a_package_declares_its_name_in_its_init_or_in_one_module(package: Path) -> None:
    (package / "boxed").mkdir()
    (package / "boxed" / "__init__.py").write_text('class Boxed:\n    kind = "boxed"\n')
    (package / "split").mkdir()
    (package / "split" / "__init__.py").write_text("from .impl import Split\n")
    (package / "split" / "impl.py").write_text('class Split:\n    kind = "split"\n')
    (package / "split" / "helpers.py").write_text('class Helper:\n    kind = "helpers"\n')
    (package / "loose").mkdir()  # a folder without __init__.py is no package: not listed
    (package / "loose" / "impl.py").write_text('class Loose:\n    kind = "loose"\n')
    (package / "_hidden").mkdir()
    (package / "_hidden" / "__init__.py").write_text('class Hidden:\n    kind = "_hidden"\n')
    assert declared(package.name) == {
        "boxed": f"{package.name}.boxed:Boxed",
        "split": f"{package.name}.split.impl:Split",
    }
    (package / "split" / "other.py").write_text('class Again:\n    kind = "split"\n')
    with pytest.raises(ValueError, match=r"split\.impl:Split', '\S+split\.other:Again'\]"):
        declared(package.name)


# -- hostile plugins at load time: one ConfigError naming the field, never a traceback ----------


@pytest.fixture
def hostile(package: Path) -> str:
    """``package`` with the modules of ``broken_modules``; returns the package name."""
    broken_modules.write_package(package)
    return package.name


def _config_error(config: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(config)
    return info.value


@pytest.mark.parametrize("module", list(broken_modules.SOURCES))
def test_a_module_that_fails_to_import_is_a_config_error(hostile: str, module: str) -> None:
    """Before: a traceback (RuntimeError, RecursionError, SyntaxError), or for ``sys.exit(7)``
    kvtier ending silently with exit code 7."""
    tier = _config_error({"tiers": [{"kind": f"{hostile}.{module}:Tier"}]})
    assert tier.field == "tiers[0].kind"
    assert "an importable module" in tier.allowed or "a class that exists" in tier.allowed
    policy = _config_error({"eviction": f"{hostile}.{module}:Policy"})
    assert policy.field == "eviction"
    assert len(str(tier)) < 1000 and len(str(policy)) < 1000


def test_a_module_that_exits_at_import_fails_check_config_with_one_line(
    hostile: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"eviction: {hostile}.exits:Policy\n")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtier: error: invalid config eviction=") and err.count("\n") == 1
    assert "SystemExit: 7" in err


def test_an_interrupt_during_import_is_not_swallowed(package: Path) -> None:
    """Ctrl-C while a slow plugin imports stops kvtier as it would anywhere else: turning it into
    a config error would report a good config as bad and keep a process running that was asked
    to stop."""
    (package / "interrupted.py").write_text("raise KeyboardInterrupt\n")
    with pytest.raises(KeyboardInterrupt):
        load_config({"eviction": f"{package.name}.interrupted:Policy"})


@pytest.mark.parametrize(
    ("name", "allowed"),
    [
        (".".join(["a"] * 300) + ":C", "at most 200 characters (got 601)"),
        (".".join(["a"] * 99) + ":C", "at most 16 dotted parts (got 100)"),
        ("a.b:" + ".".join(["C"] * 40), "at most 16 dotted parts"),
        ("m" * 1_000_000 + ":C", "at most 200 characters (got 1,000,002)"),
        ("plugin_examples.dict_tier:DictTier\n", "one of 'fs'"),  # ``$`` matches before "\n"
        ("plugin_examples.dict_tier:DictTier\x1b[31m", "one of 'fs'"),
        ("plugin_examples.dïct_tier:DictTier", "one of 'fs'"),
    ],
    ids=["300 parts", "100 parts", "40 attributes", "1 MB", "newline", "escape", "unicode"],
)
def test_a_name_is_checked_before_anything_is_imported(name: str, allowed: str) -> None:
    """Before: a 300-part name gave ``RecursionError``, a 1 MB name a 1 MB error line."""
    error = _config_error({"tiers": [{"kind": name}]})
    assert error.field == "tiers[0].kind" and allowed in error.allowed
    assert len(str(error)) < 1000


@pytest.mark.parametrize(
    ("config", "field", "allowed"),
    [
        (
            {"eviction": "kvtier.policies.base:EvictionPolicy"},
            "eviction",
            "a class that can be built (abstract methods:",
        ),
        (
            {"tiers": [{"kind": "kvtier.tiers.base:Tier"}]},
            "tiers[0].kind",
            "a class that can be built (abstract methods:",
        ),
        (
            {"tiers": [{"kind": "plugin_examples.hostile:TierWithoutOptions"}]},
            "tiers[0].kind",
            "a tier class with an Options record that has parse(section)",
        ),
        (
            {"tiers": [{"kind": "plugin_examples.hostile:TierWithFailingOptions"}]},
            "tiers[0].kind",
            "a tier whose Options.parse works (RuntimeError: cannot read my own options)",
        ),
    ],
)
def test_a_class_that_cannot_be_built_fails_at_load_time(
    config: dict[str, Any], field: str, allowed: str
) -> None:
    """Before: ``eviction: kvtier.policies.base:EvictionPolicy`` passed ``check-config`` and
    simulate failed with ``TypeError: Can't instantiate abstract class``; ``kind:
    kvtier.tiers.base:Tier`` gave ``TypeError: tier class Tier has no Options.parse``."""
    error = _config_error(config)
    assert error.field == field and allowed in error.allowed


def test_a_plugin_that_fails_when_built_is_a_config_error(shm: Path) -> None:
    for config, field in [
        ({"eviction": "plugin_examples.hostile:PolicyFailingToBuild"}, "eviction"),
        ({"tiers": [{"kind": "plugin_examples.hostile:TierFailingToBuild"}]}, "tiers[0].kind"),
        ({"tiers": [{"kind": "plugin_examples.hostile:TierWithoutCounters"}]}, "tiers[0].kind"),
    ]:
        loaded = load_config({"pool": {"size": 2048, "shm_dir": str(shm)}, **config})
        with pytest.raises(ConfigError) as info:
            factory.build_cache(loaded, NS, slot_bytes=1024)
        assert info.value.field == field, config
        assert list(shm.iterdir()) == []  # the pool was closed again
