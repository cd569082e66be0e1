"""The ``kvtier`` command line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvtier.cli import main, parse_tier_spec
from kvtier.errors import ConfigError
from kvtier.sim.replay import Replayer
from kvtier.validation import parse_size, written_size


def simulate_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    code = main(["simulate", "--json", "--no-progress", *args])
    out, err = capsys.readouterr()
    assert code == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


def fails(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = main(list(args))
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    assert err.startswith("kvtier: error: ")
    assert "Traceback" not in err
    return err


# -- --tier specs ---------------------------------------------------------------------------------


def short_id(value: object) -> str:
    """Test ids of a readable length (some inputs are 100,000 characters)."""
    text = str(value)
    return text if len(text) <= 40 else f"{text[:30]}...({len(text)} chars)"


@pytest.mark.parametrize(
    ("spec", "entry"),
    [
        ("memory", {"kind": "memory"}),
        ("memory:1GiB", {"kind": "memory", "capacity": "1GiB"}),
        ("fs:/tmp/kv:10GiB", {"kind": "fs", "path": "/tmp/kv", "capacity": "10GiB"}),
        ("fs:/a:b/c:5GB", {"kind": "fs", "path": "/a:b/c", "capacity": "5GB"}),
        ("redis:redis://h:6379/0", {"kind": "redis", "url": "redis://h:6379/0"}),
        (
            "memory:latency_ms=2,failure_rate=0.1,name=slow",
            {"kind": "memory", "latency_ms": 2, "failure_rate": 0.1, "name": "slow"},
        ),
        (
            "fs:path=/x,capacity=1GiB,fsync=true",
            {"kind": "fs", "path": "/x", "capacity": "1GiB", "fsync": True},
        ),
    ],
)
def test_tier_specs(spec: str, entry: dict[str, Any]) -> None:
    assert parse_tier_spec(spec) == entry


@pytest.mark.parametrize("spec", [":1GiB", "fs:/only", "fs::1GiB", "s3:bucket", "memory:a=1,b"])
def test_bad_tier_specs(spec: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_tier_spec(spec)
    assert (info.value.field, info.value.value) == ("--tier", spec)


# -- simulate -------------------------------------------------------------------------------------


def test_simulate_defaults_to_bundled_trace_and_config(capsys: pytest.CaptureFixture[str]) -> None:
    result = simulate_json(capsys, "--limit", "300")
    assert result["trace"] == "synthetic_trace.jsonl"
    assert result["requests"] == 300
    assert result["pool_blocks"] == 4000  # 250GiB / 64MiB in the embedded config
    assert result["block_bytes"] == 64 * 1024**2 and result["payload_bytes"] == 4096
    assert result["policy"] == "hinted" and result["admission_min_seen"] == 1
    assert [t["name"] for t in result["tiers"]] == ["pool"]
    assert result["mismatched_blocks"] == 0
    assert 0 < result["hit_blocks"] < result["blocks"]
    assert result["manager_ops"] >= 3 * 300 and result["ops_per_s"] > 0
    assert result["machine"]


def test_simulate_options_reach_the_replay(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    result = simulate_json(
        capsys,
        "--limit",
        "200",
        "--pool-blocks",
        "150",
        "--policy",
        "arc",
        "--admission",
        "2",
        "--tier",
        "memory:1MiB",
        "--tier",
        f"fs:{tmp_path}:1GiB",
        "--write",
        "on_evict",
        "--payload-bytes",
        "512",
    )
    assert result["pool_blocks"] == 150 and result["payload_bytes"] == 512
    assert result["policy"] == "arc" and result["admission_min_seen"] == 2
    tiers = {t["name"]: t for t in result["tiers"]}
    assert list(tiers) == ["pool", "memory", "fs"]
    assert tiers["memory"]["kind"] == "memory" and tiers["memory"]["write"] == "on_evict"
    assert tiers["fs"]["write"] == "on_evict"
    assert result["cache"]["cache"]["store_skipped_admission"] > 0
    assert tiers["memory"]["written_blocks"] > 0
    assert result["mismatched_blocks"] == 0


def test_pool_size_is_counted_in_block_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    result = simulate_json(capsys, "--limit", "10", "--pool-size", "64GiB")
    assert result["pool_blocks"] == 1024


def test_config_file_and_overrides(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "kvtier.yaml"
    config.write_text(
        "pool: {size: 20MiB}\nblock: {bytes: 1MiB}\neviction: arc\n"
        "tiers:\n  - {kind: memory, name: ram, capacity: 1MiB}\n"
    )
    result = simulate_json(capsys, "--config", str(config), "--limit", "50", "--write", "on_evict")
    assert result["pool_blocks"] == 20
    assert result["policy"] == "arc"
    assert [(t["name"], t["write"]) for t in result["tiers"]] == [("pool", ""), ("ram", "on_evict")]
    # --policy overrides the file
    result = simulate_json(capsys, "--config", str(config), "--limit", "5", "--policy", "lru")
    assert result["policy"] == "lru"


def test_progress_goes_to_stderr_and_json_stays_clean(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["simulate", "--json", "--limit", "40"])
    out, err = capsys.readouterr()
    assert code == 0
    assert json.loads(out)["requests"] == 40
    assert "simulate" in err and "40/40" in err


def test_human_output(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "simulate",
            "--no-progress",
            "--limit",
            "100",
            "--pool-blocks",
            "200",
            "--tier",
            "memory:latency_ms=1",
        ]
    )
    out, err = capsys.readouterr()
    assert code == 0 and err == ""
    result = simulate_json(
        capsys, "--limit", "100", "--pool-blocks", "200", "--tier", "memory:latency_ms=1"
    )
    # The same run in JSON gives the same figures: the replay is deterministic.
    ratio = f"hit ratio   {result['hit_ratio']:.4f} ({result['hit_blocks']} of {result['blocks']}"
    assert ratio in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert lines["trace"].endswith(f"100 requests, {result['blocks']} blocks")
    assert "tiers       pool -> memory (memory, through)" in out
    assert lines["pool"] and lines["memory"] and lines["all"]
    assert "0 mismatched payloads" in lines["checks"]
    assert "ops/s" in lines["manager"]
    assert lines["machine"].startswith("machine ")


def test_mismatch_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def scribble(self: Replayer, key: bytes, slot: int) -> None:
        self.pool.view(slot)[:16] = bytes(16)

    monkeypatch.setattr(Replayer, "write_payload", scribble)
    code = main(["simulate", "--json", "--no-progress", "--limit", "100"])
    out, _ = capsys.readouterr()
    assert code == 1
    assert json.loads(out)["mismatched_blocks"] > 0


def test_errors_are_messages_not_tracebacks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    err = fails(capsys, "simulate", "--pool-size", "1MiB")
    assert "--pool-size='1MiB'" in err and "at least one block of 64.0 MiB" in err

    bad = tmp_path / "bad.yaml"
    bad.write_text("eviction: fifo\n")
    err = fails(capsys, "simulate", "--config", str(bad))
    assert "invalid config eviction='fifo': one of 'arc', 'hinted', 'lru'" in err

    err = fails(capsys, "simulate", "--config", str(tmp_path / "none.yaml"))
    assert "none.yaml" in err

    err = fails(capsys, "simulate", "--tier", "fs:/only")
    assert "fs:PATH:CAPACITY" in err

    err = fails(capsys, "simulate", "--tier", "ftp:host=x")
    assert "tiers[0].kind='ftp'" in err

    err = fails(capsys, "simulate", "--tier", "memory:capacity=0")
    assert "tiers[0].capacity=0" in err

    err = fails(capsys, "simulate", "--trace", str(tmp_path / "missing.jsonl"))
    assert "cannot read trace" in err


def test_argparse_rejects_bad_choices(capsys: pytest.CaptureFixture[str]) -> None:
    for args in (["simulate", "--policy", "fifo"], ["simulate", "--pool-blocks", "0"], []):
        with pytest.raises(SystemExit) as info:
            main(args)
        assert info.value.code == 2
    assert "invalid choice: 'fifo'" in capsys.readouterr().err


def test_check_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(f"model: m\ntiers: [{{kind: fs, path: {tmp_path}, capacity: 1GiB}}]\n")
    assert main(["check-config", str(good)]) == 0
    out = capsys.readouterr().out
    assert f"{good}: valid" in out and "tier fs: fs, write through" in out
    assert "vllm loads sync (the default with tiers)" in out

    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [{kind: fs, path: /x, capacity: 1GiB, fsink: true}]\n")
    err = fails(capsys, "check-config", str(bad))
    assert "tiers[0].fsink=<not shown>" in err


def test_check_config_says_how_the_vllm_connector_loads(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "c.yaml"
    for text, line in [
        ("pool: {size: 1GiB}\n", "vllm loads auto (the default without tiers)"),
        ("vllm: {async_loads: false}\n", "vllm loads sync (as given)"),
        ("vllm: {async_loads: true}\n", "vllm loads async (as given)"),
    ]:
        path.write_text(text)
        assert main(["check-config", str(path)]) == 0
        assert line in capsys.readouterr().out.splitlines()


def test_check_config_never_prints_the_redis_password(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    path = tmp_path / "redis.yaml"
    path.write_text(
        "tiers:\n"
        "  - {kind: redis, url: 'redis://app:s3cr3t-pw@cache.internal:6380/2'}\n"
        "  - {kind: redis, name: r2, url: 'redis://[::1]:6379', password: other-s3cr3t}\n"
    )
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "s3cr3t" not in out
    assert "url redis://app:***@cache.internal:6380/2," in out
    assert "url redis://[::1]:6379," in out


def test_check_config_prints_sizes_and_modes_as_a_config_writes_them(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Before: ``Options(path=..., capacity=2000000000000, ..., file_mode=384, dir_mode=448,
    ..., config_path='tiers[0]')``."""
    path = tmp_path / "c.yaml"
    path.write_text(
        f"pool: {{size: 1280KiB}}\nblock: {{bytes: 4097}}\n"
        f"tiers:\n  - {{kind: fs, path: {tmp_path}, capacity: 2TB, min_free: 1GiB,"
        " file_mode: 0o640, dir_mode: 0o750, io_timeout_s: 2.5}\n"
        "  - {kind: memory, capacity: 3MB}\n"
    )
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "\npool 1280KiB in /dev/shm\nblock 512 tokens, 4097 (4.0 KiB)\n" in out
    assert "tier fs: fs, write through\n" in out
    assert (
        f"  path {tmp_path}, capacity 2TB (1.8 TiB), fsync false, threads 4, file_mode 0o640, "
        "dir_mode 0o750, min_free 1GiB, io_timeout_s 2.5, eviction lru\n"
    ) in out
    assert "  capacity 3MB (2.9 MiB), capacity_blocks none, latency_ms 0," in out
    assert "Options(" not in out and "config_path" not in out


