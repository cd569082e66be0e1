"""What an engine knows about one request, for policies that predict reuse (``on_request``).

Every field is something an engine has without looking ahead: the request's own blocks, how many
of its leading blocks were already cached when it was looked up, and, once it finished, how many
tokens it generated. A field the caller does not know is ``None``; a policy must then decide
without it (docs/policies.md lists which policy uses what, and when an engine knows it).

The numbers come from an engine (or its plugin) and are never trusted: a hint holds a count or
"not known", whatever it was given, so no value can raise in the policy (or here).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

MAX_COUNT = 2**62
"""Counts are clamped to this: a policy may do arithmetic on them without big integers."""


def count_or_none(value: object) -> int | None:
    """``value`` as a count: a non-negative integer (a fraction rounded down, at most
    ``MAX_COUNT``), or None for anything that is no finite number >= 0 (NaN, infinities,
    negative numbers, text, other objects)."""
    if type(value) is int:  # the common case, first
        return value if 0 <= value <= MAX_COUNT else (MAX_COUNT if value > 0 else None)
    if not isinstance(value, numbers.Real):  # text, bytes, complex, Decimal, None
        return None
    try:
        number = float(value)
        if not math.isfinite(number) or number < 0:
            return None
        return MAX_COUNT if number >= MAX_COUNT else math.floor(number)
    except (ArithmeticError, TypeError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class RequestHint:
    hit_blocks: int
    """Leading blocks of the request that were cached when it was looked up (in any cache,
    the engine's own prefix cache included): the rest were computed by this request. A value
    that is no count becomes 0 (nothing known to be cached)."""
    output_tokens: int | None = None
    """Tokens the request generated; known once it finished, ``None`` before (and for a value
    that is no count)."""
    engine_blocks: int = 0
    """Of ``hit_blocks``, the leading ones the engine's own prefix cache held (vLLM's GPU
    cache: never asked of kvtier); the rest of the hit run is what kvtier served. 0 where the
    pool is the only cache (a replay); a value that is no count becomes 0, one above
    ``hit_blocks`` becomes ``hit_blocks``."""

    def __post_init__(self) -> None:
        hits = count_or_none(self.hit_blocks) or 0
        object.__setattr__(self, "hit_blocks", hits)
        object.__setattr__(self, "output_tokens", count_or_none(self.output_tokens))
        object.__setattr__(self, "engine_blocks", min(count_or_none(self.engine_blocks) or 0, hits))

    @property
    def served_blocks(self) -> int:
        """Leading blocks kvtier served (the hit run less what the engine held itself)."""
        return self.hit_blocks - self.engine_blocks
