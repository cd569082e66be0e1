"""Property-based tests of the manager's invariants under random operation sequences."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support.blocks import payload_for
from support.scripted_tier import ScriptedTier

from kvtier.cache.manager import TierBinding, TieredCache
from kvtier.events import POOL_TIER, EventKind
from kvtier.keys import Namespace, chain_keys
from kvtier.policies import make_policy
from kvtier.pool import HostPool
from kvtier.registry import POLICIES
from kvtier.tiers.base import TierJobKind, WriteMode

NS = Namespace(model="prop", dtype="float16", block_tokens=2)
SLOTS = 6
SLOT_BYTES = 32
# A small universe of prefixes so that requests overlap, hit, and evict each other.
PREFIXES = [chain_keys(NS, [p] * 2 + list(range(8))) for p in range(5)]


class ManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool: HostPool | None = None

    @rule(
        policy=st.sampled_from(POLICIES.names()),
        mode=st.sampled_from([None, *WriteMode]),
    )
    @precondition(lambda self: self.pool is None)
    def start(self, policy: str, mode: WriteMode | None) -> None:
        self.pool = HostPool.create(SLOTS, SLOT_BYTES)
        self.tier = ScriptedTier("tier", NS, self.pool)
        secondary = [TierBinding(self.tier, mode)] if mode is not None else []
        self.cache = TieredCache(self.pool, make_policy(policy, SLOTS), secondary)
        self.visible: set[bytes] = set()
        self.reserved: list[tuple[list[bytes], list[int]]] = []
        self.loads: list[list[bytes]] = []

    def _absorb_events(self) -> None:
        for event in self.cache.take_events():
            if event.tier != POOL_TIER:
                continue
            if event.kind is EventKind.STORED:
                self.visible.add(event.key)
            else:
                assert event.key in self.visible
                self.visible.discard(event.key)

    @precondition(lambda self: self.pool is not None)
    @rule(prefix=st.integers(0, 4), length=st.integers(1, 5))
    def lookup(self, prefix: int, length: int) -> None:
        keys = PREFIXES[prefix][:length]
        result = self.cache.lookup(keys)
        self._absorb_events()
        expected = 0
        for key in keys:
            if key not in self.visible:
                break
            expected += 1
        assert result.hits == expected

    @precondition(lambda self: self.pool is not None)
    @rule(prefix=st.integers(0, 4), length=st.integers(1, 5))
    def prepare_store(self, prefix: int, length: int) -> None:
        keys = PREFIXES[prefix][:length]
        in_flight = {k for ks, _ in self.reserved for k in ks}
        res = self.cache.prepare_store(keys)
        self._absorb_events()
        assert not set(res.keys) & self.visible, "reserved a visible key"
        assert not set(res.keys) & in_flight, "reserved a key twice"
        for key, slot in zip(res.keys, res.slots, strict=True):
            self.pool.view(slot)[:] = payload_for(key, SLOT_BYTES)
        if res.keys:
            self.reserved.append((res.keys, res.slots))

    @precondition(lambda self: self.pool is not None and self.reserved)
    @rule(data=st.data())
    def complete_store(self, data: st.DataObject) -> None:
        keys, _ = self.reserved.pop(data.draw(st.integers(0, len(self.reserved) - 1)))
        oks = data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
        self.cache.complete_store(keys, oks)
        self._absorb_events()
        for key, ok in zip(keys, oks, strict=True):
            assert (key in self.visible) == ok

    @precondition(lambda self: self.pool is not None)
    @rule(prefix=st.integers(0, 4), length=st.integers(1, 5))
    def load(self, prefix: int, length: int) -> None:
        keys = PREFIXES[prefix][:length]
        slots = self.cache.prepare_load(keys)
        for key, slot in zip(keys, slots, strict=False):
            assert bytes(self.pool.view(slot)) == payload_for(key, SLOT_BYTES), "wrong bytes served"
        if slots:
            self.loads.append(keys[: len(slots)])

    @precondition(lambda self: self.pool is not None and self.loads)
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        keys = self.loads.pop(data.draw(st.integers(0, len(self.loads) - 1)))
        self.cache.complete_load(keys)

    @precondition(lambda self: self.pool is not None)
    @rule(
        count=st.integers(1, 3), fail=st.sampled_from([None, TierJobKind.READ, TierJobKind.WRITE])
    )
    def tier_progress(self, count: int, fail: TierJobKind | None) -> None:
        # Fail every job of one kind among those finishing now.
        self.tier.fail_keys = {
            k for job in self.tier.pending[:count] if job.kind is fail for k in job.keys
        }
        self.tier.release(count)
        self.tier.fail_keys = set()
        self.cache.step()
        self._absorb_events()

    @invariant()
    def slots_are_accounted_for(self) -> None:
        if self.pool is None:
            return
        # Every slot in exactly one place, the policy tracking exactly the pool's keys, every pin
        # on a visible key (raises AssertionError naming the broken one).
        self.cache.check_invariants()

    @invariant()
    def the_events_name_the_pools_keys(self) -> None:
        if self.pool is None:
            return
        # A one-key lookup of a key in the pool starts nothing (no promotion), so asking every
        # key the events made visible leaves the machine's state as it was. A pool key the events
        # never announced shows in the ``lookup`` rule: more hits than expected.
        for key in self.visible:
            assert self.cache.lookup([key]).hits == 1, "a stored key is not in the pool"

    @invariant()
    def pinned_keys_stay_visible(self) -> None:
        if self.pool is None:
            return
        for keys in self.loads:
            for key in keys:
                assert self.cache.lookup([key]).hits == 1, "a pinned block was evicted"

    @invariant()
    def one_promotion_per_key(self) -> None:
        if self.pool is None:
            return
        reads = [k for job in self.tier.pending if job.kind is TierJobKind.READ for k in job.keys]
        assert len(reads) == len(set(reads))

    def teardown(self) -> None:
        if self.pool is not None:
            self.cache.close()
            self.pool.close()


TestManagerMachine = ManagerMachine.TestCase
TestManagerMachine.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)