def test_written_sizes_read_back_as_the_same_bytes() -> None:
    for n in [0, 1, 1000, 1024, 1536, 4097, 2 * 10**12, 64 << 30, 1310720, 10**12 + 1, 2**63 - 1]:
        text = written_size(n)
        assert parse_size(text.split(" (")[0], "x") == n, text
    assert written_size(2 * 10**12) == "2TB (1.8 TiB)" and written_size(64 << 30) == "64GiB"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("job_timeout_s: .nan\n", "job_timeout_s=nan"),
        ("pool: {writeback_window: .inf}\n", "pool.writeback_window=inf"),
        ("tiers: [{kind: memory, latency_ms: .nan}]\n", "tiers[0].latency_ms=nan"),
        ("tiers: [{kind: redis, ttl_s: .inf}]\n", "tiers[0].ttl_s=inf"),
        ("tiers: [{kind: redis, url: 'redis://h:99999'}]\n", "tiers[0].url='redis://h:99999'"),
        ("tiers: [{kind: redis, url: 'redis://h:abc'}]\n", "tiers[0].url='redis://h:abc'"),
        (
            "tiers: [{kind: redis, url: 'redis://u:pw@[::1:6379'}]\n",
            "tiers[0].url='redis://u:***@[::1:6379': a valid URL",
        ),
        ("vllm: {blocks_per_slt: 2}\n", "vllm.blocks_per_slt=<not shown>: not a known option"),
        ("pool: {size: " + "9" * 400 + "}\n", "pool.size=999"),
        ("1: a\n'2': b\n", "invalid config 2=<not shown>: not a known option"),
        ("a: " + "[" * 5000 + "]" * 5000 + "\n", "valid YAML (nested too deeply)"),
        ("a: " + "1" * 5000 + "\n", "valid YAML (Exceeds the limit"),
    ],
    ids=short_id,
)
def test_check_config_refuses_with_one_line_naming_the_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, named: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    err = fails(capsys, "check-config", str(path))
    assert named in err
    assert err.count("\n") == 1 and len(err) < 1000
    assert "pw@" not in err


