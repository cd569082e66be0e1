"""The ``eviction`` option of a capacity-bounded tier (fs, memory) and the policy it names.

Same names and meaning as the host pool's top-level ``eviction`` (``kvtier.registry.POLICIES``
or ``package.module:Class``): the tier keeps its own accounting (bytes, pins, files) and asks the
policy only which blocks to give up.
"""

from __future__ import annotations

from collections.abc import Container

from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.policies import DEFAULT_EVICTION, EvictionPolicy, make_policy, policy_class
from kvtier.registry import POLICIES
from kvtier.validation import Section


def parse_eviction(section: Section) -> str:
    """The section's ``eviction``: a registered policy name or ``package.module:Class``, checked
    now (imported, a policy class), so a typo fails when the config is loaded; ``ConfigError``
    naming ``<section>.eviction`` otherwise."""
    field = eviction_field(section)
    try:
        name = section.string("eviction", DEFAULT_EVICTION)
    except ConfigError as exc:  # not a string: the same message as an unknown name
        raise ConfigError(field, exc.value, POLICIES.allowed()) from None
    policy_class(name, field)
    return name


def eviction_field(section: Section) -> str:
    """The config path of the section's ``eviction`` (``tiers[1].eviction``), for errors."""
    return f"{section.path}.eviction" if section.path else "eviction"


def tier_policy(kind: str, capacity_blocks: int, field: str) -> EvictionPolicy:
    """A new policy ``kind`` for a tier that holds ``capacity_blocks`` blocks (at least 1: ARC's
    lists need a positive size)."""
    return make_policy(kind, max(1, capacity_blocks), field)


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
