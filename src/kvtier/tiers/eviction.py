"""The policy of a capacity-bounded tier (fs, memory), named by its ``eviction`` option.

Same names and meaning as the host pool's top-level ``eviction`` (``policies.parse_eviction``):
the tier keeps its own accounting (bytes, pins, files) and asks the policy only which blocks to
give up.
"""

from __future__ import annotations

from collections.abc import Callable, Container

from kvtier.keys import BlockKey
from kvtier.metrics import TierCounters
from kvtier.policies import EvictionPolicy, GuardedPolicy, make_policy


def tier_policy(kind: str, capacity_blocks: int, field: str) -> EvictionPolicy:
    """A new policy ``kind`` for a tier that holds ``capacity_blocks`` blocks (at least 1: ARC's
    lists need a positive size)."""
    return make_policy(kind, max(1, capacity_blocks), field)


def count_errors_in(policy: EvictionPolicy, counters: TierCounters) -> None:
    """Count a plugin policy's failures (``GuardedPolicy``) in the tier's ``errors`` as well; a
    no-op for kvtier's own policies."""
    if isinstance(policy, GuardedPolicy):
        policy.counters = counters


def choose(
    policy: EvictionPolicy, n: int, pins: Container[BlockKey], held: Container[BlockKey]
) -> list[BlockKey]:
    """``policy.evict(n, pins)``, less what a policy that breaks its contract may offer: a pinned
    block is not given up (the policy ranks it again), a key the tier does not hold is ignored.
    Empty when the policy has no unpinned block left."""
    victims: list[BlockKey] = []
    for key in policy.evict(n, pins):
        if key in pins and key in held:
            policy.insert(key)
        elif key in held:
            victims.append(key)
    return victims


def victims_for(
    policy: EvictionPolicy,
    pins: Container[BlockKey],
    held: Container[BlockKey],
    size_of: Callable[[BlockKey], int],
    largest: int,
    need_bytes: int,
    need_blocks: int = 0,
) -> list[BlockKey]:
    """Victims in the policy's order (``choose``) until they free ``need_bytes`` bytes and
    ``need_blocks`` blocks; fewer when the policy has no unpinned block left. Each round asks for
    as many as could be needed if every victim were of ``largest`` bytes: never more than needed.
    The victims are out of the policy; the caller drops them from its storage."""
    victims: list[BlockKey] = []
    while need_bytes > 0 or need_blocks > 0:
        wanted = max(need_blocks, -(-need_bytes // max(1, largest)))
        chosen = choose(policy, wanted, pins, held)
        if not chosen:
            break
        for key in chosen:
            victims.append(key)
            need_bytes -= size_of(key)
            need_blocks -= 1
    return victims
