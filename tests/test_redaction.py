"""The one redaction rule (``kvtier.redaction``): no secret and no control character reaches the
terminal through an error, a config echo or a report."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main
from kvtier.config import parse_config, read_config_file
from kvtier.errors import ConfigError
from kvtier.redaction import (
    is_secret_name,
    mask_url,
    printable,
    redact_string,
    redact_value,
    yaml_problem,
)
from kvtier.validation import Section

SECRET = "hunter2"


def cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "spec",
    [
        f"redis:password={SECRET},timeout_s=[",
        f"redis:url=redis://:{SECRET}@h:1/0,timeout_s=[",
        f"redis:url=redis://user:{SECRET}@h:1/0,timeout_s=[",
        f"redis:url=rediss://:{SECRET}@h,io_threads=x=y",
        f"redis:password=[{SECRET}",
        f"redis:redis://:{SECRET}@h:1/xyz",
        f"fs:redis://:{SECRET}@h",  # split at its last ":", the password was shown as a capacity
        f"memory:rediss://u:{SECRET}@h",
    ],
)
def test_an_invalid_tier_spec_never_prints_its_password(
    capsys: pytest.CaptureFixture[str], spec: str
) -> None:
    code, out, err = cli(capsys, "simulate", "--limit", "1", "--no-progress", "--tier", spec)
    assert code == 2 and out == ""
    assert err.startswith("kvtier: error: ") and err.count("\n") == 1, err
    assert SECRET not in err
    assert "Traceback" not in err


def test_a_yaml_syntax_error_does_not_quote_the_password_line(tmp_path: Path) -> None:
    path = tmp_path / "kvtier.yaml"
    path.write_text(f'tiers:\n  - kind: redis\n    password: "{SECRET}\n    url: x: y\n')
    with pytest.raises(ConfigError) as info:
        read_config_file(path)
    message = str(info.value)
    assert SECRET not in message
    assert "line" in message and "\n" not in message


def test_a_yaml_error_in_a_tier_spec_value_is_described_without_its_text(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The spec is shown once (timeout_s is no secret); YAML's snippet of it once quoted it again.
    code, _out, err = cli(capsys, "simulate", "--tier", f"redis:timeout_s=[{SECRET}")
    assert code == 2 and err.count(SECRET) == 1
    assert "a YAML value for timeout_s" in err and "line 1, column" in err


def test_config_values_shown_in_errors_are_redacted() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": [f"redis:password={SECRET}"]})  # not a mapping: shown
    assert SECRET not in str(info.value) and "password=***'" in str(info.value)
    with pytest.raises(ConfigError) as info:
        Section({"api_token": SECRET}, "tiers[0]").integer("api_token")  # a plugin's secret
    assert SECRET not in str(info.value)
    with pytest.raises(ConfigError) as info:
        parse_config({"tiers": [[{"password": SECRET, "kind": "redis"}]]})
    assert SECRET not in str(info.value)


def test_check_config_neutralises_control_characters(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    shm = tmp_path / "\x1b[31mred"
    shm.mkdir()
    path = tmp_path / "kvtier.json"
    path.write_text(json.dumps({"pool": {"size": "1MiB", "shm_dir": str(shm)}}))
    code, out, _err = cli(capsys, "check-config", str(path))
    assert code == 0
    assert "\x1b" not in out and "\\x1b[31mred" in out


def test_errors_neutralise_control_characters(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = cli(capsys, "simulate", "--trace", str(tmp_path / "x\x1b[2J\u202e"))
    assert code == 2 and out == ""
    assert "\x1b" not in err and "\u202e" not in err and "\\x1b[2J" in err


def test_stats_report_neutralises_tier_names(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    results = Path(__file__).resolve().parents[1] / "docs" / "results" / "vllm_gpu_bench.json"
    snapshot = json.loads(results.read_text())["configs"]["kvtier_fs"]["kvtier_stats"]
    snapshot["tiers"] = {"\x1b]0;owned\x07fs": {"lookups": 1, "lookup_hits": 0}}
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(snapshot))
    code, out, err = cli(capsys, "stats", str(path))
    assert code == 0, err
    assert "\x1b" not in out and "\x07" not in out and "\\x1b]0;owned\\x07fs" in out


# -- the rule itself ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://u:pw@h:1/0", "redis://u:***@h:1/0"),
        ("rediss://:pw@h", "rediss://:***@h"),
        ("redis://h:1", "redis://h:1"),
        ("redis://pw@h", "redis://***@h"),  # a lone user-info may be a password
        ("redis://u:p@w/x@h", "redis://u:***@h"),
        ("redis://u:p w@h", "redis://u:***@h"),
        ("--tier='redis:redis://:pw@h'", "--tier='redis:redis://:***@h'"),
    ],
)
def test_mask_url(url: str, shown: str) -> None:
    assert mask_url(url) == shown
    assert mask_url(shown) == shown  # idempotent


def test_secret_names() -> None:
    assert is_secret_name("password") and is_secret_name("tiers[0].password")
    assert is_secret_name("api_token") and is_secret_name("client_secret")
    assert not is_secret_name("tokens") and not is_secret_name("block.tokens")
    assert not is_secret_name("password_env") and not is_secret_name(3)


def test_redact_value_masks_secret_keys_at_any_depth_and_keeps_sharing() -> None:
    shared = {"password": SECRET}
    value = {"a": [shared, shared], "url": f"redis://:{SECRET}@h", "tokens": 5}
    out = redact_value(value)
    assert SECRET not in repr(out)
    assert out["tokens"] == 5 and out["a"][0] is out["a"][1]
    # The rest of the string goes too: a password may hold "," (the spec then splits it).
    assert redact_string(f"redis:password={SECRET},timeout_s=2") == "redis:password=***"
    assert redact_string(f"redis:password=ab,{SECRET}") == "redis:password=***"


def test_printable() -> None:
    assert printable("plain") == "plain"
    assert printable("a\x1b[31mb\x00\u202e") == "a\\x1b[31mb\\x00\\u202e"
    assert printable("a\nb", keep_newlines=True) == "a\nb"
    assert printable("a\nb") == "a\\x0ab"


def test_yaml_problem_has_no_snippet() -> None:
    import yaml

    with pytest.raises(yaml.YAMLError) as info:
        yaml.safe_load(f'password: "{SECRET}\n')
    assert SECRET in str(info.value)  # PyYAML quotes the line
    assert SECRET not in yaml_problem(info.value)
    with pytest.raises(yaml.YAMLError) as info:
        yaml.safe_load(f"password: *{SECRET}")  # PyYAML names the undefined alias
    assert SECRET not in yaml_problem(info.value)
    assert "line 1, column 11" in yaml_problem(info.value)


@pytest.mark.timeout(20)
def test_a_megabyte_value_in_an_error_is_redacted_in_linear_time() -> None:
    """Before: both patterns were tried from every position inside a long run of name
    characters (40,000 characters took 45 s), so a huge config value hung kvtier."""
    value = "m" * 1_000_000
    assert redact_string(value) == value
    assert SECRET not in str(ConfigError("pool.size", f"{'x' * 500_000}password={SECRET}", "y"))
    assert mask_url("a" * 500_000 + f"redis://u:{SECRET}@h") == "a" * 500_000 + "redis://u:***@h"
