"""The ``eviction`` option of the fs and memory tiers: the tier's capacity eviction follows the
named policy (built-in or a plugin), never evicts a pinned block and stays within capacity."""

from __future__ import annotations

import json
import random
import threading
from collections.abc import Callable, Container, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from support.blocks import make_keys
from support.drivers import Driver

from kvtier.cli import main
from kvtier.config import load_config
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey, Namespace
from kvtier.policies import ARCPolicy, LRUPolicy, SegmentedPolicy
from kvtier.policies.base import EvictionPolicy
from kvtier.pool import HostPool
from kvtier.tiers import memory
from kvtier.tiers.base import Tier
from kvtier.tiers.block_tier import BlockTier, Got, Put
from kvtier.tiers.fs import options as fs_options
from kvtier.tiers.fs.index import FsIndex
from kvtier.tiers.fs.tier import FsTier
from kvtier.tiers.memory import MemoryTier
from kvtier.tiers.payload import HEADER_BYTES
from kvtier.validation import Section
from tiers.conftest import FILE_BYTES, SLOT_BYTES, MakeTier

FIFO = "plugin_examples.fifo_policy:FifoPolicy"
"""A policy outside kvtier: first in, first out (a hit does not protect a block)."""
MakeAny = Callable[..., BlockTier]


@pytest.fixture
def make_memory(
    pool: HostPool, namespace: Namespace, built_tiers: list[Tier]
) -> Callable[..., MemoryTier]:
    def make(blocks: int, **options: Any) -> MemoryTier:
        tier = MemoryTier("mem", namespace, pool, memory.Options(capacity_blocks=blocks, **options))
        built_tiers.append(tier)
        return tier

    return make


@pytest.fixture(params=["fs", "memory"])
def make_tier(request: pytest.FixtureRequest, make_fs: MakeTier) -> MakeAny:
    """A tier of ``blocks`` blocks of capacity, fs or memory."""
    if request.param == "fs":
        return make_fs
    maker: MakeAny = request.getfixturevalue("make_memory")
    return maker


def evicted_by(tier: BlockTier, scenario: str) -> str:
    """Run a scenario on a tier of 3 blocks; the key the fourth store evicted.

    ``recent``: a, b, c stored, a read, d stored (LRU evicts b, FIFO a).
    ``reused``: a stored and read, b, c, d stored (LRU evicts a; segmented and ARC keep the
    block used twice and evict b)."""
    drive = Driver(tier)
    a, b, c, d = make_keys(4, salt=scenario)
    if scenario == "recent":
        assert all(drive.store(key) for key in (a, b, c))  # one by one: in this order
        assert drive.load_exact(a)
    else:
        assert drive.store(a) and drive.load_exact(a)
        assert drive.store(b) and drive.store(c)
    assert drive.store(d)
    evicted = tier.take_evicted()
    assert len(evicted) == 1 and tier.lookup([d]) == [True]
    return {a: "a", b: "b", c: "c", d: "d"}[evicted[0]]


@pytest.mark.parametrize(
    ("eviction", "scenario", "victim"),
    [
        ("lru", "recent", "b"),
        (FIFO, "recent", "a"),  # a plugin by module path: differs from LRU here
        ("lru", "reused", "a"),
        ("segmented", "reused", "b"),
        ("arc", "reused", "b"),
    ],
)
def test_the_tier_evicts_in_its_policys_order(
    make_tier: MakeAny, eviction: str, scenario: str, victim: str
) -> None:
    assert evicted_by(make_tier(3, eviction=eviction), scenario) == victim


def test_the_default_is_lru(make_tier: MakeAny) -> None:
    assert evicted_by(make_tier(3), "reused") == "a"


def ranked(tier: BlockTier) -> int:
    """Blocks the tier's policy ranks (for the fs tier, with the rescan's unused files)."""
    if isinstance(tier, FsTier):
        return len(tier._index.policy) + len(tier._index.unused)
    assert isinstance(tier, MemoryTier) and tier._policy is not None
    return len(tier._policy)


