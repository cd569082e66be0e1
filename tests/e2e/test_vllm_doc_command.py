"""docs/vllm.md's CPU commands, as written there: write the tiny Llama with ``python -m
kvtier.demo --write-model ./tiny-llama``, start vLLM's OpenAI API server on it with kvtier, and
complete a prompt of token ids. Only the port (a free one) and the fs tier's directory (the
test's own) are changed."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from support import require
from support.health import wait_until_healthy
from support.ports import free_port

pytestmark = [
    pytest.mark.e2e,
    require.unless("vllm", require.vllm_missing()),
    pytest.mark.timeout(420),
]

VLLM_MD = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


def documented_commands() -> list[list[str]]:
    """The indented block that writes the model and starts the server, as argument lists."""
    match = re.search(
        r"\n(    python -m kvtier\.demo .*?\n    python -m vllm\.entrypoints.*?\}\}'\n)",
        VLLM_MD.read_text(),
        re.S,
    )
    assert match, "docs/vllm.md: the tiny model and API server commands"
    first, rest = match.group(1).replace("\\\n", " ").split("\n", 1)
    return [shlex.split(first, comments=True), shlex.split(rest)]  # rest: one command


def test_the_documented_cpu_server_commands_run(tmp_path: Path) -> None:
    write_model, serve = documented_commands()
    assert write_model[:3] == ["python", "-m", "kvtier.demo"]
    assert serve[serve.index("--model") + 1] == "./tiny-llama"
    env = {**os.environ}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    subprocess.run([sys.executable, *write_model[1:]], cwd=tmp_path, check=True, timeout=120)
    assert (tmp_path / "tiny-llama" / "config.json").is_file()

    port = free_port()
    serve[serve.index("--port") + 1] = str(port)
    transfer = serve.index("--kv-transfer-config") + 1
    assert "/tmp/kvtier-fs" in serve[transfer]
    serve[transfer] = serve[transfer].replace("/tmp/kvtier-fs", str(tmp_path / "fs"))
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, *serve[1:]],
            cwd=tmp_path,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, base, log_path)
        body = {
            "model": "./tiny-llama",
            "prompt": list(range(3, 3 + 70)),  # two full 32-token blocks and a few more
            "max_tokens": 2,
            "temperature": 0.0,
            "return_token_ids": True,
            "ignore_eos": True,
        }
        request = urllib.request.Request(
            base + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            choice = json.loads(r.read())["choices"][0]
        assert len(choice["token_ids"]) == 2, choice
        assert "KVTierConnector" in log_path.read_text()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # kvtier's fs tier got the prompt's two blocks (write-through).
    assert len([p for p in (tmp_path / "fs").rglob("*") if p.is_file()]) >= 2
