"""The fs tier's options (``tiers[i]`` of kind ``fs``) and their parsing."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.errors import ConfigError
from kvtier.policies import DEFAULT_TIER_EVICTION, parse_eviction
from kvtier.validation import Section


@dataclass(frozen=True, slots=True)
class Options:
    path: str
    """Directory shared by every namespace; each namespace gets its own subdirectory."""
    capacity: int
    """Bytes on disk (headers included) this tier may use."""
    fsync: bool = False
    """fsync each file and its directory before a block becomes visible (survives power loss)."""
    threads: int = 4
    file_mode: int = 0o600
    """Permission bits of block files (set with fchmod, so the umask does not matter)."""
    dir_mode: int = 0o700
    """Permission bits of the directories the tier creates."""
    min_free: int | None = None
    """Bytes of the filesystem left free: the tier shrinks below ``capacity`` to keep them. None:
    1% of the filesystem's size, at most ``fs.MIN_FREE_MAX``."""
    io_timeout_s: float = 10.0
    """An I/O thread busy on one block this long is stuck; see ``fs.py``'s module docstring."""
    eviction: str = DEFAULT_TIER_EVICTION
    """Which blocks go first when room is needed: an eviction policy's name or
    ``package.module:Class``, as the top-level ``eviction`` (``tiers/eviction.py``)."""
    config_path: str = field(default="fs", compare=False)
    """Where these options came from in the config (``tiers[1]``), for error messages."""

    @classmethod
    def parse(cls, section: Section) -> Options:
        options = cls(
            path=section.file_path("path"),
            capacity=section.size("capacity", minimum=1),
            fsync=section.boolean("fsync", False),
            threads=section.integer("threads", 4, minimum=1, maximum=256),
            file_mode=_mode(section, "file_mode", 0o600, 0o600),
            dir_mode=_mode(section, "dir_mode", 0o700, 0o700),
            min_free=section.size("min_free") if section.has("min_free") else None,
            io_timeout_s=section.number("io_timeout_s", 10.0, minimum=0.01, maximum=3600.0),
            eviction=parse_eviction(section, DEFAULT_TIER_EVICTION),
            config_path=section.path or "fs",
        )
        section.done()
        return options


def _mode(section: Section, key: str, default: int, required: int) -> int:
    """Permission bits from an int (YAML reads ``0640`` as octal) or an octal string ("0640",
    "0o640"); must keep the ``required`` owner bits and hold nothing above 0o777."""
    raw = section.data.get(key) if section.has(key) else None
    if isinstance(raw, str):
        text = raw.strip().lower().removeprefix("0o")
        if not text or len(text) > 4 or set(text) - set("01234567"):
            section.string(key)  # marks the key read
            raise ConfigError(
                f"{section.path}.{key}" if section.path else key,
                raw,
                'permission bits in octal, such as "0600" or "0640"',
            )
        section.string(key)
        mode = int(text, 8)
    else:
        mode = section.integer(key, default, minimum=0, maximum=0o777)
    allowed = f'permission bits 0..0777 that include {required:#o} (in octal: "{required:04o}")'
    if mode > 0o777 or mode & required != required:
        raise ConfigError(f"{section.path}.{key}" if section.path else key, raw, allowed)
    return mode
