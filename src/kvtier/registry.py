"""Open registries of the pluggable parts: tier kinds, eviction policies, copy backends.

Each registry maps a name to ``package.module:Class`` and imports the module only when that name is
used, so an optional dependency (the ``redis`` client, CUDA) is needed only by the part that needs
it. Wherever a name is accepted (``tiers[i].kind``, ``eviction``, ``kvtier simulate --policy``),
a class outside kvtier can be named directly as ``package.module:Class``: the module is imported
from the Python path, so a plugin is one installed (or ``PYTHONPATH``) module and no kvtier file
changes. An unknown name, a module that does not import or a class of the wrong base is a
``ConfigError`` naming the field and listing the known names, never a fallback.

The config is operator input (like the command line): naming a module imports it, which runs its
code. Only modules already on the Python path can be named; nothing is loaded from a file path.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError

PLUGIN_FORM = "package.module:Class"
_PLUGIN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$", re.ASCII)
"""A dotted module path, a colon, a (possibly nested) attribute path: nothing else is imported."""


def is_plugin_path(text: str) -> bool:
    """True when ``text`` has the ``package.module:Class`` form (not whether it imports)."""
    return bool(_PLUGIN.match(text))


@dataclass(frozen=True, slots=True)
class Registry:
    """Names of one kind of part -> ``package.module:Class``; see the module docstring."""

    what: str
    """What a name names, for messages ("tier", "eviction policy")."""
    base: str
    """``package.module:Class`` every entry must subclass (imported on first load)."""
    entries: dict[str, str]
    """Built-in names in the order they are listed (mutable: ``register``; tests patch it)."""

    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def __contains__(self, name: object) -> bool:
        return name in self.entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def allowed(self) -> str:
        """What a config field accepts, for error messages and help texts."""
        known = ", ".join(repr(name) for name in self.entries)
        article = "an" if self.what[:1] in "aeiou" else "a"
        return f"one of {known} or {article} {self.what} class given as '{PLUGIN_FORM}'"

    def register(self, name: str, target: str) -> None:
        """Add a name (an in-tree part registers here; a plugin can be named by path instead)."""
        if not name or is_plugin_path(name) or ":" in name:
            raise ValueError(f"{self.what} name {name!r}: a plain name without ':'")
        if not is_plugin_path(target):
            raise ValueError(f"{self.what} {name!r}: target {target!r} is not {PLUGIN_FORM}")
        existing = self.entries.get(name)
        if existing is not None and existing != target:
            raise ValueError(f"{self.what} {name!r} is already registered as {existing}")
        self.entries[name] = target

    def check(self, name: object, field: str) -> str:
        """``name`` when it is a registered name or has the plugin form (nothing imported);
        ``ConfigError`` for ``field`` otherwise."""
        if isinstance(name, str) and (name in self.entries or is_plugin_path(name)):
            return name
        raise ConfigError(field, name, self.allowed())

    def load(self, name: object, field: str) -> type[Any]:
        """The class ``name`` stands for: a registered name or ``package.module:Class``.

        ``ConfigError`` for ``field`` when the name is unknown, the module cannot be imported
        (for a registered name: its optional dependency is missing), the attribute is missing or
        it is not a subclass of ``base``.
        """
        key = self.check(name, field)
        builtin = key in self.entries
        target = self.entries[key] if builtin else key
        try:
            cls = _resolve(target)
        except ImportError as exc:
            if builtin:
                raise ConfigError(field, key, f"its dependency is not installed ({exc})") from exc
            raise ConfigError(field, key, f"an importable module ({exc})") from exc
        except AttributeError as exc:
            raise ConfigError(field, key, f"a class that exists ({exc})") from exc
        base = _resolve(self.base)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(field, key, f"a subclass of {self.base} (got {cls!r})")
        return cls


def _resolve(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attribute.split("."):
        obj = getattr(obj, part)
    return obj


TIERS = Registry(
    "tier",
    "kvtier.tiers.base:Tier",
    {
        "memory": "kvtier.tiers.memory:MemoryTier",
        "fs": "kvtier.tiers.fs:FsTier",
        "redis": "kvtier.tiers.redis:RedisTier",
    },
)
"""Secondary tiers (``tiers[i].kind``). A tier class takes ``(name, namespace, pool, options)``
and has an ``Options`` record with ``parse(section)``."""

POLICIES = Registry(
    "eviction policy",
    "kvtier.policies.base:EvictionPolicy",
    {
        "lru": "kvtier.policies.lru:LRUPolicy",
        "arc": "kvtier.policies.arc:ARCPolicy",
        "segmented": "kvtier.policies.segmented:SegmentedPolicy",
        "hinted": "kvtier.policies.hinted:HintedPolicy",
    },
)
"""Eviction policies of the host pool (``eviction``). A policy class is built with the pool's
capacity in blocks as its one argument, or with none when its constructor takes none."""

COPY_BACKENDS = Registry(
    "copy backend",
    "kvtier.copy.base:CopyBackend",
    {
        "cpu": "kvtier.copy.cpu:CpuCopyBackend",
        "cuda": "kvtier.copy.cuda:CudaCopyBackend",
    },
)
"""Copy backends by the device type of the engine's KV tensors (``tensor.device.type``)."""

__all__ = [
    "COPY_BACKENDS",
    "PLUGIN_FORM",
    "POLICIES",
    "TIERS",
    "Registry",
    "is_plugin_path",
]