def test_simulate_errors_name_the_option_file_and_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    err = fails(capsys, "simulate", "--tier", "memory:capacity=[")
    assert "--tier='memory:capacity=[': a YAML value for capacity" in err
    assert err.count("\n") == 1

    err = fails(capsys, "simulate", "--tier", "memory:latency_ms=.nan")
    assert "tiers[0].latency_ms=nan: a finite number" in err

    err = fails(capsys, "simulate", "--tier", "fs:/tmp/a\0b:1GiB")
    assert "tiers[0].path='/tmp/a\\x00b': a path without a NUL character" in err

    # an fs error at start names the tier's field, not "fs.path"
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    err = fails(capsys, "simulate", "--tier", "memory", "--tier", f"fs:{blocker}/kv:1GiB")
    assert f"invalid config tiers[1].path='{blocker}/kv': a writable directory" in err

    trace = tmp_path / "latin1.jsonl"
    trace.write_bytes(b'{"hash_ids": [1]}\n{"hash_ids": [2], "note": "\xff"}\n')
    err = fails(capsys, "simulate", "--trace", str(trace))
    assert f"{trace}:2: not UTF-8" in err

    trace.write_text('{"hash_ids": [' + str(2**128) + "]}\n")
    err = fails(capsys, "simulate", "--trace", str(trace))
    assert f"{trace}:1: hash_ids must be a list of 128-bit signed integers" in err


