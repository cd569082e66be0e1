"""Small validators for declarative config: each error names the field, the value and what is
allowed (``ConfigError``), so a bad config never ends in a traceback from deep inside."""

from __future__ import annotations

import re
from collections.abc import Mapping
from enum import Enum
from typing import Any, TypeVar

from kvtier.errors import ConfigError

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


def parse_size(value: object, field: str) -> int:
    """Bytes from an int or a human size string ("64GiB", "500MB", "4096")."""
    if isinstance(value, bool):
        raise ConfigError(field, value, SIZE_HELP)
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(field, value, SIZE_HELP + " (not negative)")
        return value
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match and match.group(2).lower() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise ConfigError(field, value, SIZE_HELP)


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


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

    def _field(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def _get(self, key: str, default: object) -> object:
        self._read.add(key)
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
        if isinstance(raw, bool) or not isinstance(raw, int):
            raise ConfigError(self._field(key), raw, "an integer" + _range(minimum, maximum))
        if (minimum is not None and raw < minimum) or (maximum is not None and raw > maximum):
            raise ConfigError(self._field(key), raw, "an integer" + _range(minimum, maximum))
        return raw

    def number(
        self,
        key: str,
        default: float | None = None,
        minimum: float | None = None,
        maximum: float | None = None,
    ) -> float:
        raw = self._get(key, default)
        if isinstance(raw, bool) or not isinstance(raw, int | float):
            raise ConfigError(self._field(key), raw, "a number" + _range(minimum, maximum))
        if (minimum is not None and raw < minimum) or (maximum is not None and raw > maximum):
            raise ConfigError(self._field(key), raw, "a number" + _range(minimum, maximum))
        return float(raw)

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
        raw = self._get(key, None)
        if raw is None:
            return None
        if not isinstance(raw, str):
            raise ConfigError(self._field(key), raw, "a string")
        return raw

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
        unknown = sorted(set(self.data) - self._read)
        if unknown:
            raise ConfigError(
                self._field(unknown[0]),
                self.data[unknown[0]],
                f"not a known option here; known: {', '.join(sorted(self._read))}",
            )


def _range(minimum: float | None, maximum: float | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""
