"""Two processes on one fs directory with different capacities (two ``FsTier`` instances stand for
them): the smaller one never deletes the larger one's files to stay within its own capacity. Files
a rescan found are another process's, counted against its capacity: when room is needed they are
forgotten (left on disk, uncounted), never deleted."""

from __future__ import annotations

import os
from pathlib import Path

from plugin_examples.hostile import HostilePolicy
from support.blocks import make_keys
from support.drivers import Driver

from kvtier.policies import GuardedPolicy
from kvtier.tiers.fs.tier import FsTier
from tiers.conftest import FILE_BYTES, MakeTier


def block_file(tier: FsTier, key: bytes) -> Path:
    return Path(tier.root) / key.hex()[:2] / f"{key.hex()}.kvb"


def files(tier: FsTier) -> list[Path]:
    return sorted(p for p in Path(tier.root).glob("*/*.kvb") if p.is_file())


def _store_aged(tier: FsTier, keys: list[bytes], first_mtime: int) -> None:
    """Store ``keys`` with distinct, increasing file times (whatever the clock's resolution)."""
    drive = Driver(tier)
    for i, key in enumerate(keys):
        assert drive.store(key)
        os.utime(block_file(tier, key), (first_mtime + i, first_mtime + i))


def test_the_smaller_tier_never_deletes_the_larger_ones_files(make_fs: MakeTier) -> None:
    """Before: after a rescan, each write of the smaller tier deleted one of the larger tier's
    files (the rescan's files were its first victims)."""
    small = make_fs(blocks=3)
    large = make_fs(blocks=20)
    theirs = make_keys(8, salt="large")
    _store_aged(large, theirs, 1_000_000)
    assert small.rescan().result(timeout=10) == 3  # the newest 3: all its capacity
    assert small.lookup(theirs) == [False] * 5 + [True] * 3
    assert Driver(small).load_exact(theirs[-1])  # used here: ranked by its policy now
    mine = make_keys(6, salt="small")
    for key in mine:
        assert Driver(small).store(key)
        assert small.used_bytes <= small.capacity
        assert all(block_file(large, key).exists() for key in theirs)
        assert small.rescan().result(timeout=10) >= 0
    assert small.lookup(mine) == [False] * 3 + [True] * 3  # its own blocks: evicted as usual
    assert not any(block_file(small, key).exists() for key in mine[:3])
    assert Driver(large).load_exact(theirs) == [True] * len(theirs)
    assert small.counters.evictions == 3  # only its own files
    assert sorted(small.take_evicted()) == sorted(theirs[-3:] + mine[:3])


def test_a_tier_starting_beside_a_larger_one_deletes_none_of_its_files(
    make_fs: MakeTier,
) -> None:
    """Before: the first listing indexed every file and evicted down to capacity at once."""
    large = make_fs(blocks=20)
    theirs = make_keys(8, salt="large")
    _store_aged(large, theirs, 1_000_000)
    small = make_fs(blocks=2.5)
    assert small.lookup(theirs) == [False] * 6 + [True] * 2  # the newest that fit
    assert small.used_bytes == 2 * FILE_BYTES
    assert len(files(large)) == len(theirs)
    assert small.take_evicted() == []
    assert Driver(large).load_exact(theirs) == [True] * len(theirs)


def test_disk_full_evicts_only_own_files(make_fs: MakeTier) -> None:
    """Room made for a write comes from this tier's own files; another's rescanned files are
    only forgotten (the write then fails for want of room rather than delete them)."""
    small = make_fs(blocks=2)
    large = make_fs(blocks=20)
    theirs = make_keys(4, salt="large")
    _store_aged(large, theirs, 1_000_000)
    assert small.rescan().result(timeout=10) == 2
    victims = small._index.pick_victims(2 * FILE_BYTES)
    assert victims == []  # nothing of its own to delete
    assert small.used_bytes == 0 and small.lookup(theirs) == [False] * 4
    assert all(block_file(large, key).exists() for key in theirs)


def test_a_plugin_policy_failing_in_an_fs_tier_is_counted_in_its_errors(
    make_fs: MakeTier,
) -> None:
    """A tier's own eviction policy from outside kvtier that raises in every call: the tier
    stays within its capacity (the guard's order picks victims) and counts the failures."""
    tier = make_fs(blocks=3, eviction="plugin_examples.hostile:HostilePolicy")
    policy = tier._index.policy
    assert isinstance(policy, GuardedPolicy)
    inner = policy.policy
    assert isinstance(inner, HostilePolicy)
    inner.fail = {"insert", "access", "remove", "evict", "coldest"}
    mine = make_keys(8, salt="mine")
    for key in mine:
        assert Driver(tier).store(key)
        assert tier.used_bytes <= tier.capacity
    assert tier.lookup(mine) == [False] * 5 + [True] * 3
    assert tier.counters.errors >= 8 and tier.counters.errors == policy.errors
