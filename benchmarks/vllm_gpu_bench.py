"""kvtier against vLLM's own offloading, in a real vLLM on one GPU, on one request sequence.

Configurations (``--configs``, run in that order, each in a fresh engine):

* ``none``: vLLM alone (its GPU prefix cache only);
* ``native``: vLLM's own CPU offloading, ``LLM(kv_offloading_size=H, kv_offloading_backend=
  "native")`` with H = the host size in GiB; vLLM turns it into ``kv_transfer_config =
  {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config":
  {"cpu_bytes_to_use": H * 2**30}}``;
* ``native_fs``: vLLM's own multi-tier offloading (``TieringOffloadingSpec``, in
  ``vllm.v1.kv_offload.tiering`` since before 0.25.1) with its fs tier, the same host size:
  ``kv_transfer_config = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
  "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "spec_module_path":
  "vllm.v1.kv_offload.tiering.spec", "cpu_bytes_to_use": int(H * 2**30), "secondary_tiers":
  [{"type": "fs", "root_dir": "<workdir>/native_fs/tier"}]}}`` (``spec_module_path`` is read only
  where the spec's name is not registered; ``fs`` is the tier's registered type, looked up by
  class name ``FileSystemTierManager`` if a release named it otherwise).
  vLLM's fs tier (``FileSystemTierManager``: ``root_dir``, ``n_read_threads``,
  ``n_write_threads``, 16 each by default) has no capacity option in 0.25.1 or 0.32: it writes
  every block the CPU tier stores and never deletes one. So it gets the disk kvtier's fs tier is
  sized to, and the run stops (an ``error`` row) if the disk's free space falls below half the
  reserve (``vllm_grid.disk_floor_bytes``). A vLLM without the tiering module (or its ``fs``
  tier) fails this configuration with a message saying so;
* ``kvtier``: kvtier with a host pool of the same size;
* ``kvtier_fs``: that pool plus an fs tier in ``<workdir>/fs``, capacity ``--fs-gib`` (default:
  the free space at ``--workdir`` less the larger of 8 GiB and 15% of the disk).

Variants of kvtier's, to compare two settings on one host in one run (``--configs
kvtier_fs,kvtier_fs+tiers.0.write=on_evict``): a kvtier base followed by ``+key=value`` settings
of kvtier's connector config, a dotted key (a number picks a list's item) and a JSON value or
text (``benchmarks/config_variants.py``, the scheduler replay's syntax). The base decides the
rest: its fs tier and capacity, the disk's one point at a time, the engine. A variant's rows are
kept under its full label (``points[P].configs[LABEL]``, its settings as ``overrides`` in the
row), ``--skip-done`` treats it as a configuration of its own, and the report prints its ratios
to its base at each point (output tokens/s, TTFT p99, the connector's p99 per step); the
acceptance checks stay on the bases. A label holds no comma (``--configs`` splits on them).

A ``beside.`` key is the bench's, not kvtier's, and every base takes it: ``beside.write_mbps=N``
runs ``benchmarks/disk_writer.py`` in a process of its own during the timed run (started after the
engine's start and warm-up, stopped however the run ends), writing 2 MiB files into
``<workdir>/beside`` as kvtier's fs tier writes its blocks (4 threads, a temp file, then a
rename; at most 1 GiB there at once, removed after) at about N MB/s;
``+beside.write_fsync=true`` syncs each file first, ``+beside.write_source_mib=M`` takes the
blocks in turn from an M MiB buffer and ``+beside.write_checksum=true`` hashes each (the memory
the fs tier reads). The row gets ``beside_write`` (``mbps_asked``, ``bytes``, ``seconds``,
``mbps``, and the settings not at their default), and the label runs at one point at a time, as
the fs configurations do. ``beside.switch_interval_ms=N`` sets ``sys.setswitchinterval`` in this
process, where the engine runs, for the timed run. Every row records ``engine_threads``
(``engine_threads.py``): the main thread's CPU and context switches over the timed run, and the
other threads' CPU by name. ``--configs kvtier,kvtier+beside.write_mbps=1000,kvtier_fs`` tells
apart why the fs tier slows the connector's hooks: if the pool alone slows as much beside another
process's writes, it is the writes' effect on the host (page cache copies, memory bandwidth,
caches); if not, the fs tier's I/O threads sharing the engine's process (the GIL).

Model: Llama-3.1-8B's architecture (``--model llama8b``; ``config.json`` only, vLLM's dummy
weights, bfloat16, CUDA graphs on, vLLM's default attention backend, prefix caching on) or a
tiny Llama for a CPU smoke run (``--model tiny``). Token-id prompts, no tokenizer. Hybrid models
(issue 27), vLLM's hybrid KV cache manager on: ``--model gemma3`` (Gemma-3-12B's text
architecture: 5 sliding-window layers of 1024 tokens to each full-attention one) and ``--model
nemotronh`` (Nemotron-H-8B's shape: Mamba-2 layers with 4 attention layers, ``mamba_cache_mode``
``all``, 1,152-token blocks); their kvtier rows add ``kvtier_bytes_per_token``, bytes stored per
cached token for each kind of KV cache group, and ``kvtier_bytes_per_token_ratio``, their sum over
what a model of the same size with full attention in every layer that keeps a cache stores
(``full_attention_bytes_per_token``). A hybrid model has its own ``--concurrency``, ``--requests``
and ``--host-gib`` defaults (``vllm_bench_engine.RUN_DEFAULTS``: sized so that both kvtier's pool
and vLLM's offloading hold the conversations between their turns), and the run prints (and keeps
in the JSON as ``prediction``) the pool hits ``vllm_bench_hits`` predicts for kvtier and native.

Workload: the demo's multi-turn conversations from the bundled trace (``kvtier.demo``: each
turn re-sends the previous prompt and answer, then a new question), each demo token widened to
``--widen`` tokens (4: a 512-token trace block becomes 128 tokens) so prompts are 1k-8k tokens.
``--concurrency`` conversations are in flight: a conversation's next turn is sent only when its
previous turn finished, and a finished conversation's place goes to the next one. A conversation
with a prompt longer than ``--max-model-len`` less the output is left out (counted in the
workload's ``dropped_conversations``). Every request generates ``--max-tokens`` tokens (greedy,
EOS ignored). vLLM's GPU KV cache is small (``--gpu-kv-gib``, 2 in the grid; without it
``--gpu-kv-requests`` of the longest requests, by default ``--concurrency`` of them), so a
conversation is evicted from it between its turns and the host tier serves it.

A hybrid model's GPU KV cache is sized in the blocks vLLM's hybrid KV cache manager allocates
(``vllm_bench_kv``: groups of equal layers, one page size, Mamba states padded to it): by default
2.5 of the workload's longest requests at the peak vLLM reserves for one (``--gpu-kv-requests``;
about what 2 GiB is for Llama-3.1-8B), and the engine's ``max_model_len`` is the longest request
in whole blocks (vLLM checks at start that one request of ``max_model_len`` fits). Counted in
the workload: ``block_tokens``, ``gpu_kv_blocks`` and ``request_peak_blocks``; reusable tokens are
counted in that block size. A ``--gpu-kv-gib`` below one such request is refused at once.

Measured on the host per request (kept in the JSON as ``per_request``): its submission id
``c<conversation>.t<turn>`` (the same request in every configuration), TTFT (``add_request`` to
the step that returns its first token), prompt tokens, cached prompt tokens
(``num_cached_tokens``: vLLM's GPU prefix cache plus connector loads) and a digest of its output
tokens. Per configuration: TTFT p50/p90/p99, mean TTFT of requests with and without cached
tokens, output tokens/s over the timed run, prompt tokens cached vs computed, host memory (the
machine's MemTotal - MemAvailable before the engine started and at the end of the run, the
process's peak RSS), engine start time, the scheduler-side time the connector adds per engine
step (every scheduler-side connector call timed in this process, nested calls once, summed per
step, p50/p99 over the timed steps; the same hooks for vLLM's OffloadingConnector and kvtier's),
and kvtier's counters over the timed run (blocks promoted from tiers into the pool, blocks loaded
into vLLM). Results are merged into ``--json`` per configuration as each finishes;
``--report-only`` prints the table from that file; ``--merge FILE ...`` copies into it the newer
rows of other grid files (a lent machine's, run from a copy) and prints it.

``--grid`` runs the grid of issue 24 (``benchmarks/vllm_grid.py``: points, skip/rerun, time
budget; ``benchmarks/vllm_grid_report.py``: table, acceptance checks, plot) into
``docs/results/vllm_gpu_bench_grid.json`` and a PNG next to it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import config_variants as variants
import disk_writer as dw
import engine_threads
import vllm_bench_engine as eng
import vllm_bench_hits as hits
import vllm_grid as grid
import vllm_grid_report as gr

SINGLE_JSON = "docs/results/vllm_gpu_bench.json"
GRID_JSON = "docs/results/vllm_gpu_bench_grid.json"
KVTIER_COUNTERS = (
    ("cache", "promoted_blocks"),
    ("cache", "loaded_blocks"),
    ("cache", "promotions"),
    ("cache", "promotion_failures"),
    ("cache", "store_skipped_full"),
    ("connector", "hit_tokens"),
    ("connector", "load_blocks_failed"),
    ("connector", "deferred_lookups"),
)
"""kvtier's counters kept per row, as increments over the timed run."""


