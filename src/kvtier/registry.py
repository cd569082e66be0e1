"""Open registries of the pluggable parts: tier kinds, eviction policies, copy backends.

A built-in part is one module ``<package>/<name>.py`` of the registry's package
(``kvtier/tiers/memory.py``) or one package ``<package>/<name>/`` (``kvtier/tiers/fs/``) with a
top-level class, in the module or in one module of the package, whose body declares ``kind =
"<name>"`` (a string literal equal to the module's or package's name). The registry finds the names
by reading its package's sources (``declared``: nothing is imported, so listing them needs no
optional dependency) and imports a module only when its name is used, so an optional dependency (the
``redis`` client, CUDA) is needed only by the part that needs it. Wherever a name is accepted
(``tiers[i].kind``, ``eviction``, ``kvtier simulate --policy``), a class outside kvtier can be named
directly as ``package.module:Class``: the module is imported from the Python path, so a plugin is
one installed (or ``PYTHONPATH``) module and no kvtier file changes. An unknown name, a module that
does not import or a class of the wrong base is a ``ConfigError`` naming the field and listing the
known names, never a fallback.

The config is operator input (like the command line): naming a module imports it, which runs its
code. Only modules already on the Python path can be named; nothing is loaded from a file path.

Loading is the plugin boundary at config time (``load``): a name is checked before anything is
imported (ASCII identifiers, at most ``MAX_PLUGIN_PARTS`` dotted parts and ``MAX_PLUGIN_CHARS``
characters), and whatever importing the module or reading the class raises (any exception,
``SystemExit`` included) becomes a ``ConfigError`` naming the field, with the error shortened. A
class that cannot be built (abstract methods left, or a check of the registry's own failing) is
refused then too, so ``check-config`` refuses what a run would fail on. Only ``KeyboardInterrupt``
passes: it is how Ctrl-C reaches a process, and an operator who stops a slow import wants kvtier
stopped, not a report that the config is bad.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

from kvtier.errors import ConfigError
from kvtier.extras import extra_for, install_hint

PLUGIN_FORM = "package.module:Class"
_PLUGIN = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", re.ASCII)
"""A dotted module path, a colon, a (possibly nested) attribute path: nothing else is imported."""
MAX_PLUGIN_CHARS = 200
"""The longest class path accepted (a real one is far shorter)."""
MAX_PLUGIN_PARTS = 16
"""The most dotted parts of a class path, module and attribute together: importing a module
imports each of its parent packages, one nested call each (300 parts reached ``RecursionError``)."""
ERROR_CHARS = 300
"""How much of a plugin's error text a message quotes."""


def is_plugin_path(text: str) -> bool:
    """True when ``text`` has the ``package.module:Class`` form within the bounds above (not
    whether it imports)."""
    return _plugin_bounds(text) is None and bool(_PLUGIN.fullmatch(text))


def _plugin_bounds(text: str) -> str | None:
    """What is too large about a would-be class path, None when nothing is."""
    if len(text) > MAX_PLUGIN_CHARS:
        return f"at most {MAX_PLUGIN_CHARS} characters (got {len(text):,})"
    if text.count(".") + 2 > MAX_PLUGIN_PARTS:
        return f"at most {MAX_PLUGIN_PARTS} dotted parts (got {text.count('.') + 2:,})"
    return None


def describe(exc: BaseException, named: bool = True) -> str:
    """``Type: text`` (``text`` alone unless ``named``) of an exception a plugin raised, for a
    message: one line, at most ``ERROR_CHARS`` characters, and never raising (a plugin's
    ``__str__`` may)."""
    try:
        text = str(exc)
    except Exception:
        text = "<no text>"
    name = type(exc).__name__
    line = " ".join((f"{name}: {text}" if named else text).split()) if text else name
    return line if len(line) <= ERROR_CHARS else f"{line[:ERROR_CHARS]}... ({len(line):,} chars)"


@dataclass(slots=True)
class Registry:
    """Names of one kind of part -> ``package.module:Class``; see the module docstring."""

    what: str
    """What a name names, for messages ("tier", "eviction policy")."""
    base: str
    """``package.module:Class`` every entry must subclass (imported on first load)."""
    package: str
    """The package whose modules declare the built-in names (``declared``)."""
    verify: Callable[[type[Any]], str | None] | None = field(default=None, compare=False)
    """A check of the registry's own on a loaded class: what the class lacks, None when fine."""
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
        if isinstance(name, str) and len(name) > MAX_PLUGIN_CHARS:
            # The message quotes the start of the name: a megabyte of it helps nobody.
            too_large = _plugin_bounds(name)
            raise ConfigError(
                field, f"{name[:MAX_PLUGIN_CHARS]}...", f"{self.allowed()}: {too_large}"
            )
        too_deep = _plugin_bounds(name) if isinstance(name, str) and ":" in name else None
        if too_deep is not None:
            raise ConfigError(field, name, f"{self.allowed()}: {too_deep}")
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
        module_name, _, attribute = target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except KeyboardInterrupt:
            raise  # Ctrl-C: see the module docstring
        except ImportError as exc:
            if builtin:
                missing = describe(exc, False)
                extra = extra_for(exc)
                hint = f"; install it: {install_hint(extra)}" if extra else ""
                raise ConfigError(
                    field, key, f"its dependency is not installed ({missing}){hint}"
                ) from exc
            raise ConfigError(field, key, f"an importable module ({describe(exc, False)})") from exc
        except BaseException as exc:  # whatever the module's code raised, SystemExit included
            raise ConfigError(field, key, f"an importable module ({describe(exc)})") from exc
        try:
            cls = _attribute(module, attribute)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:
            raise ConfigError(field, key, f"a class that exists ({describe(exc)})") from exc
        wrong = self._unusable(cls)
        if wrong is not None:
            raise ConfigError(field, key, wrong)
        loaded: type[Any] = cls
        return loaded

    def _unusable(self, cls: object) -> str | None:
        """Why ``cls`` cannot serve as one of this registry's classes, None when it can."""
        base = _resolve(self.base)
        try:
            if not (isinstance(cls, type) and issubclass(cls, base)):
                return f"a subclass of {self.base} (got {_short_repr(cls)})"
            if inspect.isabstract(cls):
                missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
                return f"a class that can be built (abstract methods: {missing})"
            return self.verify(cls) if self.verify is not None else None
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # a hostile metaclass
            return f"a class that can be inspected ({describe(exc)})"


