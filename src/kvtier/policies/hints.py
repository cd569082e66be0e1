"""What an engine knows about one request, for policies that predict reuse (``on_request``).

Every field is something an engine has without looking ahead: the request's own blocks, how many
of its leading blocks were already cached when it was looked up, and, once it finished, how many
tokens it generated. A field the caller does not know is ``None``; a policy must then decide
without it (docs/policies.md lists which policy uses what, and when an engine knows it).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestHint:
    hit_blocks: int
    """Leading blocks of the request that were cached when it was looked up (in any cache,
    the engine's own prefix cache included): the rest were computed by this request."""
    output_tokens: int | None = None
    """Tokens the request generated; known once it finished, ``None`` before."""

    def __post_init__(self) -> None:
        if self.hit_blocks < 0:
            raise ValueError(f"hit_blocks must be >= 0, got {self.hit_blocks}")
        if self.output_tokens is not None and self.output_tokens < 0:
            raise ValueError(f"output_tokens must be >= 0, got {self.output_tokens}")