@dataclass(slots=True)
class Timed:
    id: str
    ttft: float
    prompt: int
    cached: int
    output: list[int] = field(default_factory=list)


def meminfo_used() -> int:
    values: dict[str, int] = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        values[key] = int(rest.split()[0]) * 1024
    return values["MemTotal"] - values["MemAvailable"]


def peak_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def connector_of(llm: Any) -> Any:
    core = llm.llm_engine.engine_core.engine_core
    return getattr(core.scheduler, "connector", None)


def kvtier_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, int]:
    """kvtier's counters over the timed run (``tier_read_blocks``: blocks read from every
    secondary tier)."""
    out: dict[str, int] = {}
    for section, name in KVTIER_COUNTERS:
        out[name] = int(after.get(section, {}).get(name, 0)) - int(
            before.get(section, {}).get(name, 0)
        )

    def reads(stats: dict[str, Any]) -> int:
        return sum(int(t.get("read_blocks", 0)) for t in stats.get("tiers", {}).values())

    out["tier_read_blocks"] = reads(after) - reads(before)
    return out


def drive(
    llm: Any,
    convs: list[eng.Conversation],
    concurrency: int,
    max_tokens: int,
    label: str,
    guard: eng.DiskGuard | None,
) -> tuple[list[Timed], float]:
    """Keep ``concurrency`` conversations in flight; returns the timed requests and wall time."""
    from tqdm import tqdm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False
    )
    pending = deque(convs)
    active: dict[str, tuple[eng.Conversation, str, float, int]] = {}
    first_token: dict[str, float] = {}
    done: list[Timed] = []

    def submit(conv: eng.Conversation) -> None:
        request_id, tokens = conv.next_request()
        engine_id = f"{label}-{request_id}"
        active[engine_id] = (conv, request_id, time.perf_counter(), len(tokens))
        engine.add_request(engine_id, TokensPrompt(prompt_token_ids=tokens), params)

    total = sum(len(c.turns) for c in convs)
    started = time.perf_counter()
    while pending and len(active) < concurrency:
        submit(pending.popleft())
    with tqdm(total=total, desc=label, unit="req", file=sys.stderr, leave=False) as bar:
        while active:
            if guard is not None:
                guard.check()
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                if out.request_id not in active:
                    continue
                if out.request_id not in first_token and out.outputs and out.outputs[0].token_ids:
                    first_token[out.request_id] = now
                if not out.finished:
                    continue
                conv, request_id, sent, prompt = active.pop(out.request_id)
                ttft = first_token.get(out.request_id, now) - sent
                cached = int(out.num_cached_tokens or 0)
                done.append(Timed(request_id, ttft, prompt, cached, list(out.outputs[0].token_ids)))
                bar.update(1)
                if conv.turns:
                    submit(conv)
                elif pending:
                    submit(pending.popleft())
    return done, time.perf_counter() - started


