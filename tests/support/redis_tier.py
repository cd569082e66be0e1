"""Redis tiers for tests, built from config mappings as config.py builds them."""

from __future__ import annotations

from typing import Any

from kvtier.keys import Namespace
from kvtier.pool import HostPool
from kvtier.tiers.redis.tier import Options, RedisTier
from kvtier.validation import Section


def options(**values: Any) -> Options:
    """Options parsed from a config mapping, as config.py would."""
    return Options.parse(Section(dict(values), "tiers[0]"))


def make_tier(
    pool: HostPool, namespace: Namespace, name: str = "redis", **values: Any
) -> RedisTier:
    # Short timeouts and reconnect waits: the tests kill and restart servers.
    values.setdefault("timeout_s", 2.0)
    values.setdefault("reconnect_initial_s", 0.05)
    values.setdefault("reconnect_max_s", 0.5)
    return RedisTier(name, namespace, pool, options(**values))