@pytest.mark.parametrize("eviction", ["lru", "segmented", "arc", "hinted", FIFO])
def test_capacity_stays_bounded_and_the_policy_tracks_every_block(
    make_tier: MakeAny, eviction: str
) -> None:
    tier = make_tier(7, eviction=eviction)
    drive = Driver(tier)
    keys = make_keys(30)
    rng = random.Random(7)
    for _ in range(150):
        key = rng.choice(keys)
        if tier.lookup([key]) == [True] and rng.random() < 0.5:
            assert drive.load_exact(key)
        else:
            assert drive.store(key)
        assert tier.used_bytes <= 7 * FILE_BYTES and len(tier) <= 7
    assert ranked(tier) == len(tier) == 7
    assert tier.counters.evictions == len(tier.take_evicted()) > 0


# -- pins -----------------------------------------------------------------------------------------


@contextmanager
def read_held(tier: BlockTier, key: BlockKey, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A read of ``key`` in flight (so ``key`` is pinned) until the block exits; its own driver
    on another thread, so the test's stores below go straight to ``put``."""
    reading, release = threading.Event(), threading.Event()
    real_get = tier.get

    def slow_get(k: BlockKey, header: memoryview, payload: memoryview) -> Got:
        if k == key:
            reading.set()
            assert release.wait(10)
        return real_get(k, header, payload)

    monkeypatch.setattr(tier, "get", slow_get)
    results: list[list[bool]] = []
    reader = threading.Thread(target=lambda: results.append(Driver(tier).read([key], [30])))
    reader.start()
    assert reading.wait(10)
    try:
        yield
    finally:
        release.set()
        reader.join(10)
    assert results == [[True]]


def put(tier: BlockTier, key: BlockKey) -> Put:
    return tier.put(key, bytes(HEADER_BYTES), memoryview(bytearray(SLOT_BYTES)))


@pytest.mark.parametrize("eviction", ["segmented", "arc", FIFO])
def test_a_pinned_block_is_never_evicted(
    make_tier: MakeAny, eviction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(2, eviction=eviction)
    a, b, c, d = make_keys(4)
    drive = Driver(tier)
    assert drive.store(a) and drive.store(b)  # a is every policy's first victim
    with read_held(tier, a, monkeypatch):
        assert put(tier, c) is Put.STORED  # b goes, not a
        assert put(tier, d) is Put.STORED  # c goes
        assert tier.take_evicted() == [b, c]
    assert tier.lookup([a, b, c, d]) == [True, False, False, True]


def test_all_pinned_is_rejected_and_evicts_nothing(
    make_tier: MakeAny, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_tier(1, eviction="segmented")
    a, b = make_keys(2)
    assert Driver(tier).store(a)
    with read_held(tier, a, monkeypatch):
        assert put(tier, b) is Put.REJECTED
    assert tier.take_evicted() == [] and tier.lookup([a, b]) == [True, False]
    assert Driver(tier).store(b) and tier.take_evicted() == [a]  # unpinned again: evicted


def k(i: int) -> BlockKey:
    return i.to_bytes(16, "big")


@pytest.mark.parametrize("make", [LRUPolicy, SegmentedPolicy, ARCPolicy])
def test_the_index_never_chooses_a_pinned_block(make: Callable[..., EvictionPolicy]) -> None:
    policy = make() if make is LRUPolicy else make(4)
    pins: dict[BlockKey, int] = {}
    index = FsIndex(4 * 100, pins, policy)
    for i in range(4):
        reservation = index.reserve(100)
        assert reservation == ([], 100)
        index.commit(k(i), 100, 100)
    pins.update({k(0): 1, k(1): 1, k(3): 1})
    victims, reserved = index.reserve(100) or ([], 0)
    assert victims == [(k(2), 100)] and reserved == 100
    index.commit(k(4), 100, 100)
    pins[k(4)] = 1
    assert index.reserve(100) is None  # every block pinned: nothing chosen, nothing lost
    assert index.pick_victims(1000) == []
    assert len(policy) == len(index) == 4 and index.used == 400
    pins.clear()
    assert sorted(key for key, _ in index.pick_victims(1000)) == [k(0), k(1), k(3), k(4)]
    assert len(policy) == len(index) == 0


class Stubborn(LRUPolicy):
    """Breaks the contract: offers the pinned blocks too."""

    def evict(self, n: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        return super().evict(n, ())


def test_a_policy_offering_a_pinned_block_does_not_get_it_evicted() -> None:
    pins: dict[BlockKey, int] = {k(0): 1}
    index = FsIndex(200, pins, Stubborn())
    for i in range(2):
        index.reserve(100)
        index.commit(k(i), 100, 100)
    # It offers k(0) first: not taken, ranked again; the write gets no room this time.
    assert index.reserve(100) == ([], 0)
    assert index.used == 200 and len(index.policy) == len(index) == 2
    assert index.reserve(100) == ([(k(1), 100)], 100)
    assert k(0) in index.entries and len(index.policy) == 1


def test_a_memory_tier_rejects_a_store_when_its_policy_offers_only_a_pinned_block(
    make_memory: Callable[..., MemoryTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = make_memory(2)
    a, b, c = make_keys(3)
    drive = Driver(tier)
    assert drive.store(a) and drive.store(b)
    stubborn = Stubborn()
    for key in (a, b):
        stubborn.insert(key)
    monkeypatch.setattr(tier, "_policy", stubborn)
    with read_held(tier, a, monkeypatch):
        assert put(tier, c) is Put.REJECTED  # a offered, not taken (ranked again): no room
        assert tier.take_evicted() == []
        assert put(tier, c) is Put.STORED  # b offered next
        assert tier.take_evicted() == [b]
    assert tier.lookup([a, b, c]) == [True, False, True] and len(stubborn) == 2


def test_files_a_rescan_finds_go_first_until_used() -> None:
    index = FsIndex(400, {}, ARCPolicy(4))
    index.load([(k(0), 100, 1.0), (k(1), 100, 0.5)])  # oldest first into the policy
    assert index.policy.coldest(2) == [k(1), k(0)]
    assert index.merge_scan({k(0): (100, 1.0), k(1): (100, 0.5), k(2): (100, 3.0)}, 0) == (1, [])
    assert index.merge_scan({**{k(i): (100, 1.0) for i in range(3)}, k(3): (100, 2.0)}, 0) == (
        1,
        [],
    )
    assert list(index.unused) == [k(3), k(2)]  # each rescan's files ahead of the last one's
    assert index.touch(k(2))  # used here: now the policy's
    assert list(index.unused) == [k(3)] and len(index.policy) == 3
    forgotten: list[bytes] = []
    index._forgotten = forgotten.append
    # k(3) goes first but is another process's file: forgotten, not handed over for deletion.
    assert [key for key, _ in index.pick_victims(200)] == [k(1)]
    assert forgotten == [k(3)] and k(3) not in index.entries
    assert index.used == 300  # k(3) uncounted at once; k(1) counted until its file is gone


# -- the option -----------------------------------------------------------------------------------


def fs_section(**extra: object) -> Section:
    return Section({"path": "/kv", "capacity": "1GiB", **extra}, "tiers[1]")


@pytest.mark.parametrize("name", ["lru", "arc", "segmented", "hinted", FIFO])
def test_the_option_takes_the_top_level_names(name: str) -> None:
    assert fs_options.Options.parse(fs_section(eviction=name)).eviction == name
    mem = memory.Options.parse(Section({"capacity_blocks": 4, "eviction": name}, "tiers[0]"))
    assert mem.eviction == name
    assert fs_options.Options.parse(fs_section()).eviction == "lru"


@pytest.mark.parametrize(
    "value",
    [
        "lfu",
        "",
        3,
        None,
        ["lru"],
        "no_such_module:Policy",
        "plugin_examples.fifo_policy:Missing",
        "plugin_examples.fifo_policy:NotAPolicy",
    ],
)
def test_a_bad_policy_is_a_config_error_naming_the_field(value: object) -> None:
    with pytest.raises(ConfigError) as info:
        fs_options.Options.parse(fs_section(eviction=value))
    assert info.value.field == "tiers[1].eviction"
    with pytest.raises(ConfigError) as info:
        memory.Options.parse(Section({"capacity": "1MiB", "eviction": value}, "tiers[2]"))
    assert info.value.field == "tiers[2].eviction"


def test_a_config_names_the_tier_in_the_error(tmp_path: Path) -> None:
    tier = {"kind": "fs", "path": str(tmp_path), "capacity": "1GiB", "eviction": "lfu"}
    with pytest.raises(ConfigError) as info:
        load_config({"tiers": [{"kind": "memory"}, tier]})
    assert info.value.field == "tiers[1].eviction" and "'segmented'" in str(info.value)


def test_an_unbounded_memory_tier_refuses_a_policy() -> None:
    with pytest.raises(ConfigError) as info:
        memory.Options.parse(Section({"eviction": "arc"}, "tiers[0]"))
    assert info.value.field == "tiers[0].eviction" and "capacity" in info.value.allowed
    assert memory.Options.parse(Section({}, "tiers[0]")).eviction == "lru"


def test_memory_policy_is_sized_by_the_tightest_limit(pool: HostPool, namespace: Namespace) -> None:
    options = memory.Options(capacity=10 * SLOT_BYTES, capacity_blocks=20, eviction="arc")
    tier = MemoryTier("mem", namespace, pool, options)
    try:
        assert isinstance(tier._policy, ARCPolicy) and tier._policy.capacity == 10
    finally:
        tier.close()
    tier = MemoryTier("mem", namespace, pool, memory.Options())
    try:
        assert tier._policy is None  # unbounded: nothing to rank
    finally:
        tier.close()


def test_fs_policy_is_sized_in_blocks(make_fs: MakeTier) -> None:
    tier = make_fs(blocks=12.5, eviction="segmented")
    assert isinstance(tier._index.policy, SegmentedPolicy)
    assert tier._index.policy.capacity == 12


# -- kvtier simulate ------------------------------------------------------------------------------


def simulate_fs(capsys: pytest.CaptureFixture[str], path: Path, eviction: str) -> dict[str, Any]:
    spec = f"fs:path={path / eviction},capacity=16GiB,eviction={eviction}"  # 256 blocks
    args = ["--json", "--no-progress", "--limit", "600", "--pool-blocks", "50", "--tier", spec]
    code = main(["simulate", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    return next(t for t in result["tiers"] if t["name"] == "fs")


def test_simulate_takes_the_option_in_a_tier_spec(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    lru = simulate_fs(capsys, tmp_path, "lru")
    segmented = simulate_fs(capsys, tmp_path, "segmented")
    assert lru["hit_blocks"] != segmented["hit_blocks"]
    code = main(
        ["simulate", "--no-progress", "--tier", f"fs:path={tmp_path},capacity=1GiB,eviction=lfu"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "tiers[0].eviction='lfu'" in err


def test_a_tier_built_without_parse_checks_the_name_too(
    pool: HostPool, namespace: Namespace, tmp_path: Path
) -> None:
    options = fs_options.Options(str(tmp_path), 4 * FILE_BYTES, eviction="lfu", config_path="t")
    with pytest.raises(ConfigError) as info:
        FsTier("disk", namespace, pool, options)
    assert info.value.field == "t.eviction"
    assert not list(tmp_path.iterdir())  # failed before touching the directory
