"""Small validators for declarative config: each error names the field, the value and what is
allowed (``ConfigError``), so a bad config never ends in a traceback from deep inside."""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Mapping
from decimal import Decimal
from enum import Enum
from typing import Any, NoReturn, TypeVar

from kvtier.errors import ConfigError, shown

E = TypeVar("E", bound=Enum)

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
SIZE_HELP = 'a byte count or a size such as "512MiB", "64GiB", "1.5TB"'
INT64_MAX = 2**63 - 1
"""Largest size or integer option: every count and byte size ends up in a C ``int64``/``off_t``."""
INT64_MIN = -(2**63)


def finite_float(value: object) -> float | None:
    """``value`` as a finite float, or None where it is not one: not an int or float (a bool,
    a string), NaN, an infinity, or an integer too large for a float.

    The one door through which a decimal option (config) or a trace number becomes a float: a NaN
    compares false with every bound, so a range check alone lets it through.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int beyond 1.8e308
        return None
    return number if math.isfinite(number) else None


def parse_size(value: object, field: str) -> int:
    """Bytes from an int or a human size string ("64GiB", "500MB", "4096"), at most 2**63 - 1."""
    if isinstance(value, bool):
        raise ConfigError(field, value, SIZE_HELP)
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(field, value, SIZE_HELP + " (not negative)")
        if value > INT64_MAX:
            raise ConfigError(field, value, f"at most {INT64_MAX} bytes")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS:
            # Decimal, not float: exact for "1.5TB", and a 400-digit number stays a number
            # (a float would become infinity) to be refused by the bound below.
            number = Decimal(match.group(1))
            n = number * _UNITS[match.group(2).lower()] if number <= INT64_MAX else number
            if n > INT64_MAX:
                raise ConfigError(field, value, f"at most {INT64_MAX} bytes")
            return int(n)
    raise ConfigError(field, value, SIZE_HELP)


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


_WRITTEN_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))
_WRITTEN_UNITS_SI = (("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("KB", 1000))


def written_size(n: int) -> str:
    """``n`` bytes as a config writes it, exactly (``parse_size`` reads it back as ``n``):
    ``64GiB``, ``2TB (1.8 TiB)``, ``4097 (4.0 KiB)``: the shortest whole multiple of a unit
    (binary first); one that is not binary is followed by the size as the memory and disk tools
    show it."""
    best, binary = str(n), False
    for units in (_WRITTEN_UNITS, _WRITTEN_UNITS_SI):
        for name, value in units:
            if n > 0 and n % value == 0:
                text = f"{n // value}{name}"
                if len(text) < len(best) or (len(text) == len(best) and not binary):
                    best, binary = text, units is _WRITTEN_UNITS
                break
    return best if binary or n < 1024 else f"{best} ({format_size(n)})"


class Section:
    """Typed reads from one mapping of a config, with field paths in every error.

    Call ``done()`` after the reads to reject unknown keys (typos must not pass silently).
    """

    def __init__(self, data: object, path: str) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(path, data, "a mapping of options")
        self.data: Mapping[str, Any] = data
        self.path = path
        self._read: set[str] = set()

    def field(self, key: str) -> str:
        """The config path of this section's ``key`` (``tiers[1].eviction``), for errors raised
        outside the section's own readers."""
        return self._field(key)

    def _field(self, key: object) -> str:
        """The path of ``key``; a key that is no plain name (YAML keys may be ints, null, empty
        or hold control characters) is shown as its repr, so the field is never blank."""
        plain = isinstance(key, str) and key.isprintable() and key.strip() == key != ""
        name = key if plain and isinstance(key, str) else shown(key)
        return f"{self.path}.{name}" if self.path else name

    def _get(self, key: str, default: object, *, required: bool = True) -> object:
        """The value of ``key``. A required key that is absent while an unknown key of this
        section is a near match of it (``capacty`` for ``capacity``) is reported as that unknown
        key: the typo is the mistake, not the missing value."""
        self._read.add(key)
        if required and default is None and key not in self.data:
            typo = _near(key, [k for k in self.data if k not in self._read], MISSING_KEY_CUTOFF)
            if typo is not None:
                self._refuse_unknown(typo, f"did you mean {key}?")
        return self.data.get(key, default)

    def has(self, key: str) -> bool:
        return key in self.data

    def size(self, key: str, default: int | str | None = None, minimum: int = 0) -> int:
        raw = self._get(key, default)
        if raw is None:
            raise ConfigError(self._field(key), raw, "required: " + SIZE_HELP)
        n = parse_size(raw, self._field(key))
        if n < minimum:
            raise ConfigError(self._field(key), raw, f"at least {format_size(minimum)}")
        return n

    def integer(
        self,
        key: str,
        default: int | None = None,
        minimum: int | None = None,
        maximum: int | None = None,
    ) -> int:
        raw = self._get(key, default)
        allowed = "an integer" + _range(minimum, maximum)
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ConfigError(self._field(key), raw, allowed)
        if not INT64_MIN <= raw <= INT64_MAX:
            raise ConfigError(self._field(key), raw, allowed + " (64-bit)")
        if (minimum is not None and raw < minimum) or (maximum is not None and raw > maximum):
            raise ConfigError(self._field(key), raw, allowed)
        return raw

    def number(
        self,
        key: str,
        default: float | None = None,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> float:
        """A finite number (NaN and infinities are refused, see ``finite_float``)."""
        raw = self._get(key, default)
        number = finite_float(raw)
        if (
            number is None
            or (minimum is not None and number < minimum)
            or (maximum is not None and number > maximum)
        ):
            raise ConfigError(self._field(key), raw, "a finite number" + _range(minimum, maximum))
        return number

    def boolean(self, key: str, default: bool | None = None) -> bool:
        raw = self._get(key, default)
        if not isinstance(raw, bool):
            raise ConfigError(self._field(key), raw, "true or false")
        return raw

    def string(self, key: str, default: str | None = None, allow_empty: bool = False) -> str:
        raw = self._get(key, default)
        if not isinstance(raw, str) or (not allow_empty and not raw):
            raise ConfigError(self._field(key), raw, "a non-empty string")
        return raw

    def optional_string(self, key: str) -> str | None:
        raw = self._get(key, None, required=False)
        if raw is None:
            return None
        if not isinstance(raw, str):
            raise ConfigError(self._field(key), raw, "a string")
        return raw

    def file_path(self, key: str, default: str | None = None) -> str:
        """A non-empty filesystem path: without a NUL byte, which no OS call accepts."""
        return _file_path(self.string(key, default), self._field(key))

    def optional_file_path(self, key: str) -> str | None:
        raw = self.optional_string(key)
        return None if raw is None else _file_path(raw, self._field(key))

    def choice(self, key: str, enum: type[E], default: E | None = None) -> E:
        raw = self._get(key, default.value if default is not None else None)
        allowed = ", ".join(repr(m.value) for m in enum)
        for member in enum:
            if raw == member.value:
                return member
        raise ConfigError(self._field(key), raw, f"one of {allowed}")

    def section(self, key: str, default: object = None) -> Section:
        raw = self._get(key, {} if default is None else default)
        return Section(raw, self._field(key))

    def items(self, key: str) -> list[Any]:
        raw = self._get(key, [])
        if not isinstance(raw, list):
            raise ConfigError(self._field(key), raw, "a list")
        return raw

    def done(self) -> None:
        # Sorted as text: YAML keys may be integers, dates or null besides strings.
        unknown = sorted(set(self.data) - self._read, key=shown)
        if unknown:
            known = sorted(self._read)
            match = _near(unknown[0], known, SUGGEST_CUTOFF)
            hint = f"did you mean {match}? " if match is not None else ""
            self._refuse_unknown(unknown[0], f"{hint}known: {', '.join(known)}")

    def _refuse_unknown(self, key: Any, hint: str) -> NoReturn:
        # The value is not shown: a misspelt secret (``pasword: ...``) must not be printed.
        raise ConfigError(
            self._field(key),
            self.data[key],
            f"not a known option here; {hint}",
            show_value=False,
        )


SUGGEST_CUTOFF = 0.6
"""``difflib`` similarity from which an unknown key's message suggests a known key (difflib's
default: a hint only)."""
MISSING_KEY_CUTOFF = 0.75
"""Similarity from which an unknown key is taken for the misspelling of a required key that is
missing (higher than ``SUGGEST_CUTOFF``: it decides which error is reported). ``capacty`` /
``capacity`` is 0.93, ``pth`` / ``path`` 0.86; ``capacity_blocks`` / ``capacity`` 0.70."""


def _near(key: object, candidates: list[Any], cutoff: float) -> str | None:
    """The candidate most like ``key`` (case ignored; keys that are no strings never match)."""
    if not isinstance(key, str):
        return None
    names = {c.lower(): c for c in candidates if isinstance(c, str)}
    best = difflib.get_close_matches(key.lower(), list(names), n=1, cutoff=cutoff)
    return names[best[0]] if best else None


def _file_path(raw: str, field: str) -> str:
    if "\0" in raw:
        raise ConfigError(field, raw, "a path without a NUL character")
    return raw


def _range(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""