def output_digest(tokens: list[int]) -> str:
    """A request's output tokens, short enough to keep per request in the JSON."""
    return hashlib.blake2b(repr(tokens).encode(), digest_size=6).hexdigest()


def summarize(timed: list[Timed], wall: float) -> dict[str, Any]:
    """A configuration's row from its timed requests."""
    ttft = [t.ttft * 1e3 for t in timed]
    hits = [t.ttft * 1e3 for t in timed if t.cached]
    misses = [t.ttft * 1e3 for t in timed if not t.cached]
    prompt_tokens = sum(t.prompt for t in timed)
    cached = sum(t.cached for t in timed)
    out_tokens = sum(len(t.output) for t in timed)
    records = [
        gr.RequestRecord(t.id, round(t.ttft * 1e3, 2), t.prompt, t.cached, output_digest(t.output))
        for t in sorted(timed, key=lambda t: t.id)
    ]
    return {
        "requests": len(timed),
        "ttft_ms": {str(q): round(gr.percentile(ttft, q), 2) for q in (50, 90, 99)},
        "ttft_mean_ms_with_cached_tokens": round(statistics.fmean(hits), 2) if hits else None,
        "ttft_mean_ms_without": round(statistics.fmean(misses), 2) if misses else None,
        "requests_with_cached_tokens": len(hits),
        "output_tokens_per_s": round(out_tokens / wall, 1) if wall > 0 else 0.0,
        "wall_s": round(wall, 2),
        "prompt_tokens": prompt_tokens,
        "prompt_tokens_cached": cached,
        "prompt_tokens_computed": prompt_tokens - cached,
        "per_request": gr.per_request(records),
    }


def shutdown(llm: Any) -> None:
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
    del llm
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except ImportError:
        pass


