"""Two vLLM engines on one GPU share a kvtier pool (``pool.share``): engine B's TTFT on a prefix
that only engine A computed, against A's own reload of it and against recomputing it.

Each engine runs in its own process with part of the GPU (``--gpu-memory-utilization``, 0.4
each), a Llama-3.1-8B-shaped model with dummy weights (``vllm_bench_engine.LLAMA_8B``) and the
same ``kv_connector_extra_config``: ``pool: {size, share, shm_dir}``. A starts first and creates
the pool; B attaches it. Both are warmed up (their first compute, store and load), then for each
repetition ``r`` (fresh random prompts each time):

1. ``a_compute``: A prefills ``P_r`` (``--prefix-tokens``, 8,192): a miss, computed and stored.
2. ``b_hit``: B prefills ``P_r``: its blocks come from the pool, where A stored them.
3. ``a_reload``: A drops its GPU prefix cache (``reset_prefix_cache``) and prefills ``P_r``
   again: A's own blocks come back from the pool. Steps 2 and 3 swap on odd repetitions.
4. ``b_recompute``: B prefills a prompt nobody saw: computed (and stored).

After A and B stopped (and the pool file is checked gone), ``alone`` starts an engine without
kvtier and prefills cold prompts of the same length: vLLM alone. A TTFT is the wall time of
``LLM.generate`` with ``max_tokens=1``. After each prefill the engine's stats file is read
(``vllm.stats_path``): the tokens it loaded through kvtier and, from its ``share`` line, the
blocks it hit that the other engine had stored.

``--model tiny`` is a CPU smoke run (vLLM's CPU build, a tiny Llama, engine core in each engine's
process). Prints a table; writes JSON (``--json``, default ``docs/results/shared_pool_gpu.json``
for the GPU model).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from vllm_bench_engine import ModelSpec, make_model, warmup

from kvtier.demo import FIRST_TOKEN

REPO = Path(__file__).resolve().parents[1]
DEFAULT_JSON = REPO / "docs" / "results" / "shared_pool_gpu.json"
KINDS = ("a_compute", "b_hit", "a_reload", "b_recompute", "alone")
CALL_TIMEOUT_S = 900.0


# -- inside an engine's process -----------------------------------------------------------------


def _ttft(llm: Any, prompt: list[int]) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    began = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    seconds = time.perf_counter() - began
    return {"seconds": seconds, "first_token": int(out.outputs[0].token_ids[0])}


def _stats(llm: Any, path: str | None) -> dict[str, Any] | None:
    """The engine's stats file once it holds this moment's counters: one more engine step after
    the file's one-second interval (the step also settles the stores of the previous one)."""
    if path is None:
        return None
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    time.sleep(1.2)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[FIRST_TOKEN] * 3)], params, use_tqdm=False)
    data: dict[str, Any] = json.loads(Path(path).read_text())
    return data


def engine_main(conn: Connection, kwargs: dict[str, Any], env: dict[str, str]) -> None:
    """One engine: build it, then answer the driver's calls until ``stop``."""
    os.environ.update(env)
    from vllm import LLM

    extra = (kwargs.get("kv_transfer_config") or {}).get("kv_connector_extra_config") or {}
    stats_path = extra.get("vllm", {}).get("stats_path")
    llm = LLM(**kwargs)
    device = "cpu"
    try:
        import torch

        if torch.cuda.is_available():
            device = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    conn.send(("ok", {"device": device}))
    model = ModelSpec("", Path(kwargs["model"]), 0, 0, device != "cpu")
    while True:
        command, arg = conn.recv()
        if command == "stop":
            break
        try:
            if command == "ttft":
                result: Any = _ttft(llm, arg)
            elif command == "reset":
                result = bool(llm.reset_prefix_cache())
            elif command == "warmup":
                model.vocab = int(arg["vocab"])
                warmup(llm, model, list(arg["lengths"]))
                result = None
            elif command == "stats":
                result = _stats(llm, stats_path)
            else:
                raise ValueError(f"unknown command {command!r}")
        except Exception as exc:  # the driver reports it and stops
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
            continue
        conn.send(("ok", result))
    engine = getattr(llm, "llm_engine", None)
    core = getattr(engine, "engine_core", None)
    if core is not None:
        core.shutdown()
    conn.send(("ok", None))


