"""Eviction policies and the admission filter.

A built-in policy is the module ``policies/<name>.py`` whose policy class declares
``kind = "<name>"``: ``kvtier.registry.POLICIES`` lists the names (config, CLI and docs read it) and
``make_policy`` also takes ``package.module:Class`` for a policy outside kvtier. A name without a
class is an error, never another policy.
"""

from __future__ import annotations

from kvtier.errors import ConfigError
from kvtier.policies.arc import ARCPolicy
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.guarded import GuardedPolicy
from kvtier.policies.hinted import HintedPolicy
from kvtier.policies.hints import RequestHint
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.segmented import SegmentedPolicy
from kvtier.registry import POLICIES, describe
from kvtier.validation import Section

DEFAULT_EVICTION: str = HintedPolicy.kind
"""The host pool's default: above LRU at every pool size in the trace replay (with hints after
each request, 4 requests late, or before the last store) and as many prompt tokens loaded as LRU
in the vLLM demo, where it demotes nothing; exactly LRU when an engine gives no hints
(docs/policies.md)."""
DEFAULT_TIER_EVICTION: str = LRUPolicy.kind
"""A secondary tier's default: no request hints reach a tier, so ``hinted`` would be LRU there
with learning state it never uses."""


def policy_class(kind: str, field: str = "eviction") -> type[EvictionPolicy]:
    """The policy class of a registered name or ``package.module:Class`` (``ConfigError`` for
    ``field`` when unknown, not importable or not an ``EvictionPolicy``)."""
    cls: type[EvictionPolicy] = POLICIES.load(kind, field)
    return cls


def parse_eviction(section: Section, default: str = DEFAULT_EVICTION) -> str:
    """The section's ``eviction``: a registered policy name or ``package.module:Class``, checked
    now (imported, a policy class), so a typo fails when the config is loaded; ``ConfigError``
    naming ``<section>.eviction`` otherwise."""
    field = section.field("eviction")
    try:
        name = section.string("eviction", default)
    except ConfigError as exc:  # not a string: the same message as an unknown name
        raise ConfigError(field, exc.value, POLICIES.allowed()) from None
    policy_class(name, field)
    return name


def make_policy(kind: str, capacity_blocks: int, field: str = "eviction") -> EvictionPolicy:
    """A new policy ``kind`` (a registered name or ``package.module:Class``) for a pool of
    ``capacity_blocks`` blocks: ``cls.create(capacity_blocks)`` (``EvictionPolicy.create``).

    A policy from outside kvtier is the plugin boundary: whatever building it raises is a
    ``ConfigError`` for ``field`` (``KeyboardInterrupt`` aside), and it runs inside a
    ``GuardedPolicy`` (``policies/guarded.py``). kvtier's own policies are built and run as they
    are: they are on every lookup's and store's path."""
    cls = policy_class(kind, field)
    if cls.__module__.startswith("kvtier."):
        return cls.create(capacity_blocks)
    try:
        policy = cls.create(capacity_blocks)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit included: a plugin does not end kvtier
        raise ConfigError(field, kind, f"a policy that can be built ({describe(exc)})") from exc
    if not isinstance(policy, EvictionPolicy):  # a __new__ that returns something else
        raise ConfigError(field, kind, "a class whose constructor returns an EvictionPolicy")
    return GuardedPolicy(policy, kind)


__all__ = [
    "DEFAULT_EVICTION",
    "DEFAULT_TIER_EVICTION",
    "ARCPolicy",
    "EvictionPolicy",
    "GuardedPolicy",
    "HintedPolicy",
    "LRUPolicy",
    "RequestHint",
    "SegmentedPolicy",
    "make_policy",
    "parse_eviction",
    "policy_class",
]