def run_config(
    spec: eng.RunSpec,
    model: eng.ModelSpec,
    prompts: eng.Prompts,
    max_tokens: int,
    guard: eng.DiskGuard | None,
) -> dict[str, Any]:
    from vllm import LLM

    convs = prompts.conversations()
    used_before = meminfo_used()
    started = time.perf_counter()
    llm = LLM(**eng.engine_kwargs(spec, model))
    start_s = time.perf_counter() - started
    timer: eng.HookTimer | None = None
    try:
        lengths = sorted(len(p) for p in prompts.all())
        eng.warmup(llm, model, eng.warmup_lengths(lengths))
        connector = connector_of(llm)
        profile = eng.profile_setting()
        timer = None
        sampler = eng.CostSampler(connector)
        if connector is not None:
            profile_s = profile[1] if profile else None
            timer = eng.HookTimer(connector, profile_s=profile_s, after_step=sampler)
        before = eng.kvtier_counters(connector)
        writer = beside_writer(spec)  # started after the engine's start and warm-up
        with writer or contextlib.nullcontext(), switch_interval(spec):
            if timer is not None:
                timer.enabled = True
            threads_before = engine_threads.sample()
            timed, wall = drive(llm, convs, spec.concurrency, max_tokens, spec.config, guard)
            threads = engine_threads.usage(threads_before, engine_threads.sample(), wall)
            if timer is not None:
                timer.enabled = False
        after = eng.kvtier_counters(connector)
        used_after = meminfo_used()
    finally:
        if timer is not None:
            timer.close()
        shutdown(llm)
    row = summarize(timed, wall)
    if timer is not None:
        row.update(eng.connector_figures(timer))
        if profile is not None and timer.slow_profile is not None:
            name = f"{variants.file_label(spec.config)}-{spec.concurrency}x{spec.host_gib:g}.prof"
            eng.save_slow_profile(timer, profile[0], name)
            row["profiled_steps"] = timer.profiled_steps
    row["host_used_gib_delta"] = round((used_after - used_before) / (1 << 30), 2)
    row["peak_rss_gib"] = round(peak_rss() / (1 << 30), 2)
    row["engine_start_s"] = round(start_s, 1)
    row["elapsed_s"] = round(time.perf_counter() - started, 1)
    if spec.has_fs:
        row["fs_gib"] = spec.fs_gib
    row["engine_threads"] = threads
    if writer is not None:
        row["beside_write"] = writer.row()
    if spec.base.startswith(variants.KVTIER_PREFIX):
        row.update(kvtier_settings(spec))
        row["kvtier"] = kvtier_delta(before, after)
        row["kvtier_stats"] = after
        row.update(sampler.figures())
        if "groups" in after:
            per_kind = group_bytes_per_token(after)
            row["kvtier_bytes_per_token"] = per_kind
            if model.pool is not None:
                row.update(bytes_ratio(per_kind, model.pool.full_attention_bytes_per_token))
    return row


def beside_writer(spec: eng.RunSpec) -> dw.BesideWriter | None:
    """The process writing files beside the engine that ``beside.write_mbps`` asks for, in
    ``<workdir>/beside`` (the fs tiers' disk; removed when it stops). Its files stay under
    ``dw.KEEP_MIB``, clear of the disk guard's floor next to a full fs tier."""
    beside = spec.variant.beside
    mbps = beside.get(variants.WRITE_MBPS)
    if mbps is None:
        return None
    return dw.BesideWriter(
        spec.beside_dir,
        float(mbps),
        bool(beside.get(variants.WRITE_FSYNC)),
        int(beside.get(variants.WRITE_SOURCE_MIB, 0)),
        bool(beside.get(variants.WRITE_CHECKSUM)),
    )


@contextlib.contextmanager
def switch_interval(spec: eng.RunSpec) -> Iterator[None]:
    """The interpreter's switch interval that ``beside.switch_interval_ms`` asks for, while
    open (the engine runs in this process), then the previous one again."""
    ms = spec.variant.beside.get(variants.SWITCH_INTERVAL_MS)
    if ms is None:
        yield
        return
    previous = sys.getswitchinterval()
    sys.setswitchinterval(float(ms) / 1000)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)


def kvtier_settings(spec: eng.RunSpec) -> dict[str, Any]:
    """A kvtier row's load mode and eviction policy as its engine was given them, and a
    variant's ``overrides``: a variant may set either, and its row must say what ran."""
    extra = eng.kvtier_extra(spec)
    out = {
        "async_loads": extra["vllm"]["async_loads"],
        "eviction": extra.get("eviction", "default"),
    }
    if spec.variant.overrides:
        out["overrides"] = spec.variant.overrides
    return out


def bytes_ratio(per_kind: dict[str, float], full_attention: int) -> dict[str, float | int]:
    """kvtier's bytes per cached token over all kinds of groups, and its ratio to a model of the
    same size with full attention in every layer that keeps a cache."""
    total = sum(per_kind.values())
    return {
        "full_attention_bytes_per_token": full_attention,
        "kvtier_bytes_per_token_ratio": round(total / full_attention, 3) if full_attention else 0,
    }


def group_bytes_per_token(stats: dict[str, Any]) -> dict[str, float]:
    """A hybrid model's bytes stored per cached token for each kind of KV cache group (kvtier's
    stats file, ``groups``): every group's stored bytes over the tokens of the blocks its first
    full-attention group stored (all ranks; slots hold more where groups differ in layers)."""
    groups = list(stats.get("groups", {}).values())
    full = [g for g in groups if g.get("kind") == "full"]
    tokens = int(full[0].get("stored_blocks", 0)) * int(stats.get("block_tokens", 0) or 0)
    out: dict[str, float] = {}
    for group in groups:
        kind = str(group.get("kind"))
        out[kind] = out.get(kind, 0.0) + int(group.get("stored_bytes", 0))
    return {kind: round(b / tokens, 1) if tokens else 0.0 for kind, b in out.items()}


