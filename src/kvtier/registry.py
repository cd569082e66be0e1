"""Open registries of the pluggable parts: tier kinds, eviction policies, copy backends.

A built-in part is one file: the module ``<package>/<name>.py`` of the registry's package
(``kvtier/tiers/fs.py``) with a top-level class whose body declares ``kind = "<name>"`` (a string
literal equal to the module's name). The registry finds the names by reading its package's sources
(``declared``: nothing is imported, so listing them needs no optional dependency) and imports a
module only when its name is used, so an optional dependency (the ``redis`` client, CUDA) is needed
only by the part that needs it. Wherever a name is accepted (``tiers[i].kind``, ``eviction``,
``kvtier simulate --policy``), a class outside kvtier can be named directly as
``package.module:Class``: the module is imported from the Python path, so a plugin is one installed
(or ``PYTHONPATH``) module and no kvtier file changes. An unknown name, a module that does not
import or a class of the wrong base is a ``ConfigError`` naming the field and listing the known
names, never a fallback.

The config is operator input (like the command line): naming a module imports it, which runs its
code. Only modules already on the Python path can be named; nothing is loaded from a file path.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from kvtier.errors import ConfigError

PLUGIN_FORM = "package.module:Class"
_PLUGIN = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$", re.ASCII)
"""A dotted module path, a colon, a (possibly nested) attribute path: nothing else is imported."""


def is_plugin_path(text: str) -> bool:
    """True when ``text`` has the ``package.module:Class`` form (not whether it imports)."""
    return bool(_PLUGIN.match(text))


@dataclass(slots=True)
class Registry:
    """Names of one kind of part -> ``package.module:Class``; see the module docstring."""

    what: str
    """What a name names, for messages ("tier", "eviction policy")."""
    base: str
    """``package.module:Class`` every entry must subclass (imported on first load)."""
    package: str
    """The package whose modules declare the built-in names (``declared``)."""
    _entries: dict[str, str] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def entries(self) -> dict[str, str]:
        """Built-in names in the order they are listed: the package's declarations, read on first
        use, and names added by ``register`` (mutable: tests patch it)."""
        if self._entries is None:
            self._entries = declared(self.package)
        return self._entries

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
        """Add a name that no module of the package declares: a copy backend for another device
        type (a device type is not a config field, so a class path cannot name one there)."""
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


def declared(package: str) -> dict[str, str]:
    """``name -> package.name:Class`` for every module ``name.py`` of ``package`` with a top-level
    class whose body declares ``kind = "name"``, sorted by name.

    Read from the sources, nothing imported. A class declaring another name (a shared base class
    such as ``SegmentedBase``) declares nothing; two classes of one module declaring its name are a
    ``ValueError`` (a programming error, caught by the registry tests).
    """
    found: dict[str, str] = {}
    for entry in sorted(resources.files(package).iterdir(), key=lambda entry: entry.name):
        name = entry.name.removesuffix(".py")
        if name == entry.name or name.startswith("_") or not name.isidentifier():
            continue
        source = entry.read_text(encoding="utf-8")
        # Most modules never say ``kind = "name"``: parse only those that do.
        if not re.search(rf"^\s+kind\b[^=\n]*=\s*[\"']{name}[\"']", source, re.MULTILINE):
            continue
        classes = [
            node.name
            for node in ast.parse(source).body
            if isinstance(node, ast.ClassDef) and _declared_kind(node) == name
        ]
        if len(classes) > 1:
            raise ValueError(f"{package}.{name}: classes {classes} all declare kind {name!r}")
        if classes:
            found[name] = f"{package}.{name}:{classes[0]}"
    return found


def _declared_kind(node: ast.ClassDef) -> str | None:
    """The string a class body assigns to ``kind`` (``kind = "x"`` or ``kind: T = "x"``)."""
    for statement in node.body:
        if isinstance(statement, ast.Assign) and len(statement.targets) == 1:
            target, value = statement.targets[0], statement.value
        elif isinstance(statement, ast.AnnAssign) and statement.value is not None:
            target, value = statement.target, statement.value
        else:
            continue
        named = isinstance(target, ast.Name) and target.id == "kind"
        if named and isinstance(value, ast.Constant) and isinstance(value.value, str):
            return value.value
    return None


TIERS = Registry("tier", "kvtier.tiers.base:Tier", "kvtier.tiers")
"""Secondary tiers (``tiers[i].kind``). A tier class takes ``(name, namespace, pool, options)``
and has an ``Options`` record with ``parse(section)``."""

POLICIES = Registry("eviction policy", "kvtier.policies.base:EvictionPolicy", "kvtier.policies")
"""Eviction policies of the host pool (``eviction``). A policy class is built with the pool's
capacity in blocks as its one argument, or with none when its constructor takes none."""

COPY_BACKENDS = Registry("copy backend", "kvtier.copy.base:CopyBackend", "kvtier.copy")
"""Copy backends by the device type of the engine's KV tensors (``tensor.device.type``); see
``kvtier.engine.backends.make_backend`` for the arguments a backend is built with."""

__all__ = [
    "COPY_BACKENDS",
    "PLUGIN_FORM",
    "POLICIES",
    "TIERS",
    "Registry",
    "declared",
    "is_plugin_path",
]