# -- the driver ---------------------------------------------------------------------------------


class Engine:
    """An engine process and the pipe the driver calls it through."""

    def __init__(self, name: str, kwargs: dict[str, Any], env: dict[str, str]) -> None:
        ctx = mp.get_context("spawn")
        self.name = name
        self._conn, child = ctx.Pipe()
        # Not a daemon: vLLM starts processes of its own (the engine core, on a GPU).
        self._proc = ctx.Process(target=engine_main, args=(child, kwargs, env), name=name)
        self._proc.start()
        child.close()
        self.device = str(self._answer(CALL_TIMEOUT_S)["device"])

    def _answer(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            self.kill()
            raise RuntimeError(f"engine {self.name}: no answer in {timeout:.0f} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            self.kill()
            raise RuntimeError(f"engine {self.name} exited ({self._proc.exitcode})") from None
        if status != "ok":
            raise RuntimeError(f"engine {self.name}: {value}")
        return value

    def call(self, command: str, arg: Any = None) -> Any:
        self._conn.send((command, arg))
        return self._answer(CALL_TIMEOUT_S)

    def stop(self) -> None:
        if self._proc.is_alive():
            self._conn.send(("stop", None))
            self._answer(120)
        self._proc.join(30)
        self.kill()

    def kill(self) -> None:
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)


@dataclass(slots=True)
class Measure:
    kind: str
    repetition: int
    ttft_ms: float
    loaded_tokens: int | None
    """Tokens this prefill loaded through kvtier (the connector's ``hit_tokens``)."""
    hits_others: int | None
    """Blocks this prefill pinned that the other engine had stored (the ``share`` line)."""
    first_token: int


@dataclass(slots=True)
class Counters:
    """The last stats read from one engine, to take each prefill's increments."""

    hit_tokens: int = 0
    hits_others: int = 0
    last: dict[str, Any] | None = field(default=None)

    def advance(self, stats: dict[str, Any] | None) -> tuple[int | None, int | None]:
        if stats is None:
            return None, None
        hit_tokens = int(stats["connector"]["hit_tokens"])
        others = int((stats.get("share") or {}).get("hits_others", 0))
        delta = (hit_tokens - self.hit_tokens, others - self.hits_others)
        self.hit_tokens, self.hits_others, self.last = hit_tokens, others, stats
        return delta


def prompt(seed: str, tokens: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_TOKEN, vocab) for _ in range(tokens)]


def engine_kwargs(
    args: argparse.Namespace, model: ModelSpec, extra: dict[str, Any] | None
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "model": str(model.path),
        "load_format": "dummy",
        "skip_tokenizer_init": True,
        "dtype": "bfloat16" if model.gpu else "float32",
        "max_model_len": args.prefix_tokens + 128,
        "max_num_seqs": 8,
        "enable_prefix_caching": True,
        "seed": 0,
    }
    if model.gpu:
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        kwargs.update(block_size=model.block_tokens, enforce_eager=True)
        kwargs["kv_cache_memory_bytes"] = 4 * (args.prefix_tokens + 128) * model.kv_bytes_per_token
    if extra is not None:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVTierConnector",
            "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra,
        }
    return kwargs


def kvtier_extra(args: argparse.Namespace, stats_path: Path) -> dict[str, Any]:
    return {
        "pool": {"size": args.pool_size, "share": args.share, "shm_dir": args.shm_dir},
        "vllm": {"stats_path": str(stats_path)},
    }


def pool_files(args: argparse.Namespace) -> list[str]:
    prefix = f"kvtier-pool-share-{args.share}-"
    return sorted(n for n in os.listdir(args.shm_dir) if n.startswith(prefix))


def wait_pool_gone(args: argparse.Namespace, seconds: float = 20.0) -> list[str]:
    """The share's pool files left once none is left or ``seconds`` passed (the last engine out,
    or its reaper, removes the file)."""
    end = time.monotonic() + seconds
    while pool_files(args) and time.monotonic() < end:
        time.sleep(0.1)
    return pool_files(args)