def run_safely(
    spec: eng.RunSpec,
    model: eng.ModelSpec,
    prompts: eng.Prompts,
    max_tokens: int,
    shares_host: bool = False,
) -> dict[str, Any]:
    """``run_config``, or a row with the ``error`` when it failed; the fs tiers' directories and
    any offloading region it left in /dev/shm are removed either way (the regions by the grid
    when another engine ``shares_host``: a new one may be that engine's)."""
    shm_before = eng.offload_shm_files()
    guard = None
    if spec.has_fs:
        total = shutil.disk_usage(spec.workdir).total
        guard = eng.DiskGuard(spec.workdir, grid.disk_floor_bytes(total))
    started = time.perf_counter()
    try:
        return run_config(spec, model, prompts, max_tokens, guard)
    except Exception as exc:  # one failing configuration must not lose the others
        traceback.print_exc()
        # An engine that failed to start leaves its worker's connector registered in this
        # process, and the next engine would reuse it.
        from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

        ensure_kv_transfer_shutdown()
        gc.collect()
        elapsed = round(time.perf_counter() - started, 1)
        return {"error": f"{type(exc).__name__}: {exc}", "elapsed_s": elapsed}
    finally:
        eng.clear_fs(spec.workdir)
        if not shares_host:
            eng.remove_new_shm(shm_before)


# -- provenance and the grid's engine side ------------------------------------------------------


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "cpu_count": os.cpu_count()}
    try:
        import torch
        import vllm

        info["vllm"] = vllm.__version__
        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:
        pass
    return info


class VllmPointRunner:
    """The grid's engine side: a point's workload and one configuration run at a time."""

    def __init__(
        self,
        settings: eng.Settings,
        model: eng.ModelSpec,
        requests: dict[int, int],
        shares_host: bool = False,
    ) -> None:
        self.settings = settings
        self.shares_host = shares_host
        self.spec_model = model
        self.model = model.name
        self.machine = machine()
        self.workdir = settings.workdir
        self._requests = requests
        self._prompts: dict[int, eng.Prompts] = {}

    def workload(self, point: grid.GridPoint) -> grid.PointWorkload:
        c = point.concurrency
        prompts, summary = eng.build_point(
            self.settings, self.spec_model, c, grid.requests_for(c, self._requests)
        )
        self._prompts = {c: prompts}  # one point's prompts at a time
        return grid.PointWorkload(summary)

    def clear_fs(self) -> None:
        eng.clear_fs(self.workdir)

    def run(self, jobs: list[grid.Job]) -> list[dict[str, Any]]:
        if len(jobs) != 1:
            raise grid.GridError("one configuration at a time in this process: drop --gpus")
        job = jobs[0]
        summary = job.workload.summary
        spec = eng.RunSpec(
            config=job.config,
            concurrency=job.point.concurrency,
            host_gib=job.point.host_gib,
            fs_gib=job.fs_gib,
            kv_bytes=int(summary["gpu_kv_bytes"]),
            max_model_len=int(summary["max_model_len"]),
            workdir=self.workdir,
        )
        prompts = self._prompts[job.point.concurrency]
        return [
            run_safely(spec, self.spec_model, prompts, self.settings.max_tokens, self.shares_host)
        ]


@dataclass(slots=True)
class Child:
    job: grid.Job
    row_path: Path
    process: subprocess.Popen[bytes]
    began: float


