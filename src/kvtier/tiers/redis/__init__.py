"""The ``redis`` tier: blocks as string values on Redis or Valkey (standalone or cluster).

``tier.py`` is the tier (``RedisTier``); the module layout is in ``docs/redis.md``. Importing this
package imports the ``redis`` client (the ``kvtier[redis]`` extra).
"""

from kvtier.tiers.redis.options import Options
from kvtier.tiers.redis.tier import RedisTier

__all__ = ["Options", "RedisTier"]
