"""Does the machine have the room a config asks for? ``kvtier check-config`` prints these
warnings: a pool larger than the free space of its shm directory fails (or is killed) when it
fills, an fs tier larger than its disk's free space fills the disk before it evicts anything."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from kvtier.config import KVTierConfig
from kvtier.errors import ConfigError
from kvtier.validation import format_size


class DiskUsage(NamedTuple):
    total: int
    used: int
    free: int


def _existing(path: Path) -> Path:
    """The path itself or its nearest existing parent (a tier directory may not exist yet)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def capacity_warnings(
    config: KVTierConfig, usage: Callable[[str], DiskUsage] | None = None, *, pool: bool = True
) -> list[str]:
    """One line per setting that exceeds the free space where it lives (``usage``: for tests,
    ``shutil.disk_usage`` by default). A directory that cannot be examined gets a line too; a
    path that no filesystem takes (a component over 255 bytes) is a ``ConfigError``. ``pool``
    False leaves out ``pool.size``: ``kvtier simulate`` allocates none of it."""
    disk_usage = usage or (lambda p: DiskUsage(*shutil.disk_usage(p)))
    out: list[str] = []

    def check(field: str, want: int, where: str, path_field: str) -> None:
        base = Path(where)
        try:
            base = _existing(base)
            free = disk_usage(os.fspath(base)).free
        except OSError as exc:
            if exc.errno == errno.ENAMETOOLONG:
                raise ConfigError(path_field, where, f"a usable path ({exc.strerror})") from None
            out.append(f"{field}: cannot tell the free space of {base} ({exc.strerror or exc})")
            return
        if want > free:
            out.append(
                f"{field} {format_size(want)} exceeds the free space of {base} "
                f"({format_size(free)} free)"
            )

    if pool:
        check("pool.size", config.pool.size, config.pool.shm_dir, "pool.shm_dir")
    for i, tier in enumerate(config.tiers):
        path = getattr(tier.options, "path", None)
        capacity = getattr(tier.options, "capacity", None)
        if tier.kind == "fs" and isinstance(path, str) and isinstance(capacity, int):
            check(f"tiers[{i}].capacity ({tier.name})", capacity, path, f"tiers[{i}].path")
    return out