class ChildPointRunner(VllmPointRunner):
    """Runs each configuration in a child process of this script (``--child-row``): an engine
    that crashes, or leaves GPU memory behind, cannot spoil the configurations after it. In one
    process, an H100 grid lost a point that way: a kvtier_fs engine started after a kvtier one
    stopped in PyTorch's CUDA allocator (an internal assert), and the next point's engines found
    17 GiB still taken and refused to start. A child costs about 10 s more (its imports). One
    that runs past ``timeout_s`` is killed and its row is an error (an engine that hangs must
    not hold the rest of the grid).

    With ``lanes`` above 1 a round's children run at once, lane ``i`` on the ``i``-th visible GPU
    with its own work directory (``<workdir>/lane<i>``) and vLLM cache; offloading regions left in
    /dev/shm are removed once the whole round has ended (vLLM's names do not say whose they are)."""

    def __init__(
        self,
        settings: eng.Settings,
        model: eng.ModelSpec,
        requests: dict[int, int],
        argv: list[str],
        timeout_s: float,
        lanes: int = 1,
    ) -> None:
        super().__init__(settings, model, requests)
        self._argv = argv
        self.timeout_s = timeout_s
        self.lanes = lanes
        self._gpus = lane_gpus(lanes)

    def lane_workdir(self, lane: int) -> Path:
        return self.workdir / f"lane{lane}" if self.lanes > 1 else self.workdir

    def clear_fs(self) -> None:
        for lane in range(self.lanes):
            eng.clear_fs(self.lane_workdir(lane))

    def command(self, job: grid.Job, row_path: Path) -> list[str]:
        """The child's command line: this script with the parent's arguments, narrowed."""
        lane_args = []
        if self.lanes > 1:
            lane_args = ["--workdir", str(self.lane_workdir(job.lane)), "--shares-host"]
        return [
            sys.executable, str(Path(__file__).resolve()), *self._argv,
            "--grid-points", job.point.key, "--configs", job.config,
            "--fs-gib", repr(job.fs_gib), *lane_args, "--child-row", str(row_path),
        ]  # fmt: skip

    def child_env(self, lane: int) -> dict[str, str] | None:
        if self.lanes == 1:
            return None  # the parent's
        cache = Path(os.environ.get("VLLM_CACHE_ROOT", Path.home() / ".cache" / "vllm"))
        # Two engines compiling the same graphs must not write one cache directory at once.
        extra = {
            "CUDA_VISIBLE_DEVICES": self._gpus[lane],
            "VLLM_CACHE_ROOT": str(cache / f"lane{lane}"),
        }
        return {**os.environ, **extra}

    def run(self, jobs: list[grid.Job]) -> list[dict[str, Any]]:
        shm_before = eng.offload_shm_files()
        with tempfile.TemporaryDirectory() as tmp:
            children = []
            for job in jobs:
                row_path = Path(tmp) / f"row{job.lane}.json"
                self.lane_workdir(job.lane).mkdir(parents=True, exist_ok=True)
                process = subprocess.Popen(
                    self.command(job, row_path), env=self.child_env(job.lane)
                )
                children.append(Child(job, row_path, process, time.perf_counter()))
            rows = [self._finish(child) for child in children]
        eng.remove_new_shm(shm_before)  # what a child that died left
        return rows

    def _finish(self, child: Child) -> dict[str, Any]:
        left = self.timeout_s - (time.perf_counter() - child.began)
        try:
            code = child.process.wait(timeout=max(0.0, left))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()
            return {"error": f"the configuration's process ran past {self.timeout_s:g} s: killed"}
        row = json.loads(child.row_path.read_text()) if child.row_path.exists() else None
        if not isinstance(row, dict):
            return {"error": f"the configuration's process exited with {code} and wrote no row"}
        if row.pop("workload_digest", None) != child.job.workload.digest:
            return {"error": "the configuration's process ran another request sequence"}
        row["process_s"] = round(time.perf_counter() - child.began, 1)
        return row


def lane_gpus(lanes: int) -> list[str]:
    """The GPU each lane's children see: the visible ones in order (``CUDA_VISIBLE_DEVICES``,
    else all), at least one per lane; none for one lane (its child sees the parent's)."""
    if lanes == 1:
        return []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    else:
        try:
            import torch

            gpus = [str(i) for i in range(torch.cuda.device_count())]
        except ImportError:
            gpus = []
    if len(gpus) < lanes:
        raise grid.GridError(f"--gpus {lanes} needs {lanes} GPUs; {len(gpus)} visible")
    return gpus[:lanes]


def run_child(args: argparse.Namespace, runner: VllmPointRunner, config: str) -> int:
    """One configuration at one point (``--child-row``): its row, with the workload's digest,
    to the file the parent named."""
    points = grid.parse_points(args.grid_points)
    if len(points) != 1 or args.fs_gib is None:
        raise grid.GridError("--child-row needs one --grid-points point and --fs-gib")
    workload = runner.workload(points[0])
    [row] = runner.run([grid.Job(points[0], workload, config, args.fs_gib)])
    row["workload_digest"] = workload.digest
    Path(args.child_row).write_text(json.dumps(row))
    return 0


# -- the two modes ------------------------------------------------------------------------------


def print_single(data: dict[str, Any]) -> None:
    """One invocation's table (the grid's columns) and checks; ``data`` is shaped as a point."""
    print(f"model     {data.get('model')}")
    print(f"workload  {data.get('workload')}")
    print(f"machine   {data.get('machine')}")
    configs: dict[str, Any] = data.get("configs", {})
    labels = gr.ordered_configs(configs)
    width = gr.config_width(labels)
    print(gr.table_head(width))
    base = gr.usable(configs, "none")
    for name in labels:
        print(gr.table_row("-", name, configs[name], base, width))
    compared = gr.variant_lines(data)
    if compared:
        print(gr.VARIANTS_HEAD)
        print("\n".join(f"  {line}" for line in compared))
    hits.print_hybrid(data)
    print(f"checks (within {gr.TIE_BAND:.0%} a tie):")
    for check in gr.point_checks(data):
        if check.verdict is not gr.Verdict.MISSING:
            print(f"  {check.verdict.value:<6} {check.name}: {check.detail}")