def warm_lengths(args: argparse.Namespace, model: ModelSpec) -> dict[str, Any]:
    """``warmup``'s prompts: a long and a short one (the long one comes back 64 tokens longer)."""
    return {"vocab": model.vocab, "lengths": [min(2048, args.prefix_tokens // 2), 256]}


def measure(engine: Engine, counters: Counters, kind: str, r: int, tokens: list[int]) -> Measure:
    got = engine.call("ttft", tokens)
    loaded, others = counters.advance(engine.call("stats"))
    return Measure(kind, r, got["seconds"] * 1e3, loaded, others, got["first_token"])


def shared_rounds(
    args: argparse.Namespace, model: ModelSpec, workdir: Path, out: dict[str, Any]
) -> list[Measure]:
    """A and B over one shared pool: ``a_compute``, ``b_hit``, ``a_reload``, ``b_recompute``."""
    env = {} if model.gpu else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    stats = {name: workdir / f"stats-{name}.json" for name in ("a", "b")}
    engines: dict[str, Engine] = {}
    counters = {"a": Counters(), "b": Counters()}
    rows: list[Measure] = []
    try:
        for name in ("a", "b"):  # A creates the pool, B attaches it
            extra = kvtier_extra(args, stats[name])
            engines[name] = Engine(name, engine_kwargs(args, model, extra), env)
            out["device"] = engines[name].device
            if name == "a":
                out["pool_file"] = pool_files(args)
        warm = warm_lengths(args, model)
        for name, engine in engines.items():
            engine.call("warmup", warm)
            counters[name].advance(engine.call("stats"))
        a, b = engines["a"], engines["b"]
        for r in range(args.repeat):
            tokens = prompt(f"prefix-{r}", args.prefix_tokens, model.vocab)
            rows.append(measure(a, counters["a"], "a_compute", r, tokens))
            steps = ["b_hit", "a_reload"] if r % 2 == 0 else ["a_reload", "b_hit"]
            for kind in steps:
                if kind == "a_reload":
                    a.call("reset")  # A's GPU prefix cache forgets P_r; the pool keeps it
                    rows.append(measure(a, counters["a"], kind, r, tokens))
                else:
                    rows.append(measure(b, counters["b"], kind, r, tokens))
            cold = prompt(f"cold-b-{r}", args.prefix_tokens, model.vocab)
            rows.append(measure(b, counters["b"], "b_recompute", r, cold))
    finally:
        for engine in reversed(list(engines.values())):
            try:
                engine.stop()
            except RuntimeError as exc:
                print(f"stopping engine {engine.name}: {exc}", file=sys.stderr)
                engine.kill()
    out["pool_files_left"] = wait_pool_gone(args)
    out["shares"] = {
        name: json.loads(path.read_text()).get("share") if path.exists() else None
        for name, path in stats.items()
    }
    return rows


def alone_rounds(args: argparse.Namespace, model: ModelSpec) -> list[Measure]:
    """vLLM alone (no connector): cold prompts of the same length."""
    env = {} if model.gpu else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    engine = Engine("alone", engine_kwargs(args, model, None), env)
    rows = []
    try:
        engine.call(
            "warmup", {"vocab": model.vocab, "lengths": [min(2048, args.prefix_tokens), 256]}
        )
        for r in range(args.repeat):
            tokens = prompt(f"cold-alone-{r}", args.prefix_tokens, model.vocab)
            got = engine.call("ttft", tokens)
            rows.append(Measure("alone", r, got["seconds"] * 1e3, None, None, got["first_token"]))
    finally:
        engine.stop()
    return rows


def summarize(rows: list[Measure]) -> dict[str, Any]:
    """Per kind: the TTFTs and their median; B's hit against A's reload and both against
    recomputing (``b_recompute``, and ``alone`` when it ran)."""
    by_kind: dict[str, list[Measure]] = {}
    for row in rows:
        by_kind.setdefault(row.kind, []).append(row)
    kinds = {
        kind: {
            "ttft_ms": [round(m.ttft_ms, 2) for m in ms],
            "ttft_ms_median": round(statistics.median(m.ttft_ms for m in ms), 2),
            "loaded_tokens": [m.loaded_tokens for m in ms],
            "hits_others": [m.hits_others for m in ms],
        }
        for kind, ms in ((k, by_kind[k]) for k in KINDS if k in by_kind)
    }
    med = {kind: v["ttft_ms_median"] for kind, v in kinds.items()}
    computed = {m.repetition: m.first_token for m in by_kind.get("a_compute", [])}
    loaded = [m for m in rows if m.kind in ("b_hit", "a_reload")]
    out: dict[str, Any] = {
        "kinds": kinds,
        # The same first token from the loaded prefix as from the computed one.
        "first_tokens_agree": all(m.first_token == computed.get(m.repetition) for m in loaded),
    }
    if "b_hit" in med and "a_reload" in med:
        out["b_hit_over_a_reload"] = round(med["b_hit"] / med["a_reload"], 3)
        out["within_1_5x"] = med["b_hit"] <= 1.5 * med["a_reload"]
    for base in ("b_recompute", "alone"):
        if base in med and "b_hit" in med:
            out[f"{base}_over_b_hit"] = round(med[base] / med["b_hit"], 2)
    return out


def table(summary: dict[str, Any]) -> str:
    lines = [f"{'prefill':<12} {'TTFT ms p50':>12} {'each (ms)':<40} {'loaded tokens':<20}"]
    for kind, v in summary["kinds"].items():
        each = ", ".join(f"{t:.1f}" for t in v["ttft_ms"])
        loaded = ", ".join("-" if t is None else str(t) for t in v["loaded_tokens"])
        lines.append(f"{kind:<12} {v['ttft_ms_median']:>12.1f} {each:<40} {loaded:<20}")
    for key in ("b_hit_over_a_reload", "b_recompute_over_b_hit", "alone_over_b_hit"):
        if key in summary:
            lines.append(f"{key}: {summary[key]}")
    return "\n".join(lines)


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "date": time.strftime("%Y-%m-%d")}
    try:
        import vllm

        out["vllm"] = str(vllm.__version__)
    except ImportError:
        out["vllm"] = "?"
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "?"
    out["kvtier_commit"] = commit
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--model", choices=["llama8b", "tiny"], default="llama8b")
    p.add_argument("--prefix-tokens", type=int, default=None, help="default 8192 (tiny: 512)")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.4)
    p.add_argument("--pool-size", default=None, help="default 16GiB (tiny: 64MiB)")
    p.add_argument("--share", default="bench")
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--skip-alone", action="store_true", help="no vLLM-alone engine")
    p.add_argument("--workdir", default=None, help="default: a new temporary directory")
    p.add_argument("--json", default=None, help=f"default {DEFAULT_JSON} (tiny: none)")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parser().parse_args(argv)
    tiny = args.model == "tiny"
    args.prefix_tokens = args.prefix_tokens or (512 if tiny else 8192)
    args.pool_size = args.pool_size or ("64MiB" if tiny else "16GiB")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvtier-shared-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = make_model(args.model, workdir)
    if pool_files(args):
        raise SystemExit(
            f"{args.shm_dir} holds a pool of share {args.share!r} already: {pool_files(args)}"
        )
    out: dict[str, Any] = {"bench": "shared_pool_gpu", "model": model.name, **versions()}
    out["settings"] = {
        "prefix_tokens": args.prefix_tokens,
        "repeat": args.repeat,
        "gpu_memory_utilization": args.gpu_memory_utilization if model.gpu else None,
        "pool_size": args.pool_size,
        "share": args.share,
        "shm_dir": args.shm_dir,
        "block_tokens": model.block_tokens,
    }
    rows = shared_rounds(args, model, workdir, out)
    if not args.skip_alone:
        rows += alone_rounds(args, model)
    out["runs"] = [asdict(row) for row in rows]
    out["summary"] = summarize(rows)
    print(f"{out['device']}, {model.name}, vLLM {out['vllm']}, kvtier {out['kvtier_commit']}")
    print(table(out["summary"]))
    print(f"pool files left: {out['pool_files_left']}")
    path = args.json or (None if tiny else str(DEFAULT_JSON))
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
