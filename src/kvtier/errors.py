"""Exceptions that kvtier raises to its callers.

Only configuration and programming errors surface as exceptions; tier failures at run time become
misses or failed jobs and are counted in stats instead.
"""


class KVTierError(Exception):
    """Base class of every exception kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is missing, malformed or out of range.

    The message names the field, the offending value and what is allowed.
    """

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid config {field}={value!r}: {allowed}")


class PoolError(KVTierError):
    """The shared host pool could not be created, attached or used."""
