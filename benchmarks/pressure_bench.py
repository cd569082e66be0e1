"""A pool under pressure: more conversations in flight than the host pool holds between turns.

The request sequence is the engine benchmark's own (``benchmarks/vllm_gpu_bench.py``, prompts
widened by ``vllm_bench_engine.widen``): the demo's multi-turn conversations from the bundled trace
(``kvtier.demo.build_workload`` with 5 turns and at most 40 context blocks), each token widened
4x, ``--concurrency`` conversations round robin (160 / 240 / 318 requests for 8 / 16 / 32 in
flight: as the benchmark, it leaves out a conversation with a prompt over 16,320 tokens), cut
into 16-token engine blocks of 2 MiB (Llama-3.1-8B in bf16) whose ids chain the prefix, as
vLLM's block hashes do. Each request is replayed through the real ``TieredCache`` over
a host pool of 2 / 3 / 4 / 8 GiB (``Replayer``, no GPU cache in front: the pool alone), with 64
output tokens in each request's hint.

Policies: ``lru``; ``hinted`` as it was at ``--before`` (its source there, read with git:
``BEFORE``); ``hinted`` now with every store admitted (its ``admit_store`` answering all, as before
the pool asked it); ``hinted`` now (the default: under pressure the pool stores only what its
``admit_store`` admits); and the offline optimum (``kvtier.sim.optimal``).
Then the bundled trace with ``--bundled-concurrency`` conversations in flight, exactly what
``kvtier simulate --concurrency N --pool-blocks B --policy P`` replays. Prints tables and writes
JSON.

**The engine's order** (``--calls FILE [FILE ...]``): the cache calls vLLM made, recorded by
``--record FILE`` (below), replayed through the real ``TieredCache`` for each policy at the
recorded pool size: the blocks the pool served, against the offline optimum of the same
requests. What differs from the replay above is what an engine does: requests in flight store
their blocks before any of them is hinted (a hint comes when a request finished), the engine's
own prefix cache sits in front (its hits are not looked up, and are named in the hint), a
waiting request is looked up again at every step it is not scheduled (its hits pinned
meanwhile), loads and stores complete a step later. Replayed: per ``get_num_new_matched_tokens``
call (``M``: the blocks the engine holds) the lookup (``L``) and the pin of the hits; the
allocation (``A``) turns the pins into a load, done at the next engine step (``E``); each store
(``S``) is reserved, and written at the next step; at a request's end (``F``) its pins go, and
its hint (``H``) names the hits the replay found (not the recorded ones). The engine's schedule
is the recorded one: a policy that finds more would have shortened some prefills there.

``--record FILE`` runs the engine benchmark's ``kvtier`` configuration on vLLM's CPU build with
its tiny model (``benchmarks/vllm_bench_engine.py``: the same conversations, ``--widen``,
``--concurrency`` and ``--requests``, 64 output tokens), a host pool of ``--record-pool-blocks``
and a KV cache of ``--record-kv-blocks`` vLLM blocks of 32 tokens, 16,384 batched tokens a step
(the H100's default), and writes every call above as gzipped JSON. At 16 in flight with 512 /
512 blocks and ``--widen 4`` the ratios are the H100 grid point 16x2's (requests of about 160
blocks against 512, 322 of 16 tokens against 1,024): the pool there cached 7.1% of the prompt
tokens on the CPU, 8.1% on the H100.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gzip
import json
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvtier.cache.manager import TieredCache
from kvtier.demo import build_workload
from kvtier.keys import Namespace
from kvtier.policies import EvictionPolicy, HintedPolicy, LRUPolicy, RequestHint
from kvtier.pool import HostPool
from kvtier.sim.conversations import trace_requests
from kvtier.sim.optimal import infinite_hit_ratio, optimal_hit_ratio
from kvtier.sim.replay import Replayer, machine_description
from kvtier.sim.trace import TraceRequest, bundled_trace_path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_bench_engine import LLAMA_8B, widen  # the GPU benchmark's own widening

ENGINE_BLOCK_TOKENS = 16
GRID_MAX_PROMPT = 16384 - 64
"""The H100 grid's ``--max-model-len`` less its 64 output tokens: a conversation with a longer
prompt is not sent there (one of 94 at 32 in flight), so it is left out here too."""
BLOCK_BYTES = 2 * 1024 * 1024
"""16 tokens of Llama-3.1-8B KV in bf16: 32 layers x K and V x 8 heads x 128 x 2 bytes."""
GIB = 1024**3
BEFORE = "2d21f2f"
"""``hinted`` as the H100 grid measured it (16x2: 0.081 of the prompt tokens cached): the stable
mode with its refusals bounded by ``GATE_HOLD``, before blocks left in the LRU order expired and
before conversations' last requests were learned. (Before the stable mode, 266712f, it cached
nothing in every cell where LRU caches nothing.)"""

PolicyFactory = Callable[[int], EvictionPolicy]


class AdmittingAll(HintedPolicy):
    """``hinted`` with every store admitted: the pool evicts for all of a store, as before
    ``TieredCache.prepare_store`` asked the policy's ``admit_store`` (what the refusals add)."""

    def admit_store(self, n: int, free: int) -> int:
        return n