def run_command(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=120, check=False)


def test_python_dash_m_and_console_script() -> None:
    done = run_command(sys.executable, "-m", "kvtier", "simulate", "--limit", "20", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["requests"] == 20
    script = shutil.which("kvtier", path=str(Path(sys.executable).parent)) or shutil.which("kvtier")
    assert script is not None, "the kvtier console script is not installed (pip install -e .)"
    done = run_command(script, "simulate", "--limit", "5", "--json", "--no-progress")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["requests"] == 5


def test_stats_prints_a_snapshot_written_by_the_connector(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A real snapshot: what the connector wrote on the H100 run committed with the bench."""
    results = Path(__file__).resolve().parents[1] / "docs" / "results" / "vllm_gpu_bench.json"
    snapshot = json.loads(results.read_text())["configs"]["kvtier_fs"]["kvtier_stats"]
    path = tmp_path / "stats.json"
    path.write_text(json.dumps(snapshot))
    assert main(["stats", str(path)]) == 0
    out = capsys.readouterr().out
    cache = snapshot["cache"]
    assert f"{snapshot['pool_used']} of {snapshot['pool_slots']} slots used" in out
    ratio = 100 * cache["hit_blocks"] / cache["lookup_blocks"]
    assert f"{cache['hit_blocks']} hit ({ratio:.1f}%)" in out
    assert f"{cache['promoted_blocks']} promoted from tiers" in out
    fs_row = next(line for line in out.splitlines() if line.startswith("fs "))
    assert str(snapshot["tiers"]["fs"]["lookups"]) in fs_row
    assert f"hit_tokens {snapshot['connector']['hit_tokens']}" in out


def test_stats_refuses_what_is_not_a_snapshot(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["stats", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "list.json").write_text("[1, 2]")
    assert main(["stats", str(tmp_path / "list.json")]) == 2
    assert "not a kvtier stats snapshot" in capsys.readouterr().err
    (tmp_path / "torn.json").write_text('{"cache": {')
    assert main(["stats", str(tmp_path / "torn.json")]) == 2
    assert "not a JSON stats snapshot" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvtier {version('kvtier')}"