def safe_fs_gib(workdir: Path, wanted: float | None) -> float:
    eng.clear_fs(workdir)
    usage = shutil.disk_usage(workdir)
    safe = grid.fs_capacity_gib(usage.free, usage.total)
    return round(safe, 1) if wanted is None else min(wanted, safe)


def run_single(
    args: argparse.Namespace, settings: eng.Settings, model: eng.ModelSpec, configs: list[str]
) -> int:
    out = Path(args.json or SINGLE_JSON)
    data = grid.load(out)
    prompts, summary = eng.build_point(settings, model, args.concurrency, args.requests)
    summary["host_gib"] = args.host_gib
    if model.pool is not None:
        convs = [[p for _t, p in turns] for _i, turns in prompts.by_conversation]
        data["prediction"] = hits.summary(
            convs, args.concurrency, model.pool, args.host_gib, settings.max_tokens
        )
        hits.print_hybrid({"prediction": data["prediction"]})
    if data.get("workload", {}).get("digest") not in (None, summary["digest"]):
        data["configs"] = {}  # rows of another request sequence do not pair with these
    data.update(model=model.name, workload=summary, machine=machine())
    data.setdefault("configs", {})
    commit = args.commit or grid.git_commit(Path(__file__).resolve().parents[1])
    print(f"workload  {summary}", file=sys.stderr)
    for config in configs:
        spec = eng.RunSpec(
            config,
            args.concurrency,
            args.host_gib,
            safe_fs_gib(settings.workdir, args.fs_gib),
            int(summary["gpu_kv_bytes"]),
            int(summary["max_model_len"]),
            settings.workdir,
        )
        row = run_safely(spec, model, prompts, settings.max_tokens)
        row.update(date=grid.now_utc(), commit=commit, workload_digest=summary["digest"])
        data["configs"][config] = row
        grid.save(out, data)
    print_single(data)
    return 0


def report_grid(data: dict[str, Any], out: Path) -> None:
    print("\n".join(gr.grid_lines(data)))
    written = gr.write_plot(data, gr.plot_path(out))
    print(f"plot      {written}" if written else "plot      not written (needs matplotlib)")


def disk_configs(labels: list[str]) -> frozenset[str]:
    """The labels that run at one point at a time (``GridOptions.disk_configs``): a variant of a
    base with an fs tier has that tier too, and two of them on one disk slow each other; so does
    a writer beside the engine (``beside.write_mbps``), which also loads the host it measures."""
    return frozenset(c for c in labels if writes_disk(c))


def writes_disk(label: str) -> bool:
    spec = variants.parse_config(label, eng.CONFIGS)
    return spec.kind in eng.FS_CONFIGS or variants.WRITE_MBPS in spec.beside