def _resolve(target: str) -> Any:
    module_name, _, attribute = target.partition(":")
    return _attribute(importlib.import_module(module_name), attribute)


def _attribute(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _short_repr(obj: object) -> str:
    try:
        text = repr(obj)
    except Exception:
        text = f"<{type(obj).__name__}>"
    return text if len(text) <= ERROR_CHARS else f"{text[:ERROR_CHARS]}..."


def parse_tier_options(cls: type[Any], section: Any, field: str, kind: str) -> Any:
    """``cls.Options.parse(section)``: the tier's own parser, a plugin's code. Its ``ConfigError``
    passes as it is; anything else it raises (``KeyboardInterrupt`` aside) is a ``ConfigError``
    for ``field`` (the tier's ``kind``)."""
    try:
        return cls.Options.parse(section)
    except (KeyboardInterrupt, ConfigError):
        raise
    except BaseException as exc:
        raise ConfigError(
            field, kind, f"a tier whose Options.parse works ({describe(exc)})"
        ) from exc


def _tier_lacks(cls: type[Any]) -> str | None:
    if callable(getattr(getattr(cls, "Options", None), "parse", None)):
        return None
    return "a tier class with an Options record that has parse(section)"


def declared(package: str) -> dict[str, str]:
    """``name -> target`` for every part of ``package`` that declares ``name``, sorted by name.

    A part is a module ``name.py`` with a top-level class whose body declares ``kind = "name"``
    (target ``package.name:Class``), or a package ``name/`` (a folder with ``__init__.py``) whose
    ``__init__.py`` or one of whose modules ``name/module.py`` has such a class (target
    ``package.name:Class`` or ``package.name.module:Class``).

    Read from the sources, nothing imported. A class declaring another name (a shared base class
    such as ``SegmentedBase``) declares nothing; two classes declaring one name are a
    ``ValueError`` (a programming error, caught by the registry tests).
    """
    found: dict[str, str] = {}
    for entry in sorted(resources.files(package).iterdir(), key=lambda entry: entry.name):
        folder = entry.is_dir()
        name = entry.name if folder else entry.name.removesuffix(".py")
        if (name == entry.name and not folder) or name.startswith("_") or not name.isidentifier():
            continue
        if folder:
            if not entry.joinpath("__init__.py").is_file():
                continue
            modules = sorted(
                (part for part in entry.iterdir() if part.name.endswith(".py")),
                key=lambda part: (part.name != "__init__.py", part.name),
            )
            sources = [(_module_path(package, name, part.name), part) for part in modules]
        else:
            sources = [(f"{package}.{name}", entry)]
        targets = [
            f"{module}:{cls}"
            for module, part in sources
            for cls in _classes_declaring(part.read_text(encoding="utf-8"), name)
        ]
        if len(targets) > 1:
            raise ValueError(f"{package}.{name}: classes {targets} all declare kind {name!r}")
        if targets:
            found[name] = targets[0]
    return found


def _module_path(package: str, name: str, file_name: str) -> str:
    """The dotted path of ``file_name`` in the package ``package.name``."""
    stem = file_name.removesuffix(".py")
    return f"{package}.{name}" if stem == "__init__" else f"{package}.{name}.{stem}"


def _classes_declaring(source: str, name: str) -> list[str]:
    """The top-level classes of ``source`` whose body declares ``kind = "name"``."""
    # Most modules never say ``kind = "name"``: parse only those that do.
    if not re.search(rf"^\s+kind\b[^=\n]*=\s*[\"']{name}[\"']", source, re.MULTILINE):
        return []
    return [
        node.name
        for node in ast.parse(source).body
        if isinstance(node, ast.ClassDef) and _declared_kind(node) == name
    ]


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


TIERS = Registry("tier", "kvtier.tiers.base:Tier", "kvtier.tiers", verify=_tier_lacks)
"""Secondary tiers (``tiers[i].kind``): an ``Options`` record with ``parse(section)`` and
``create(name, namespace, pool, options)`` (``kvtier.tiers.base.Tier``)."""

POLICIES = Registry("eviction policy", "kvtier.policies.base:EvictionPolicy", "kvtier.policies")
"""Eviction policies (``eviction``), built by ``create(capacity_blocks)``
(``kvtier.policies.base.EvictionPolicy``)."""

COPY_BACKENDS = Registry("copy backend", "kvtier.copy.base:CopyBackend", "kvtier.copy")
"""Copy backends by the device type of the engine's KV tensors (``tensor.device.type``), built by
``create(kv_caches, setup)`` (``kvtier.copy.base.CopyBackend``)."""

__all__ = [
    "COPY_BACKENDS",
    "PLUGIN_FORM",
    "POLICIES",
    "TIERS",
    "Registry",
    "declared",
    "describe",
    "is_plugin_path",
    "parse_tier_options",
]
