"""Fuzz of plugin names (``tiers[i].kind``, ``eviction``) through the config loader: random dotted
names built from real and made-up parts, huge and deep names, unicode and control characters, and
modules that fail at import in every way a module can (``tests/test_plugins.py``'s hostile
modules). Every input either loads or raises ``ConfigError`` naming the field with a message of
bounded length; anything else (a traceback, ``SystemExit``, a hang) fails the test.

Names are built from a fixed vocabulary of module parts (kvtier's own, the test plugins, the
hostile package, made-up ``kvtier_fuzz_*`` names) so no arbitrary module of the Python path is
imported. Derandomized: the same inputs in every run. The counts per outcome are printed.
"""

from __future__ import annotations

import importlib
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from plugin_examples import broken_modules
from support.fuzzing import counts_line, print_line

from kvtier.config import load_config
from kvtier.errors import ConfigError

OUTCOMES: Counter[str] = Counter()
MAX_MESSAGE = 1_000
"""The longest error message a name may produce (the name itself is shortened)."""

HOSTILE_PACKAGE = "kvtier_fuzz_broken"
ROOT = Path(tempfile.mkdtemp(prefix="kvtier-fuzz-plugins-"))
broken_modules.write_package(ROOT / HOSTILE_PACKAGE)
sys.path.insert(0, str(ROOT))  # for this module's run: the name is unique to it
importlib.invalidate_caches()
GOOD_NAMES = [
    "plugin_examples.dict_tier:DictTier",
    "plugin_examples.fifo_policy:FifoPolicy",
    "kvtier.policies.lru:LRUPolicy",
    "kvtier.tiers.memory:MemoryTier",
]

MODULE_PARTS = [
    "kvtier",
    "tiers",
    "policies",
    "base",
    "fs",
    "lru",
    "memory",
    "registry",
    "plugin_examples",
    "dict_tier",
    "fifo_policy",
    "hostile",
    HOSTILE_PACKAGE,
    "raises",
    "exits",
    "getattr_raises",
    "recursion",
    "syntax",
    "kvtier_fuzz_missing",
]
CLASS_PARTS = [
    "Tier",
    "EvictionPolicy",
    "DictTier",
    "FifoPolicy",
    "LRUPolicy",
    "FsTier",
    "Options",
    "HostilePolicy",
    "TierFailingToBuild",
    "TierWithoutOptions",
    "TierWithFailingOptions",
    "PolicyFailingToBuild",
    "NotAPolicy",
    "parse",
    "__class__",
    "__dict__",
]
identifier = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,12}", fullmatch=True)
module_part = st.one_of(st.sampled_from(MODULE_PARTS), identifier.map(lambda s: f"kvtier_fuzz_{s}"))
class_part = st.one_of(st.sampled_from(CLASS_PARTS), identifier)

dotted = st.builds(
    lambda modules, classes: f"{'.'.join(modules)}:{'.'.join(classes)}",
    st.lists(module_part, min_size=1, max_size=5),
    st.lists(class_part, min_size=1, max_size=3),
)
deep = st.builds(
    lambda n, part: ".".join([part] * n) + ":C",
    st.integers(10, 3000),
    st.sampled_from(["a", "kvtier"]),
)
huge = st.builds(lambda n, c: c * n + ":C", st.integers(150, 2_000_000), st.sampled_from("mM_."))
odd_text = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=0, max_size=60
).map(lambda s: s if ":" in s else f"{s}:C")
spliced = st.builds(
    lambda name, at, junk: name[:at] + junk + name[at:],
    dotted,
    st.integers(0, 40),
    st.sampled_from(["\n", "\x1b[31m", "\0", " ", "ü", "::", "..", "/", "\u202e", "\t"]),
)
names = st.one_of(
    dotted, dotted, deep, huge, odd_text, spliced, st.sampled_from(["", ":", "a:", *GOOD_NAMES])
)


@pytest.fixture(scope="module", autouse=True)
def report_counts(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    print_line(request, counts_line("plugin names tried", dict(sorted(OUTCOMES.items()))))


def _load(config: dict[str, Any], field: str) -> str:
    try:
        load_config(config)
    except ConfigError as exc:
        assert exc.field == field, exc
        assert len(str(exc)) <= MAX_MESSAGE, str(exc)[:300]
        return "ConfigError"
    return "loaded"


@settings(
    max_examples=1500,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(name=names)
def test_plugin_names_load_or_are_one_config_error(name: str) -> None:
    OUTCOMES["tier " + _load({"tiers": [{"kind": name}]}, "tiers[0].kind")] += 1
    OUTCOMES["eviction " + _load({"eviction": name}, "eviction")] += 1


def test_the_fuzz_reached_every_outcome_it_should() -> None:
    """Run after the fuzz (file order): names that load and names refused both came up."""
    assert OUTCOMES["tier ConfigError"] > 500 and OUTCOMES["eviction ConfigError"] > 500
    assert OUTCOMES["tier loaded"] + OUTCOMES["eviction loaded"] > 0
