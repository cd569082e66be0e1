"""A pool shared by several engines (``pool.share``): hits across engines, namespaces apart,
eviction and pins, the lock's bounds, repair after a holder died inside it, config errors.

Two caches in one process have two open file descriptions, so they exclude each other as two
processes do; ``test_shared_pool_processes.py`` runs real processes."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from support.shared_engine import (
    NAMESPACE,
    SLOT_BYTES,
    Served,
    open_cache,
    payload,
    prompt_keys,
    serve,
)

from kvtier.cache.factory import build_cache
from kvtier.config import load_config
from kvtier.errors import ConfigError, PoolError
from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.shared_pool import locks, table
from kvtier.shared_pool.layout import H_DIRTY, H_REPAIRS, MAX_ENGINES, WRITING
from kvtier.shared_pool.segment import TRAILER_BYTES, open_shared, segment_name


@pytest.fixture
def two(tmp_path):
    a = open_cache(str(tmp_path), 16)
    b = open_cache(str(tmp_path), 16)
    yield a, b
    for pool, cache in (b, a):
        cache.close()
        pool.close()
    assert list(tmp_path.iterdir()) == []  # the last engine out removed the file


def test_a_block_stored_by_one_engine_is_a_hit_for_the_other(two):
    (pool_a, a), (pool_b, b) = two
    assert pool_a.handle.path == pool_b.handle.path
    served_a, served_b = Served(), Served()
    serve(pool_a, a, prompt=1, blocks=4, served=served_a)
    assert served_a.stored_blocks == 4 and served_a.hit_blocks == 0
    serve(pool_b, b, prompt=1, blocks=6, served=served_b)
    assert served_b.hit_blocks == 4 and served_b.wrong == 0  # bytes identical
    assert served_b.stored_blocks == 2
    share_a, share_b = a.engine_share(), b.engine_share()
    assert share_a is not None and share_b is not None
    assert (share_b.hits_others, share_b.hits_own, share_b.stored) == (4, 0, 2)
    assert (share_a.stored, share_a.held) == (4, 4)
    serve(pool_a, a, prompt=1, blocks=6, served=served_a)
    share_a = a.engine_share()
    assert share_a is not None and (share_a.hits_own, share_a.hits_others) == (4, 2)
    assert b.stats().pool_used == 6
    a.check_invariants(settled=True)


def test_stats_carry_the_engines_line_and_keep_it_after_close(tmp_path):
    """The stats file (``vllm.stats_path``) is written from ``stats()`` once more after the cache
    closed: it must still say what this engine did in the shared pool."""
    pool_a, a = open_cache(str(tmp_path), 16)
    pool_b, b = open_cache(str(tmp_path), 16)
    serve(pool_a, a, prompt=1, blocks=3, served=Served())
    serve(pool_b, b, prompt=1, blocks=5, served=Served())
    before = b.stats().to_dict()["share"]
    assert (before["hits_others"], before["hits_own"], before["stored"]) == (3, 0, 2)
    b.close()
    after = b.stats()
    assert after.share is not None and after.share.hits_others == 3 and after.share.stored == 2
    assert after.pool_used == 5  # as it was when B left (its index is unmapped then)
    assert a.stats().share is not None and a.stats().share.stored == 3
    pool_b.close()
    a.close()
    pool_a.close()


def test_a_private_pool_has_no_share_line(tmp_path):
    config = load_config({"pool": {"size": 4 * SLOT_BYTES, "shm_dir": str(tmp_path)}})
    pool, cache = build_cache(config, NAMESPACE, SLOT_BYTES)
    try:
        assert cache.stats().share is None and cache.stats().to_dict()["share"] is None
    finally:
        cache.close()
        pool.close()


def test_a_block_being_written_is_no_hit_and_is_not_stored_twice(two):
    (_, a), (_, b) = two
    keys = prompt_keys(2, 3)
    reservation = a.prepare_store(keys)
    assert len(reservation.keys) == 3
    assert b.lookup(keys).hits == 0
    assert b.prepare_store(keys).keys == []  # A is writing them
    assert b.prepare_load(keys) == []
    a.complete_store(keys[:2], True)
    a.complete_store(keys[2:], False)  # a failed copy frees its slot
    assert b.lookup(keys).hits == 2
    assert b.prepare_store(keys).keys == [keys[2]]
    b.check_invariants()


def test_namespaces_never_see_each_others_blocks(tmp_path):
    other = Namespace(model="shared-test", dtype="bfloat16", block_tokens=4)
    config = load_config(
        {"pool": {"size": 8 * SLOT_BYTES, "shm_dir": str(tmp_path), "share": "test"}}
    )
    pool_a, a = open_cache(str(tmp_path), 8)
    pool_o, o = build_cache(config, other, SLOT_BYTES)
    assert pool_a.handle.path != pool_o.handle.path
    keys = prompt_keys(3, 2)
    a.complete_store(a.prepare_store(keys).keys, True)
    assert o.lookup(keys).hits == 0
    assert o.lookup(prompt_keys(3, 2, other)).hits == 0
    for pool, cache in ((pool_o, o), (pool_a, a)):
        cache.close()
        pool.close()
    assert list(tmp_path.iterdir()) == []


def test_eviction_takes_the_least_recently_used_unpinned_blocks(tmp_path):
    (pool_a, a), (pool_b, b) = open_cache(str(tmp_path), 4), open_cache(str(tmp_path), 4)
    old, new = prompt_keys(4, 2), prompt_keys(5, 2)
    a.complete_store(a.prepare_store(old).keys, True)
    a.complete_store(a.prepare_store(new).keys, True)
    b.touch(old)  # old is now the more recently used
    pinned = b.prepare_load(old[:1])
    more = prompt_keys(6, 3)
    got = b.prepare_store(more)
    assert got.keys == more[:3]  # new's two blocks and old[1]: old[0] is pinned
    assert a.lookup(old).hits == 1 and a.lookup(new).hits == 0
    share_b = b.engine_share()
    assert share_b is not None and share_b.evictions == 3
    assert b.prepare_store(prompt_keys(7, 1)).keys == []  # everything pinned or being written
    b.complete_store(got.keys, True)
    b.complete_load(old[:1])
    assert len(pinned) == 1
    b.check_invariants(settled=True)
    for pool, cache in ((pool_a, a), (pool_b, b)):
        cache.close()
        pool.close()


def test_a_quota_makes_an_engine_evict_its_own_blocks_first(tmp_path):
    pool_a, a = open_cache(str(tmp_path), 4)
    pool_b, b = open_cache(str(tmp_path), 4)
    b.index.a.engines[b.index.me, 6] = 1  # E_QUOTA: one slot
    theirs = prompt_keys(8, 2)
    a.complete_store(a.prepare_store(theirs).keys, True)
    mine = prompt_keys(9, 2)
    b.complete_store(b.prepare_store(mine).keys, True)
    b.touch(mine[:1])
    b.complete_store(b.prepare_store(prompt_keys(10, 1)).keys, True)
    assert a.lookup(theirs).hits == 2  # B evicted its own older block, not A's
    assert b.lookup(mine).hits == 1
    for pool, cache in ((pool_a, a), (pool_b, b)):
        cache.close()
        pool.close()


class _OneSlotSampler:
    """Draws only one slot: the worst a random sample of the pool can do."""

    def __init__(self, slot: int) -> None:
        self.slot = slot

    def integers(self, low: int, high: int, size: int) -> np.ndarray:
        return np.full(size, self.slot, dtype=np.int64)


def test_a_pool_no_larger_than_the_sample_evicts_its_least_recently_used_block(tmp_path):
    pool, cache = open_cache(str(tmp_path), 4)
    blocks = [prompt_keys(12 + i, 1)[0] for i in range(4)]
    for block in blocks:  # one by one: each a later last use
        cache.complete_store(cache.prepare_store([block]).keys, True)
    cache.touch(blocks[:1])  # the first block is now the most recently used
    newest = int(table.visible(cache.index.a, table.keys_array(blocks[:1]))[0])
    cache.index._rng = _OneSlotSampler(newest)
    cache.complete_store(cache.prepare_store(prompt_keys(20, 1)).keys, True)
    assert cache.lookup(blocks[:1]).hits == 1  # the sample's only block survived
    assert cache.lookup(blocks[1:2]).hits == 0  # the least recently used went
    cache.close()
    pool.close()


def test_a_stopped_lock_holder_costs_a_miss_within_the_timeout_never_a_hang(two):
    (pool_a, a), (_, b) = two
    keys = prompt_keys(11, 2)
    reservation = a.prepare_store(keys)
    stopped = os.open(pool_a.handle.path, os.O_RDWR)  # another engine holding the index lock
    assert locks.try_lock(stopped, locks.INDEX_LOCK_BYTE)
    began = time.monotonic()
    a.complete_store(reservation.keys, True)  # publication waits for the next step
    assert b.prepare_load(keys) == []
    assert b.prepare_store(prompt_keys(12, 1)).keys == []
    assert time.monotonic() - began < 1.0  # three calls of at most 0.1 s each
    assert b.lookup(keys).hits == 0 and b.index.lock_timeouts == 2
    os.close(stopped)  # the lock goes with its descriptor, as with a killed process
    a.step()
    assert b.lookup(keys).hits == 2
    slots = b.prepare_load(keys)
    stopped = os.open(pool_a.handle.path, os.O_RDWR)
    assert locks.try_lock(stopped, locks.INDEX_LOCK_BYTE)
    b.complete_load(keys)  # the unpin waits for the next step too
    assert int(b.index.a.pins[slots[0]]) != 0
    os.close(stopped)
    b.step()
    assert int(b.index.a.pins[slots[0]]) == 0
    b.check_invariants(settled=True)


def test_a_holder_killed_inside_the_lock_leaves_an_index_the_next_holder_repairs(two):
    (_, a), (_, b) = two
    keys = prompt_keys(13, 3)
    a.complete_store(a.prepare_store(keys).keys, True)
    arrays = b.index.a
    arrays.header[H_DIRTY] = 1  # as if a holder died mid-change ...
    arrays.table_slots[:] = -1  # ... having wiped the table
    arrays.free[:] = 0
    assert b.lookup(keys).hits == 0
    assert len(b.prepare_load(keys)) == 3  # the lock's next holder rebuilt the index first
    assert int(arrays.header[H_REPAIRS]) == 1 and int(arrays.header[H_DIRTY]) == 0
    b.complete_load(keys)
    b.check_invariants(settled=True)


def test_check_invariants_names_what_is_broken(two):
    (_, a), (_, b) = two
    keys = prompt_keys(14, 2)
    a.complete_store(a.prepare_store(keys).keys, True)
    arrays = b.index.a
    slot = int(table.visible(arrays, table.keys_array(keys))[0])
    arrays.pins[slot] = np.uint64(1 << 40)  # a pin of an engine that does not exist
    with pytest.raises(AssertionError, match="engine that is gone"):
        b.check_invariants()
    arrays.pins[slot] = 0
    arrays.state[slot] = WRITING
    arrays.writer[slot] = 41
    with pytest.raises(AssertionError, match="held by a dead engine"):
        b.check_invariants()
    arrays.state[slot] = 2
    top = int(arrays.header[6])
    arrays.header[6] = top - 1  # a free slot fell off the stack
    with pytest.raises(AssertionError, match="leak"):
        b.check_invariants()
    arrays.header[6] = top
    b.check_invariants()


def test_an_engine_that_leaves_releases_its_pins_and_reservations(tmp_path):
    pool_a, a = open_cache(str(tmp_path), 8)
    pool_b, b = open_cache(str(tmp_path), 8)
    keys = prompt_keys(15, 4)
    a.complete_store(a.prepare_store(keys[:2]).keys, True)
    b.prepare_load(keys[:2])
    b.prepare_store(keys[2:])
    b.close()  # without finishing its load or its stores
    pool_b.close()
    a.check_invariants(settled=True)
    assert a.lookup(keys).hits == 2 and a.stats().pool_used == 2
    assert os.path.exists(pool_a.handle.path)
    a.close()
    pool_a.close()
    assert list(tmp_path.iterdir()) == []


def test_the_file_goes_when_the_engines_worker_closes_after_its_scheduler(tmp_path):
    """vLLM's engine core holds the shared pool twice: the scheduler side opens it and the worker
    side attaches it by name (another open file, another lock). On an H100 (vLLM 0.25.1) the
    scheduler closed first; before, it then stopped its reaper although its own worker still held
    the file, and the file stayed after both engines were gone."""
    pool, cache = open_cache(str(tmp_path), 8)
    worker = HostPool.attach(pool.handle)
    cache.close()
    pool.close()  # not the last user: its worker still holds the file
    assert os.path.exists(pool.handle.path)
    worker.close()
    deadline = time.monotonic() + 10.0
    while list(tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert list(tmp_path.iterdir()) == []  # the reaper removed it once the worker let go


def test_config_errors_name_the_field(tmp_path):
    for bad in ("", "a/b", "-x", "x" * 65, "a b"):
        with pytest.raises(ConfigError, match=r"pool\.share"):
            load_config({"pool": {"share": bad}})
    with_tier = load_config(
        {
            "pool": {"size": "64KiB", "share": "s", "shm_dir": str(tmp_path)},
            "tiers": [{"kind": "memory", "capacity": "1MiB"}],
        }
    )
    with pytest.raises(ConfigError, match="at most one secondary tier"):
        build_cache(with_tier, NAMESPACE, SLOT_BYTES)
    fs = {"kind": "fs", "path": str(tmp_path / "fs"), "capacity": "1MiB"}
    shared_tiers = {
        "at most one secondary tier": [fs, {**fs, "name": "fs2", "path": str(tmp_path / "f")}],
        r"tiers\[0\]\.write": [{**fs, "write": "on_evict"}],
        r"tiers\[0\]\.eviction": [{**fs, "eviction": "arc"}],
    }
    for message, tiers in shared_tiers.items():
        config = load_config(
            {"pool": {"size": "64KiB", "share": "s", "shm_dir": str(tmp_path)}, "tiers": tiers}
        )
        with pytest.raises(ConfigError, match=message):
            build_cache(config, NAMESPACE, SLOT_BYTES)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"")
    unusable = load_config(
        {
            "pool": {"size": "64KiB", "share": "s", "shm_dir": str(tmp_path)},
            "tiers": [{"kind": "fs", "path": str(not_a_dir), "capacity": "1MiB"}],
        }
    )
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path"):
        build_cache(unusable, NAMESPACE, SLOT_BYTES)  # the pool it attached is left again
    not_a_dir.unlink()
    pool_section = {"size": "64KiB", "share": "s", "shm_dir": str(tmp_path)}
    admission = load_config({"pool": pool_section, "admission": {"min_seen": 2}})
    with pytest.raises(ConfigError, match="admission"):
        build_cache(admission, NAMESPACE, SLOT_BYTES)
    no_dir = load_config({"pool": {"size": "64KiB", "share": "s", "shm_dir": str(tmp_path / "x")}})
    with pytest.raises(ConfigError, match=r"pool\.shm_dir"):
        build_cache(no_dir, NAMESPACE, SLOT_BYTES)
    assert list(tmp_path.iterdir()) == []


def test_a_file_under_the_name_that_is_no_shared_pool_is_refused(tmp_path):
    name = segment_name("test", NAMESPACE.digest, SLOT_BYTES)
    path = tmp_path / name
    path.write_bytes(b"\0" * TRAILER_BYTES * 3)
    with pytest.raises(PoolError, match="not a kvtier shared pool"):
        open_shared("test", NAMESPACE.digest, 4, SLOT_BYTES, str(tmp_path), 0.1)
    path.write_bytes(b"\0" * 100)
    with pytest.raises(PoolError, match="size"):
        open_shared("test", NAMESPACE.digest, 4, SLOT_BYTES, str(tmp_path), 0.1)
    path.unlink()
    pool, index = open_shared("test", NAMESPACE.digest, 4, SLOT_BYTES, str(tmp_path), 0.1)
    os.rename(pool.handle.path, tmp_path / segment_name("test", NAMESPACE.digest, 64))
    with pytest.raises(PoolError, match="another namespace"):
        open_shared("test", NAMESPACE.digest, 4, 64, str(tmp_path), 0.1)
    os.rename(tmp_path / segment_name("test", NAMESPACE.digest, 64), pool.handle.path)
    index.close()
    pool.close()


def test_a_pool_serves_at_most_max_engines(tmp_path):
    opened = [open_cache(str(tmp_path), 2) for _ in range(MAX_ENGINES)]
    with pytest.raises(PoolError, match="at most 64 engines"):
        open_cache(str(tmp_path), 2)
    for pool, cache in reversed(opened):
        cache.close()
        pool.close()
    assert list(tmp_path.iterdir()) == []


def test_payload_helper_is_deterministic():
    key = prompt_keys(1, 1)[0]
    assert payload(key) == payload(key) and len(payload(key)) == SLOT_BYTES


def test_the_table_finds_every_key_through_collisions_wraps_and_deletions():
    """Backward-shift deletion: random inserts and removals of keys crowded onto few home
    positions (wrapping past the table's end) against a dict; every key found, none stale."""
    import random

    from kvtier.shared_pool.layout import IndexArrays, Layout

    layout = Layout.of(8)  # 32 table entries
    arrays = IndexArrays(memoryview(bytearray(layout.size)), layout)
    arrays.initialise(64, bytes(16))
    rng = random.Random(5)
    model: dict[tuple[int, int], int] = {}
    for step in range(4000):
        if model and (len(model) >= 8 or rng.random() < 0.45):
            k = rng.choice(sorted(model))
            pos, slot = table.find_one(arrays, *k)
            assert slot == model.pop(k)
            table.remove_at(arrays, pos)
        else:
            k = (rng.choice([29, 30, 31, 0, 1]) + 32 * rng.randrange(1 << 20), step)
            if table.find_one(arrays, *k)[1] < 0:
                slot = rng.choice(sorted(set(range(8)) - set(model.values())))
                table.insert(arrays, *k, slot)
                model[k] = slot
        for key, slot in model.items():
            assert table.find_one(arrays, *key)[1] == slot
        assert int(np.count_nonzero(arrays.table_slots >= 0)) == len(model)
        assert table.find_one(arrays, 29, -1 & 0xFFFF)[1] == -1
