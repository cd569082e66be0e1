"""Exceptions that kvtier raises to its callers.

Only configuration and programming errors surface as exceptions; tier failures at run time become
misses or failed jobs and are counted in stats instead.
"""

import reprlib


class KVTierError(Exception):
    """Base class of every exception kvtier raises on purpose."""


class ConfigError(KVTierError, ValueError):
    """A configuration value is missing, malformed or out of range.

    The message names the field, the offending value and what is allowed.
    """

    def __init__(self, field: str, value: object, allowed: str, *, show_value: bool = True) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        text = shown(value) if show_value else HIDDEN_VALUE
        super().__init__(f"invalid config {field}={text}: {allowed}")


HIDDEN_VALUE = "<not shown>"
"""Stands for a value a message must not print (an unknown key's: it may be a misspelt secret)."""


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 200
_REPR.maxlevel = 4


def shown(value: object) -> str:
    """``repr(value)`` cut short, for messages: whatever a hostile config holds (a 5,000-digit
    integer, a list nested thousands deep, a YAML alias bomb), this returns a short line quickly
    instead of raising or printing megabytes."""
    try:
        return _REPR.repr(value)
    except (ValueError, RecursionError):  # an int beyond Python's digit limit; extreme nesting
        return f"<{type(value).__name__}>"


class PoolError(KVTierError):
    """The shared host pool could not be created, attached or used."""