def run_grid_mode(
    args: argparse.Namespace, settings: eng.Settings, model: eng.ModelSpec, configs: list[str]
) -> int:
    out = Path(args.json or GRID_JSON)
    concurrencies = grid.parse_numbers(args.grid_concurrency, "--grid-concurrency", int)
    hosts = grid.parse_numbers(args.grid_host_gib, "--grid-host-gib", float)
    selected = grid.parse_points(args.grid_points) if args.grid_points else None
    points = grid.expand(concurrencies, hosts, selected)
    rerun = {p.key for p in grid.parse_points(args.rerun)} if args.rerun else set()
    commit = args.commit or grid.git_commit(Path(__file__).resolve().parents[1])
    selection = grid.Selection(commit, args.skip_done, args.reuse_baselines, frozenset(rerun))
    disk = disk_configs(configs)
    options = grid.GridOptions(configs, selection, args.max_minutes, args.fs_gib, args.gpus, disk)
    if commit == "unknown" or commit.endswith("+dirty"):
        print(f"commit {commit}: a later --skip-done will not trust these rows", file=sys.stderr)
    requests = grid.parse_requests(args.grid_requests)
    if args.child_row:
        runner = VllmPointRunner(settings, model, requests, args.shares_host)
        return run_child(args, runner, configs[0])
    if args.gpus < 1 or (args.in_process and args.gpus > 1):
        raise grid.GridError("--gpus needs a child process per configuration, at least one GPU")
    if args.in_process:
        runner = VllmPointRunner(settings, model, requests)
    else:
        timeout_s = args.config_timeout * 60
        runner = ChildPointRunner(settings, model, requests, args.argv, timeout_s, args.gpus)
    data = grid.run_grid(points, options, runner, out)
    report_grid(data, out)
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--configs", default=",".join(eng.CONFIGS))
    p.add_argument("--model", choices=["llama8b", "tiny", *eng.HYBRID_MODELS], default="llama8b")
    p.add_argument("--host-gib", type=float, default=None, help="default 8 (see RUN_DEFAULTS)")
    p.add_argument("--fs-gib", type=float, default=None, help="default: the disk's safe size")
    p.add_argument("--concurrency", type=int, default=None, help="default 16 (see RUN_DEFAULTS)")
    p.add_argument("--requests", type=int, default=None, help="default 160 (see RUN_DEFAULTS)")
    p.add_argument("--turns", type=int, default=None, help="default 4 (grid: 5)")
    p.add_argument("--context-blocks", type=int, default=40)
    p.add_argument("--widen", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=None, help="default 32 (grid: 64)")
    p.add_argument("--max-model-len", type=int, default=16384)
    p.add_argument("--gpu-kv-gib", type=float, default=None, help="default: see the docstring")
    p.add_argument(
        "--gpu-kv-requests",
        type=float,
        default=None,
        help="GPU KV cache in longest requests (without --gpu-kv-gib; see the docstring)",
    )
    p.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "kvtier-gpu-bench"))
    p.add_argument("--json", default=None, help=f"default {SINGLE_JSON} (grid: {GRID_JSON})")
    p.add_argument("--commit", default=None, help="default: git rev-parse HEAD")
    p.add_argument("--report-only", action="store_true")
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="FILE",
        help="copy into --json the newer rows of these grid files, then report",
    )
    g = p.add_argument_group("grid")
    g.add_argument("--grid", action="store_true", help="run the grid (issue 24)")
    g.add_argument("--grid-concurrency", default="4,8,16,32")
    g.add_argument("--grid-host-gib", default="2,4,8")
    g.add_argument("--grid-points", default=None, help="a subset, e.g. 16x4,32x2")
    g.add_argument(
        "--grid-requests",
        default=",".join(f"{c}:{n}" for c, n in grid.DEFAULT_REQUESTS.items()),
        help="requests per concurrency (others: 10 per conversation in flight)",
    )
    g.add_argument("--skip-done", action="store_true")
    g.add_argument("--reuse-baselines", action="store_true")
    g.add_argument("--rerun", default=None, help="points run again, e.g. 16x4")
    g.add_argument("--max-minutes", type=float, default=None)
    g.add_argument(
        "--in-process",
        action="store_true",
        help="run every configuration in this process (default: each in a child process)",
    )
    g.add_argument(
        "--config-timeout",
        type=float,
        default=30.0,
        help="minutes a configuration's child process may run before it is killed",
    )
    g.add_argument(
        "--gpus",
        type=int,
        default=1,
        help="points run at once, one per GPU, each configuration at all of them together",
    )
    g.add_argument("--child-row", default=None, help=argparse.SUPPRESS)
    g.add_argument("--shares-host", action="store_true", help=argparse.SUPPRESS)
    return p


def parse_configs(p: argparse.ArgumentParser, text: str) -> list[str]:
    """``--configs``: labels, each a base of ``CONFIGS`` or a kvtier base with settings
    (``kvtier_fs+tiers.0.write=on_evict``: ``config_variants``); ``p.error`` otherwise."""
    labels = [c.strip() for c in text.split(",") if c.strip()]
    unknown = sorted({variants.base_of(c) for c in labels} - set(eng.CONFIGS))
    if unknown:
        p.error(f"unknown configs {unknown}; choose from {', '.join(eng.CONFIGS)}")
    try:
        return [variants.parse_config(c, eng.CONFIGS).label for c in labels]
    except ValueError as exc:
        p.error(str(exc))


def prepare_env() -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if args.merge:
            out = Path(args.json or GRID_JSON)
            data = grid.load(out)
            merged = grid.merge_files(data, [grid.load(Path(f)) for f in args.merge])
            print("\n".join(merged or ["nothing to merge"]))
            grid.save(out, data)
            report_grid(data, out)
            return 0
        if args.report_only:
            out = Path(args.json or (GRID_JSON if args.grid else SINGLE_JSON))
            data = grid.load(out)
            if "points" in data:
                report_grid(data, out)
            else:
                print_single(data)
            return 0
        configs = parse_configs(p, args.configs)
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        model = eng.make_model(args.model, workdir)
        defaults = eng.RUN_DEFAULTS.get(args.model, eng.RunDefaults())
        args.concurrency = args.concurrency or defaults.concurrency
        args.requests = args.requests or defaults.requests
        args.host_gib = args.host_gib or defaults.host_gib
        # The grid's 2 GiB is Llama-3.1-8B's; a hybrid model's default is sized from its pool.
        grid_gib = 2.0 if args.grid and model.pool is None else None
        settings = eng.Settings(
            turns=args.turns or (5 if args.grid else 4),
            context_blocks=args.context_blocks,
            widen=args.widen,
            max_tokens=args.max_tokens or (64 if args.grid else 32),
            max_model_len=args.max_model_len,
            gpu_kv_gib=args.gpu_kv_gib or grid_gib,
            workdir=workdir,
            gpu_kv_requests=args.gpu_kv_requests,
        )
        prepare_env()
        run = run_grid_mode if args.grid else run_single
        return run(args, settings, model, configs)
    except (grid.GridError, OSError, ValueError) as exc:
        p.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())
