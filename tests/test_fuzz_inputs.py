"""Fuzzing every input kvtier parses: config mappings, YAML and JSON config files, ``--tier``
specs and trace files, directly and through the real command line (``cli.main`` in process).

The promise under test: whatever the input, the result is a parsed value or one error that names
what was wrong, ``ConfigError`` naming a config field (or ``config file``), ``TraceError`` naming
``file:line``, or from the CLI exit code 2 with exactly one line ``kvtier: error: ...``. Any other
exception (a traceback) fails the test. Hypothesis runs derandomized (the same inputs in every
run, so CI is reproducible); the number of inputs tried is printed at the end of the module.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from support.fuzzing import counts_line, fuzz_settings, print_line

from kvtier import cli
from kvtier.config import KVTierConfig, load_config
from kvtier.errors import ConfigError
from kvtier.registry import TIERS
from kvtier.sim import simulate as simulate_module
from kvtier.sim.trace import TraceError, TraceRequest, parse_request, read_trace
from kvtier.tiers import tier_class

TRIED: Counter[str] = Counter()
"""Inputs tried per fuzz target (printed at the end of the module, checked per test)."""
MIN_TOTAL = 10_000


TARGETS = 9


@pytest.fixture(scope="module", autouse=True)
def report_counts(request: pytest.FixtureRequest) -> Iterator[None]:
    """Prints the inputs tried (also under ``pytest -q``) and, when the whole module ran, checks
    that they were at least ``MIN_TOTAL``."""
    yield
    line = counts_line("fuzz inputs tried", TRIED)
    print_line(request, line)
    if len(TRIED) == TARGETS:
        assert sum(TRIED.values()) >= MIN_TOTAL, line


WORK = Path(tempfile.mkdtemp(prefix="kvtier-fuzz-"))
"""Files the inputs are written to (hypothesis reruns a test body many times in one test, so a
function-scoped tmp_path would be shared anyway)."""


# -- input strategies ----------------------------------------------------------------------------

NASTY_NUMBERS = [
    math.nan,
    math.inf,
    -math.inf,
    0,
    -1,
    0.0,
    -0.0,
    1e-300,
    1e308,
    10**400,
    -(10**400),
    2**63,
    2**63 - 1,
    -(2**63) - 1,
    2**64,
    2**127,
    2**128,
    0.5,
    1.5,
]
NASTY_STRINGS = [
    "",
    " ",
    "\0",
    "/tmp/kv\0tier",
    "64GiB",
    "1.5TB",
    "0",
    "-1GiB",
    "1" * 400,
    "1" * 400 + "GiB",
    "9" * 30 + "TiB",
    "1e9",
    "nan",
    "inf",
    "lru",
    "arc",
    "auto",
    "kernel",
    "through",
    "on_evict",
    "memory",
    "fs",
    "redis",
    "BLNHC",
    "engine",
    "redis://127.0.0.1:6379/0",
    "redis://[::1",
    "redis://[::1]:99999",
    "redis://h:abc",
    "redis://h:0",
    "redis://u:pw@h:1/0",
    "redis://u:p/w@h:1/0",
    "rediss://:pw@[::1]:6380",
    "unix:///tmp/r.sock",
    "unix://\0",
    "redis://h\n:1",
    "../etc",
    "pool",
]
SPECIAL = st.sampled_from([None, True, False, *NASTY_NUMBERS, *NASTY_STRINGS])
scalars = SPECIAL | st.integers() | st.floats() | st.text(max_size=8)
any_keys = st.sampled_from([1, -1, None, True, 1.5, "", " pool", "a\nb", "\0"]) | st.text(
    max_size=6
)
values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(any_keys, kids, max_size=3),
    max_leaves=4,
)


def tier_option_keys(kind: str) -> list[str]:
    options = tier_class(kind).Options
    keys = [f.name for f in fields(options) if f.name != "config_path"]
    return keys + (["password_env"] if kind == "redis" else [])


def mapping(pairs: list[tuple[str, st.SearchStrategy[Any]]]) -> st.SearchStrategy[dict[Any, Any]]:
    """Mappings of up to 4 entries, mostly known keys with their own values, some unknown keys."""
    entry = st.one_of(
        *(st.tuples(st.just(key), strategy) for key, strategy in pairs), st.tuples(any_keys, values)
    )
    return st.lists(entry, max_size=4).map(dict)


def section(keys: list[str]) -> st.SearchStrategy[Any]:
    """A section of a config: a mapping of mostly its own keys, or any value at all."""
    return mapping([(key, values) for key in keys]) | values


def tier_entry() -> st.SearchStrategy[Any]:
    per_kind = [
        mapping([(key, values) for key in ["name", "write", *tier_option_keys(kind)]]).map(
            lambda entry, kind=kind: {**entry, "kind": kind}
        )
        for kind in TIERS
    ]
    return st.one_of(*per_kind, values)


TOP: list[tuple[str, st.SearchStrategy[Any]]] = [
    ("model", values),
    ("tenant", values),
    (
        "pool",
        section(
            [
                "size",
                "shm_dir",
                "allow_pageable",
                "writeback_window",
                "promotion_budget",
                "promotion_costs",
            ]
        ),
    ),
    ("block", section(["tokens", "bytes"])),
    ("eviction", values),
    ("admission", section(["min_seen", "max_tracked"])),
    ("tiers", st.lists(tier_entry(), max_size=3) | values),
    ("job_timeout_s", values),
    ("events", values),
    ("copy", section(["strategy", "max_sms"])),
    (
        "vllm",
        section(
            ["blocks_per_slot", "store_generated", "async_loads", "stats_path", "kv_cache_layout"]
        ),
    ),
]
config_dicts = mapping(TOP)

SYNTAX = [*"[]{}:,-#&*!|>'\"%@`?\\\n\t ", "\0", "\x85", "\ufeff", ".nan", ".inf", "~"]


def pieces(alphabet: list[str], max_size: int) -> st.SearchStrategy[str]:
    """Text of syntax pieces and any characters."""
    return st.lists(st.sampled_from(alphabet) | st.characters(), max_size=max_size).map("".join)


@st.composite
def mutated(draw: st.DrawFn, text: str, alphabet: list[str]) -> str:
    """``text`` with a few characters inserted, deleted or replaced."""
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(text)))
        piece = draw(st.sampled_from(alphabet) | st.text(max_size=3))
        cut = draw(st.integers(0, 2))
        text = text[:at] + piece + text[at + cut :]
    return text


def dump_yaml(data: Any) -> str:
    try:
        return yaml.safe_dump(data, allow_unicode=True, default_flow_style=None)
    except (yaml.YAMLError, ValueError):  # keys YAML cannot write
        return repr(data)


def dump_json(data: Any) -> str:
    try:
        return json.dumps(data)  # NaN and Infinity as JavaScript literals, which json.loads reads
    except (TypeError, ValueError):  # keys JSON cannot write
        return repr(data)


def nested(depth: int, open_: str, close: str, inner: str = "1") -> str:
    return open_ * depth + inner + close * depth


DEPTHS = st.sampled_from([1, 2, 30, 31, 32, 33, 34, 100, 1000, 5000])
"""Nesting depths around the config's limit (32) and far beyond it; a handful of values because
refusing YAML nested 5,000 deep takes PyYAML about 0.5 s."""
hostile_texts = st.one_of(
    DEPTHS.map(lambda n: "a: " + nested(n, "[", "]")),
    DEPTHS.map(lambda n: nested(n, "{a: ", "}")),
    DEPTHS.map(lambda n: "- " * n + "x"),
    st.integers(300, 6000).map(lambda n: "pool: {size: " + "7" * n + "}"),
    st.integers(1, 8).map(
        lambda n: (
            "a: &a [x]\n"
            + "".join(
                f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}]\n"
                for i in range(n)
            )
            + f"tiers: *{chr(97 + n)}\n"
        )
    ),
)
yaml_texts = st.one_of(
    config_dicts.map(dump_yaml).flatmap(lambda t: mutated(t, SYNTAX)),
    config_dicts.map(dump_yaml),
    pieces(SYNTAX, 30),
    hostile_texts,
)
json_texts = st.one_of(
    config_dicts.map(dump_json).flatmap(lambda t: mutated(t, SYNTAX)),
    config_dicts.map(dump_json),
    st.integers(1, 200_000).map(lambda n: nested(n, "[", "]")),
    st.integers(300, 6000).map(lambda n: '{"pool": {"size": ' + "3" * n + "}}"),
)

SPEC_CHARS = list(":=,/[]{}.-_ ~@\0\n'\"&*!%") + list("0123456789GiBKMTbkx") + [".nan", ".inf"]
spec_texts = st.one_of(
    pieces(SPEC_CHARS, 20),
    st.builds(
        lambda kind, rest: f"{kind}:{rest}",
        st.sampled_from([*TIERS, "", "s3"]),
        pieces(SPEC_CHARS, 20) | st.sampled_from(NASTY_STRINGS),
    ),
    st.builds(
        lambda kind, pairs: kind + ":" + ",".join(f"{k}={v}" for k, v in pairs),
        st.sampled_from(list(TIERS)),
        st.lists(
            st.tuples(
                st.sampled_from(sorted({k for kind in TIERS for k in tier_option_keys(kind)}))
                | st.text(max_size=5),
                st.sampled_from([*NASTY_STRINGS, ".nan", "[", "{a: 1", "1" * 5000, "&x", "*y"])
                | pieces(SPEC_CHARS, 6),
            ),
            max_size=4,
        ),
    ),
)

trace_objects = st.fixed_dictionaries(
    {},
    optional={
        "timestamp": values,
        "input_length": values,
        "output_length": values,
        "hash_ids": st.lists(st.integers() | st.sampled_from(NASTY_NUMBERS) | values, max_size=4)
        | values,
    },
)
trace_lines = st.one_of(
    trace_objects.map(dump_json),
    trace_objects.map(dump_json).flatmap(lambda t: mutated(t, SYNTAX)),
    st.text(max_size=40),
    st.integers(1, 200_000).map(lambda n: nested(n, "[", "]")),
    st.integers(1, 2_000).map(lambda n: nested(n, '{"hash_ids": ', "}", "[1]")),
    st.integers(300, 6000).map(lambda n: '{"hash_ids": [' + "5" * n + "]}"),
    st.integers(300, 500).map(lambda n: '{"hash_ids": [1], "timestamp": 1' + "0" * n + "}"),
)
trace_files = st.lists(
    trace_lines.map(lambda t: t.encode("utf-8", "surrogatepass")) | st.binary(max_size=40),
    max_size=5,
).map(lambda lines: b"\n".join(line.replace(b"\n", b" ") for line in lines))


# -- what every outcome must look like -----------------------------------------------------------


def assert_names_field(error: ConfigError) -> None:
    message = str(error)
    assert isinstance(error.field, str) and error.field
    assert message.startswith(f"invalid config {error.field}="), message
    assert "\n" not in message and len(message) < 4000, message


def assert_names_line(error: TraceError, where: str) -> None:
    message = str(error)
    assert message.startswith(f"{where}: "), message
    assert "\n" not in message and len(message) < 4000, message


class Accepted(BaseException):
    """Raised in place of building the cache: the CLI accepted every input (nothing is built, so
    fuzzed fs paths and Redis URLs are never touched)."""


@contextlib.contextmanager
def cli_without_building() -> Iterator[None]:
    def build_cache(*args: object, **kwargs: object) -> Any:
        raise Accepted

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(simulate_module, "build_cache", build_cache)
        yield


def run_cli(*args: str) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of ``kvtier ARGS`` in process; code None: accepted."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), cli_without_building():
        try:
            code: int | None = cli.main(list(args))
        except Accepted:
            code = None
    return code, out.getvalue(), err.getvalue()


def assert_one_line_error(code: int | None, err: str, *prefixes: str) -> None:
    assert code == 2, (code, err)
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert err.startswith(tuple(f"kvtier: error: {p}" for p in prefixes)), err


def write(name: str, content: str | bytes) -> Path:
    path = WORK / name
    if isinstance(content, str):
        path.write_bytes(content.encode("utf-8", "surrogatepass"))
    else:
        path.write_bytes(content)
    return path


def counted(target: str, examples: int) -> None:
    assert TRIED[target] >= examples, f"{target}: only {TRIED[target]} of {examples} inputs ran"


# -- config --------------------------------------------------------------------------------------

N_DICTS = 2500


def test_config_mappings() -> None:
    @fuzz_settings(N_DICTS)
    @given(config_dicts)
    def run(data: dict[Any, Any]) -> None:
        TRIED["config mappings"] += 1
        try:
            config = load_config(data)
            copy_section = cli.owned_sections(config)  # as check-config: each owner's section
        except ConfigError as error:
            assert_names_field(error)
            return
        assert isinstance(config, KVTierConfig)
        # what check-config prints: never a URL's password
        text = cli.describe_config(config, copy_section)
        for tier in config.tiers:
            password = urlsplit(getattr(tier.options, "url", "")).password
            assert not password or f":{password}@" not in text

    run()
    counted("config mappings", N_DICTS)


N_YAML = 1500


def test_yaml_files() -> None:
    @fuzz_settings(N_YAML)
    @given(yaml_texts)
    def run(text: str) -> None:
        TRIED["YAML files"] += 1
        try:
            config = load_config(write("c.yaml", text))
        except ConfigError as error:
            assert_names_field(error)
            return
        assert isinstance(config, KVTierConfig)

    run()
    counted("YAML files", N_YAML)


N_JSON = 700


def test_json_files() -> None:
    @fuzz_settings(N_JSON)
    @given(json_texts | st.binary(max_size=30).map(lambda b: b.decode("latin-1")))
    def run(text: str) -> None:
        TRIED["JSON files"] += 1
        try:
            config = load_config(write("c.json", text))
        except ConfigError as error:
            assert_names_field(error)
            return
        assert isinstance(config, KVTierConfig)

    run()
    counted("JSON files", N_JSON)


N_SPECS = 2000


def test_tier_specs() -> None:
    @fuzz_settings(N_SPECS)
    @given(spec_texts)
    def run(spec: str) -> None:
        TRIED["--tier specs"] += 1
        try:
            entry = cli.parse_tier_spec(spec)
        except ConfigError as error:
            assert_names_field(error)
            assert error.field == "--tier"
            return
        try:
            load_config({"tiers": [entry]})
        except ConfigError as error:
            assert_names_field(error)
            assert error.field.startswith("tiers[0]"), error.field

    run()
    counted("--tier specs", N_SPECS)


# -- traces --------------------------------------------------------------------------------------

N_LINES = 2100


def test_trace_lines() -> None:
    @fuzz_settings(N_LINES)
    @given(trace_lines, st.integers(1, 10**6))
    def run(line: str, lineno: int) -> None:
        TRIED["trace lines"] += 1
        where = f"trace.jsonl:{lineno}"
        try:
            request = parse_request(line, where)
        except TraceError as error:
            assert_names_line(error, where)
            return
        assert isinstance(request, TraceRequest)
        assert math.isfinite(request.timestamp)
        assert all(-(2**127) <= h < 2**127 for h in request.hash_ids)

    run()
    counted("trace lines", N_LINES)


N_TRACE_FILES = 500


def test_trace_files() -> None:
    @fuzz_settings(N_TRACE_FILES)
    @given(trace_files)
    def run(content: bytes) -> None:
        TRIED["trace files"] += 1
        path = write("t.jsonl", content)
        try:
            read_trace(path)
        except TraceError as error:
            message = str(error)
            assert message.startswith(f"{path}:") and "\n" not in message, message
            line = int(message[len(f"{path}:") :].split(":", 1)[0])
            assert 1 <= line <= content.count(b"\n") + 1

    run()
    counted("trace files", N_TRACE_FILES)


# -- the command line, in process ----------------------------------------------------------------

N_CLI_CONFIGS = 400


def test_cli_check_config() -> None:
    @fuzz_settings(N_CLI_CONFIGS)
    @given(yaml_texts)
    def run(text: str) -> None:
        TRIED["kvtier check-config"] += 1
        path = write("check.yaml", text)
        code, out, err = run_cli("check-config", str(path))
        if code == 0:
            assert out.startswith(f"{path}: valid\n") and err == ""
        else:
            assert_one_line_error(code, err, "invalid config ")

    run()
    counted("kvtier check-config", N_CLI_CONFIGS)


N_CLI_SPECS = 400


def test_cli_simulate_tiers() -> None:
    trace = write("one.jsonl", '{"hash_ids": [1, 2]}\n')

    @fuzz_settings(N_CLI_SPECS)
    @given(st.lists(spec_texts, min_size=1, max_size=2))
    def run(specs: list[str]) -> None:
        TRIED["kvtier simulate --tier"] += 1
        args = [f"--tier={spec}" for spec in specs]
        code, _, err = run_cli("simulate", "--no-progress", "--trace", str(trace), *args)
        if code is not None:
            assert_one_line_error(code, err, "invalid config --tier=", "invalid config tiers[")

    run()
    counted("kvtier simulate --tier", N_CLI_SPECS)


N_CLI_TRACES = 300


def test_cli_simulate_traces() -> None:
    @fuzz_settings(N_CLI_TRACES)
    @given(trace_files)
    def run(content: bytes) -> None:
        TRIED["kvtier simulate --trace"] += 1
        path = write("cli.jsonl", content)
        code, _, err = run_cli("simulate", "--no-progress", "--trace", str(path))
        if code is not None:
            assert_one_line_error(code, err, f"{path}:")

    run()
    counted("kvtier simulate --trace", N_CLI_TRACES)