def hinted_before(rev: str) -> PolicyFactory | None:
    """``HintedPolicy`` as of commit ``rev`` (None when git cannot show it)."""
    try:
        source = subprocess.run(
            ["git", "show", f"{rev}:src/kvtier/policies/hinted.py"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("hinted_before")
    exec(compile(source, f"{rev}:hinted.py", "exec"), module.__dict__)
    cls: type[HintedPolicy] = module.HintedPolicy
    return cls


def benchmark_sequence(
    concurrency: int,
    requests: int,
    turns: int,
    context: int,
    factor: int,
    max_prompt: int = GRID_MAX_PROMPT,
) -> list[TraceRequest]:
    """The engine benchmark's requests as trace requests of chained 16-token block ids: as the
    benchmark, a conversation with a prompt longer than ``max_prompt`` is left out."""
    vocab = int(LLAMA_8B["vocab_size"])
    workload = build_workload(requests, concurrency, turns, context, vocab=vocab)
    widened = [(turn.session, widen(turn.tokens, factor, vocab)) for turn in workload.turns]
    too_long = {session for session, tokens in widened if len(tokens) > max_prompt}
    ids: dict[tuple[int, tuple[int, ...]], int] = {}
    out: list[TraceRequest] = []
    for session, tokens in widened:
        if session in too_long:
            continue
        chain: list[int] = []
        parent = -1
        for start in range(0, len(tokens) - ENGINE_BLOCK_TOKENS + 1, ENGINE_BLOCK_TOKENS):
            block = tuple(tokens[start : start + ENGINE_BLOCK_TOKENS])
            parent = ids.setdefault((parent, block), len(ids))
            chain.append(parent)
        out.append(TraceRequest(float(len(out)), len(tokens), 64, tuple(chain)))
    return out


@contextmanager
def _pool_cache(policy: EvictionPolicy, blocks: int) -> Iterator[tuple[TieredCache, HostPool]]:
    """A host pool of ``blocks`` small slots and the real manager over it, closed after."""
    with tempfile.TemporaryDirectory(prefix="kvtier-pressure-") as shm:
        pool = HostPool.create(blocks, 64, shm)
        cache = TieredCache(pool, policy, record_events=False)
        try:
            yield cache, pool
        finally:
            cache.close()
            pool.close()


def replay(requests: Sequence[TraceRequest], policy: EvictionPolicy, blocks: int) -> float:
    """Hit ratio of ``requests`` through the real manager over a pool of ``blocks`` slots."""
    with _pool_cache(policy, blocks) as (cache, pool):
        namespace = Namespace(model="pressure-bench", dtype="bf16", block_tokens=16)
        result = Replayer(cache, pool, namespace).run(requests)
        assert result.mismatched_blocks == 0
        return result.hit_ratio


# -- the engine's order: vLLM's recorded cache calls (module docstring) ----------------------------

Event = list[Any]
"""``["M", request, engine_blocks]``, ``["L", request, keys]``, ``["A", request]``, ``["E"]``,
``["S", keys]``, ``["F", request]``, ``["H", keys, hit_blocks, output_tokens, engine_blocks]``;
a request is a number, keys are runs ``[[first, count], ...]`` of block numbers (numbered in the
order they first appear)."""
CALLS_FORMAT = 1
RECORD_BATCHED_TOKENS = 16384
"""vLLM's default tokens per step for ``LLM`` on an H100 (``EngineArgs``: 80 GB, not an A100)."""


def key_runs(ids: Sequence[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for i in ids:
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1][1] += 1
        else:
            runs.append([i, 1])
    return runs


def run_keys(runs: Sequence[Sequence[int]]) -> list[bytes]:
    return [i.to_bytes(8, "little") for first, count in runs for i in range(first, first + count)]


class CallRecorder:
    """While active (``with``), every ``Planner`` and ``TieredCache`` of this process appends
    the calls the replay needs to ``events``."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._keys: dict[bytes, int] = {}
        self._requests: dict[str, int] = {}

    def keys(self, keys: Sequence[bytes]) -> list[list[int]]:
        ids = self._keys
        return key_runs([ids.setdefault(k, len(ids)) for k in keys])

    def request(self, req_id: str) -> int:
        return self._requests.setdefault(req_id, len(self._requests))

    def _event(self, args: tuple[Any, ...]) -> Event | None:
        """The event of a call (``args``: the method's name, ``self`` and its arguments)."""
        name, obj, *rest = args
        if name == "matched_tokens":
            request, computed = rest[:2]
            return ["M", self.request(request.request_id), computed // obj.block_tokens]
        if name == "after_alloc":
            return ["A", self.request(rest[0].request_id)]
        if name == "request_finished":
            return ["F", self.request(rest[0].request_id)]
        if name == "lookup":
            owner = rest[1] if len(rest) > 1 else None
            return None if owner is None else ["L", self.request(owner), self.keys(rest[0])]
        if name == "prepare_store":
            return ["S", self.keys(rest[0])]
        if name == "engine_step":
            return ["E"]
        keys, hint = rest[:2]  # hint_request
        return ["H", self.keys(keys), hint.hit_blocks, hint.output_tokens, hint.engine_blocks]

    @contextmanager
    def active(self) -> Iterator[CallRecorder]:
        from kvtier.engine.planner import Planner

        methods = [
            (Planner, "matched_tokens"),
            (Planner, "after_alloc"),
            (Planner, "request_finished"),
            (TieredCache, "lookup"),
            (TieredCache, "prepare_store"),
            (TieredCache, "engine_step"),
            (TieredCache, "hint_request"),
        ]
        saved = [(cls, name, getattr(cls, name)) for cls, name in methods]

        def wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(method)
            def recorded(*args: Any, **kwargs: Any) -> Any:
                event = self._event((name, *args, *kwargs.values()))
                if event is not None:
                    self.events.append(event)
                return method(*args, **kwargs)

            return recorded

        for cls, name, method in saved:
            setattr(cls, name, wrap(name, method))
        try:
            yield self
        finally:
            for cls, name, method in saved:
                setattr(cls, name, method)


def record_vllm(
    path: Path, concurrency: int, requests: int, pool_blocks: int, kv_blocks: int, factor: int
) -> dict[str, Any]:
    """Run the engine benchmark's ``kvtier`` configuration on vLLM's CPU build (tiny model)
    and write its cache calls to ``path`` (gzipped JSON); returns the run's summary."""
    import vllm_bench_engine as eng
    import vllm_gpu_bench as vb

    vb.prepare_env()
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-calls-"))
    model = eng.make_model("tiny", workdir)
    block = model.kv_bytes_per_token * model.block_tokens
    max_len = min(8192, (kv_blocks - 2) * model.block_tokens)
    settings = eng.Settings(5, 40, factor, 64, max_len, kv_blocks * block / GIB, workdir)
    prompts, workload = eng.build_point(settings, model, concurrency, requests)
    spec = eng.RunSpec(
        "kvtier",
        concurrency,
        pool_blocks * block / GIB,
        0.0,
        workload["gpu_kv_bytes"],
        max_len,
        workdir,
    )
    engine_kwargs = eng.engine_kwargs

    def batched(spec: eng.RunSpec, model: eng.ModelSpec) -> dict[str, Any]:
        return {**engine_kwargs(spec, model), "max_num_batched_tokens": RECORD_BATCHED_TOKENS}

    recorder = CallRecorder()
    eng.engine_kwargs = batched
    try:
        with recorder.active():
            row = vb.run_config(spec, model, prompts, settings.max_tokens, None)
    finally:
        eng.engine_kwargs = engine_kwargs
    summary = {
        "format": CALLS_FORMAT,
        "machine": machine_description(),
        "date": datetime.date.today().isoformat(),
        "vllm": vb.machine().get("vllm"),
        "model": model.name,
        "concurrency": concurrency,
        "requests": requests,
        "widen": factor,
        "block_tokens": model.block_tokens,
        "pool_blocks": pool_blocks,
        "kv_blocks": kv_blocks,
        "max_num_batched_tokens": RECORD_BATCHED_TOKENS,
        "prompt_tokens": row["prompt_tokens"],
        "prompt_tokens_cached": row["prompt_tokens_cached"],
        "loaded_blocks": row["kvtier_stats"]["cache"]["loaded_blocks"],
    }
    with gzip.open(path, "wt") as out:
        json.dump({**summary, "events": recorder.events}, out, separators=(",", ":"))
    return summary


def read_calls(path: Path) -> dict[str, Any]:
    with gzip.open(path, "rt") as f:
        data: dict[str, Any] = json.load(f)
    if data.get("format") != CALLS_FORMAT:
        raise ValueError(f"{path}: not a recording of format {CALLS_FORMAT}")
    return data


def calls_requests(events: Sequence[Event]) -> list[TraceRequest]:
    """The recorded requests in the order of their hints, for the offline optimum."""
    out: list[TraceRequest] = []
    for event in events:
        if event[0] == "H":
            ids = tuple(i for first, count in event[1] for i in range(first, first + count))
            out.append(TraceRequest(float(len(out)), len(ids), 64, ids))
    return out


def replay_calls(events: Sequence[Event], policy: EvictionPolicy, blocks: int) -> int:
    """Blocks a pool of ``blocks`` slots serves replaying the recorded calls (docstring)."""
    with _pool_cache(policy, blocks) as (cache, _):
        return _replay_calls(events, cache)


def _replay_calls(events: Sequence[Event], cache: TieredCache) -> int:
    pins: dict[int, list[bytes]] = {}
    """Per request, the hits pinned since its last lookup."""
    found: dict[int, tuple[int, int]] = {}
    """Per request, (leading blocks cached, of them the engine's) at its last lookup."""
    due: list[tuple[bool, list[bytes]]] = []
    """Loads (True) and stores done at the next engine step."""
    served = 0
    finished = -1
    for event in events:
        kind = event[0]
        if kind == "M" or kind == "F":
            request = event[1]
            plan = pins.pop(request, None)
            if plan:
                cache.release_load(plan)
            if kind == "M":
                found[request] = (event[2], event[2])
            else:
                finished = request
        elif kind == "L":
            request, keys = event[1], run_keys(event[2])
            hits = keys[: cache.lookup(keys, request).hits]
            pinned = hits[: len(cache.prepare_load(hits, request))]
            pins[request] = pinned
            engine = found.get(request, (0, 0))[1]
            found[request] = (engine + len(pinned), engine)
        elif kind == "A":
            plan = pins.pop(event[1], None)
            if plan:
                served += len(plan)
                due.append((True, plan))
        elif kind == "E":
            for load, keys in due:
                if load:
                    cache.complete_load(keys)
                else:
                    cache.complete_store(keys)
            due = []
        elif kind == "S":
            due.append((False, cache.prepare_store(run_keys(event[1])).keys))
        elif kind == "H":
            keys = run_keys(event[1])
            hits, engine = found.pop(finished, (event[4], event[4]))
            cache.hint_request(keys, RequestHint(min(hits, len(keys)), event[3], engine))
    return served


@dataclass(slots=True)
class Row:
    sequence: str
    concurrency: int
    requests: int
    pool_blocks: int
    pool_gib: float
    policy: str
    hit_ratio: float
    fraction_of_optimum: float
    seconds: float
    reusable: float
    """Hit ratio of a cache that keeps every block (the reusable share of the blocks)."""


Run = Callable[[EvictionPolicy, int], float]
"""A policy's hit ratio over a pool of so many blocks."""


def measure(
    label: str,
    concurrency: int,
    requests: Sequence[TraceRequest],
    blocks: int,
    policies: dict[str, PolicyFactory],
    run: Run | None = None,
    gib: float | None = None,
) -> list[Row]:
    """Each policy's hit ratio on ``requests`` (``replay``, or ``run``) against the optimum."""
    optimum = optimal_hit_ratio(requests, blocks).hit_ratio
    reusable = infinite_hit_ratio(requests)
    gib = blocks * BLOCK_BYTES / GIB if gib is None else gib
    cell = (label, concurrency, len(requests), blocks, gib)
    rows = [Row(*cell, "optimal", optimum, 1.0, 0.0, reusable)]
    for name, factory in policies.items():
        start = time.perf_counter()
        if run is None:
            ratio = replay(requests, factory(blocks), blocks)
        else:
            ratio = run(factory(blocks), blocks)
        share = ratio / optimum if optimum else 0.0
        seconds = time.perf_counter() - start
        rows.append(Row(*cell, name, ratio, share, seconds, reusable))
        print(f"  {label} c={concurrency} {blocks} blocks {name}: {ratio:.4f}", file=sys.stderr)
    return rows


def measure_calls(path: Path, policies: dict[str, PolicyFactory]) -> list[Row]:
    """The recorded calls at ``path`` replayed for each policy at the recorded pool size."""
    data = read_calls(path)
    events = data["events"]
    requests = calls_requests(events)
    total = sum(len(r.hash_ids) for r in requests)

    def run(policy: EvictionPolicy, blocks: int) -> float:
        return replay_calls(events, policy, blocks) / total

    blocks = int(data["pool_blocks"])
    # The pool in Llama-3.1-8B's bytes (16 tokens in 2 MiB), as the GPU grid names it.
    gib = blocks * int(data["block_tokens"]) / ENGINE_BLOCK_TOKENS * BLOCK_BYTES / GIB
    label = f"engine {path.name}"
    return measure(label, int(data["concurrency"]), requests, blocks, policies, run, gib)


def table(rows: list[Row], names: list[str], key: str) -> None:
    """One line per (concurrency, pool): every policy's hit ratio, the optimum, and whether the
    default holds half the optimum where LRU caches under 5% of the reusable blocks."""
    head = f"{'in flight':>10}{key:>10}" + "".join(f"{n:>22}" for n in names)
    print(head + f"{'optimum':>10}{'LRU < 5% of reusable: hinted >= optimum/2':>44}")
    cells = sorted({(r.concurrency, r.pool_blocks, r.sequence) for r in rows})
    for concurrency, blocks, sequence in cells:
        cell = (concurrency, blocks, sequence)
        by = {r.policy: r for r in rows if (r.concurrency, r.pool_blocks, r.sequence) == cell}
        size = f"{by['optimal'].pool_gib:.0f} GiB" if key == "pool" else str(blocks)
        line = f"{concurrency or 'trace':>10}{size:>10}"
        line += "".join(
            f"{by[n].hit_ratio:>13.4f} ({by[n].fraction_of_optimum:>5.0%})" for n in names
        )
        optimum = by["optimal"].hit_ratio
        verdict = "-"
        if by["lru"].hit_ratio < 0.05 * by["lru"].reusable:
            verdict = "yes" if by["hinted"].hit_ratio >= optimum / 2 else "NO"
        label = f"  {sequence.split(' ', 1)[1]}" if " " in sequence else ""
        print(line + f"{optimum:>10.4f}{verdict:>44}{label}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--requests", type=int, nargs="+", default=[160, 240, 320])
    parser.add_argument("--gib", type=float, nargs="+", default=[2, 3, 4, 8])
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--context-blocks", type=int, default=40)
    parser.add_argument("--widen", type=int, default=4)
    parser.add_argument("--before", default=BEFORE, help="git revision of 'hinted (before)'")
    parser.add_argument("--bundled-concurrency", type=int, nargs="*", default=[0, 8, 32, 128])
    parser.add_argument("--bundled-pool-blocks", type=int, nargs="+", default=[1000, 4000])
    parser.add_argument("--json", type=Path, default=Path("docs/results/pressure_bench.json"))
    parser.add_argument("--calls", type=Path, nargs="*", default=[], help="recorded engine calls")
    parser.add_argument("--record", type=Path, default=None, help="record vLLM's calls, exit")
    parser.add_argument("--record-pool-blocks", type=int, default=512)
    parser.add_argument("--record-kv-blocks", type=int, default=512)
    args = parser.parse_args()
    if len(args.requests) != len(args.concurrency):
        parser.error("--requests needs one count per --concurrency")
    if args.record is not None:
        summary = record_vllm(
            args.record,
            args.concurrency[0],
            args.requests[0],
            args.record_pool_blocks,
            args.record_kv_blocks,
            args.widen,
        )
        print(json.dumps(summary, indent=1))
        return
    policies: dict[str, PolicyFactory] = {"lru": lambda _: LRUPolicy()}
    before = hinted_before(args.before)
    if before is not None:
        policies["hinted (before)"] = before
    policies["hinted, all stores"] = AdmittingAll
    policies["hinted"] = HintedPolicy
    rows: list[Row] = []
    for concurrency, count in zip(args.concurrency, args.requests, strict=True):
        requests = benchmark_sequence(
            concurrency, count, args.turns, args.context_blocks, args.widen
        )
        for gib in args.gib:
            blocks = int(gib * GIB // BLOCK_BYTES)
            rows += measure("benchmark", concurrency, requests, blocks, policies)
    bundled = bundled_trace_path()
    for concurrency in args.bundled_concurrency:
        requests = trace_requests(bundled, concurrency=concurrency or None)
        for blocks in args.bundled_pool_blocks:
            rows += measure("bundled", concurrency, requests, blocks, policies)
    for path in args.calls:
        rows += measure_calls(path, policies)
    names = list(policies)
    where, when = machine_description(), datetime.date.today().isoformat()
    print(f"pool under pressure, {when}, {where}")
    print("benchmark sequence (vllm_gpu_bench's requests, 2 MiB blocks of 16 tokens), hit ratio")
    print("(fraction of the optimum):")
    table([r for r in rows if r.sequence == "benchmark"], names, "pool")
    print("bundled trace, N conversations in flight (kvtier simulate --concurrency N):")
    table([r for r in rows if r.sequence == "bundled"], names, "blocks")
    if args.calls:
        print("the engine's order (recorded vLLM calls), blocks served / blocks of the requests:")
        table([r for r in rows if r.sequence.startswith("engine")], names, "blocks")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": where,
        "date": when,
        "before": args.before,
        "block_bytes": BLOCK_BYTES,
        "turns": args.turns,
        "context_blocks": args.context_blocks,
        "widen": args.widen,
        "rows": [asdict(r) for r in rows],
    }
    args.json.write_text(json.dumps(payload, indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
