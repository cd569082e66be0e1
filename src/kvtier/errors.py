"""Exceptions that kvtier raises to its callers.

Only configuration and programming errors surface as exceptions; tier failures at run time become
misses or failed jobs and are counted in stats instead.
"""

import reprlib

from kvtier.redaction import MASK, is_secret_name, printable, redact_text, redact_value


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
        # The one redaction rule (kvtier.redaction): secrets masked, control characters escaped.
        if not show_value:
            text = HIDDEN_VALUE
        elif is_secret_name(field):
            text = MASK
        else:
            text = redact_text(shown(redact_value(value)))
        super().__init__(f"invalid config {printable(field)}={text}: {redact_text(allowed)}")


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
