"""The emulated half of the scheduler replay (``scheduler_replay.py``): a simulated clock for the
engine's CPU thread, the GPU and its two copy engines, a cost model fitted to the H100 grid, the
connectors' workers (kvtier's and vLLM's ``OffloadingConnector``'s) acting on their scheduler
halves' real metadata, and vLLM's engine loop with its batch queue of two
(``EngineCore.step_with_batch_queue`` with async scheduling, as ``LLM`` runs it in-process).

Everything the scheduler decides is vLLM's and the connector's own code; only time is emulated.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import scheduler_replay_vllm as rv

STALL_MS = 600_000.0
"""No request finished in this much simulated time: the replay stops (a request waiting for a
load that is never reported would otherwise keep the loop stepping forever)."""
BLOCK_BYTES = 2 << 20
"""A Llama-3.1-8B block of 16 tokens, bf16, all 32 layers: what the real copy engines move."""
WAIT_KINDS = ("first_waiting", "behind", "async_or_skipped")
"""Where a request not yet scheduled waits (``EngineLoop.request_waits``): first of the WAITING
requests in vLLM's queue (not scheduled: at the grid's points its blocks do not fit the free GPU
blocks), behind such a request, or in ``skipped_waiting`` (an asynchronous load in flight, a
deferred lookup)."""


@dataclass(slots=True)
class Cost:
    """Milliseconds of the emulated machine (fitted to the H100 grid's measured rows)."""

    base_ms: float = 7.0
    """A forward pass's fixed cost."""
    token_ms: float = 0.0206
    """Per prefill token, at no context."""
    attn_tokens: float = 12800.0
    """A prefill token costs ``1 + context / attn_tokens`` times ``token_ms``."""
    decode_ms: float = 0.05
    """Per decoding request."""
    h2d_gbps: float = 45.0
    d2h_gbps: float = 45.0
    schedule_ms: float = 0.8
    update_ms: float = 0.4
    launch_ms: float = 0.8
    """The CPU's time to launch a step (and the GPU's earliest start after it)."""
    driver_ms: float = 0.2
    """The benchmark's loop per engine step."""
    token_copy_ms: float = 0.2
    """The sampled tokens' copy back after a forward pass."""
    load_gate: bool = True
    """kvtier's loads start after the GPU work queued before them (its CUDA backend copies on a
    stream that waits for the engine's)."""

    def block_ms(self, gbps: float) -> float:
        return BLOCK_BYTES / (gbps * 1e9) * 1e3

    def forward_ms(self, prefills: list[tuple[int, int]], decodes: int) -> float:
        """A step of ``prefills`` (tokens, context before them) and ``decodes`` requests."""
        t = self.base_ms + self.decode_ms * decodes
        for n, ctx in prefills:
            t += self.token_ms * n * (1 + (ctx + n / 2) / self.attn_tokens)
        return t


def field_settings(text: str, record: type, flag: str) -> Iterator[tuple[str, str, str]]:
    """The ``FIELD=VALUE`` items of ``text`` (comma-separated) that name fields of the dataclass
    ``record``, as (item, field, value); ``ValueError`` naming ``flag`` for any other."""
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in record.__dataclass_fields__:
            raise ValueError(f"{flag} {item!r}: expected FIELD=NUMBER, fields of {record.__name__}")
        yield item, name, value


def parse_cost(text: str) -> Cost:
    """``base_ms=7,load_gate=0``: a ``Cost`` with those fields changed."""
    cost = Cost()
    for _, name, value in field_settings(text, Cost, "--cost"):
        setattr(cost, name, value not in ("0", "false") if name == "load_gate" else float(value))
    return cost


@dataclass(slots=True)
class Job:
    end: float
    job_id: int
    request_id: str | None
    """An asynchronous load's request (reported in ``finished_recving`` when it ends)."""


@dataclass(slots=True)
class Machine:
    """The clock: the engine's CPU thread, the GPU's queue and the copy engines."""

    cost: Cost
    cpu: float = 0.0
    gpu_free: float = 0.0
    h2d_free: float = 0.0
    d2h_free: float = 0.0
    last_gpu_end: float = 0.0
    jobs: list[Job] = field(default_factory=list)
    steps: int = 0
    sync_wait_ms: float = 0.0
    """CPU time spent waiting for synchronous loads."""

    def load(self, job_id: int, blocks: int, request_id: str | None, gated: bool) -> float:
        start = max(self.cpu, self.h2d_free, self.gpu_free if gated else 0.0)
        self.h2d_free = start + blocks * self.cost.block_ms(self.cost.h2d_gbps)
        self.jobs.append(Job(self.h2d_free, job_id, request_id))
        return self.h2d_free

    def store(self, job_id: int, blocks: int, after: float) -> None:
        start = max(after, self.d2h_free)
        self.d2h_free = start + blocks * self.cost.block_ms(self.cost.d2h_gbps)
        self.jobs.append(Job(self.d2h_free, job_id, None))

    def wait_until(self, t: float) -> None:
        if t > self.cpu:
            self.sync_wait_ms += t - self.cpu
            self.cpu = t

    def ended(self) -> list[Job]:
        """Jobs ended by now, removed."""
        done = [j for j in self.jobs if j.end <= self.cpu]
        if done:
            self.jobs = [j for j in self.jobs if j.end > self.cpu]
        return done


class KvtierWorker:
    """kvtier's worker: loads before the forward pass (a synchronous load's step waits for it),
    stores after it, every job reported once ended."""

    def __init__(self, machine: Machine) -> None:
        self.m = machine

    def before_forward(self, meta: Any) -> None:
        sync_end = self.m.cpu
        for order in meta.loads:
            blocks = sum(1 for b in order.engine_blocks if b >= 0)
            end = self.m.load(order.job_id, blocks, order.request_id, self.m.cost.load_gate)
            if order.request_id is None:
                sync_end = max(sync_end, end)
        self.m.wait_until(sync_end)

    def after_forward(self, meta: Any) -> None:
        for order in meta.stores:
            self.m.store(order.job_id, len(order.engine_blocks), self.m.last_gpu_end)

    def report(self, done: list[Job]) -> Any:
        return rv.kvtier_worker_meta([j.job_id for j in done])


class NativeWorker:
    """vLLM's ``OffloadingConnector`` worker: a step's stores are submitted at the start of the
    next step (after its sampled tokens' copy), loads are asynchronous, ``jobs_to_flush`` makes
    the step wait for those stores."""

    def __init__(self, machine: Machine, submits_flushed: bool) -> None:
        self.m = machine
        self.submits_flushed = submits_flushed
        """vLLM 0.32 submits the step's stores named in ``jobs_to_flush`` at once (0.25.1 waits
        only for those submitted before)."""
        self.deferred: list[tuple[int, int]] = []
        self._flushed: set[int] = set()

    def before_forward(self, meta: Any) -> None:
        flush = meta.jobs_to_flush or set()
        for job_id in flush if self.submits_flushed else ():
            job = meta.store_jobs.get(job_id)
            if job is not None:
                self.deferred.append((job_id, len(job.src_spec.block_ids)))
        for job_id, blocks in self.deferred:
            self.m.store(job_id, blocks, self.m.last_gpu_end)
        submitted = {job_id for job_id, _ in self.deferred}
        self.deferred = []
        if flush:
            pending = [j.end for j in self.m.jobs if j.job_id in flush]
            self.m.wait_until(max(pending, default=self.m.cpu))
        for job_id, job in meta.load_jobs.items():
            self.m.load(job_id, len(job.dst_spec.block_ids), job.req_id, gated=False)
        self._flushed = submitted & flush

    def after_forward(self, meta: Any) -> None:
        for job_id, job in meta.store_jobs.items():
            if job_id not in self._flushed:
                self.deferred.append((job_id, len(job.src_spec.block_ids)))

    def report(self, done: list[Job]) -> Any:
        return rv.native_worker_meta([j.job_id for j in done])


Worker = KvtierWorker | NativeWorker


def make_worker(kind: str, machine: Machine, version: str) -> Worker | None:
    if kind == "kvtier":
        return KvtierWorker(machine)
    if kind == "native":
        major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
        return NativeWorker(machine, submits_flushed=major_minor >= (0, 32))
    return None


class EngineLoop:
    """vLLM's ``EngineCore.step_with_batch_queue`` (a queue of two) on the emulated machine: a
    step is scheduled while the previous one runs, and its outputs are taken only when the queue
    is full or nothing else can be scheduled."""

    def __init__(self, engine: rv.Engine, machine: Machine, worker: Worker | None) -> None:
        self.engine = engine
        self.m = machine
        self.worker = worker
        self.queue: deque[tuple[float, Any, Any]] = deque()
        self.request_waits: dict[str, dict[str, float]] = {}
        """Milliseconds each request spent waiting, by ``WAIT_KINDS``."""
        self._waiting: dict[str, str] = {}
        self._since = 0.0

    def _account_waits(self, scheduled: Any) -> None:
        """Adds the time since the last step to each request that step left waiting, and notes
        where the requests this step leaves unscheduled wait (``WAIT_KINDS``)."""
        now, sched = self.m.cpu, self.engine.scheduler
        for req_id, kind in self._waiting.items():
            mine = self.request_waits.setdefault(req_id, dict.fromkeys(WAIT_KINDS, 0.0))
            mine[kind] += now - self._since
        self._since = now
        where: dict[str, str] = {}
        first = "first_waiting"
        for req in sched.waiting:
            if req.status.name != "WAITING":
                where[req.request_id] = "async_or_skipped"
            else:
                where[req.request_id], first = first, "behind"
        for req in getattr(sched, "skipped_waiting", ()):
            where[req.request_id] = "async_or_skipped"
        for req_id in scheduled:
            where.pop(req_id, None)
        self._waiting = where

    def _execute(self, so: Any) -> tuple[float, Any]:
        """The worker's and the GPU's part of a step; when its outputs are ready, and them."""
        m, c = self.m, self.m.cost
        meta = so.kv_connector_metadata
        worker = self.worker if meta is not None else None
        if worker is not None:
            worker.before_forward(meta)
        prefills: list[tuple[int, int]] = []
        decodes = 0
        produced: set[str] = set()
        requests = self.engine.scheduler.requests
        for req_id, n in so.num_scheduled_tokens.items():
            req = requests[req_id]
            if n > 1 or req.num_output_tokens == 0:
                # The scheduler has already counted this step's tokens as computed.
                prefills.append((n, req.num_computed_tokens - n))
            else:
                decodes += 1
            if not req.is_prefill_chunk:
                produced.add(req_id)
        ready = m.cpu
        if so.total_num_scheduled_tokens > 0:
            start = max(m.gpu_free, m.cpu + c.launch_ms)
            m.gpu_free = m.last_gpu_end = start + c.forward_ms(prefills, decodes)
            ready = m.gpu_free + c.token_copy_ms
            m.steps += 1
        if worker is not None:
            worker.after_forward(meta)
        m.cpu += c.launch_ms
        done = m.ended()
        finished = {j.request_id for j in done if j.request_id is not None}
        worker_meta = worker.report(done) if worker is not None else None
        output = rv.runner_output(list(so.num_scheduled_tokens), produced, finished, worker_meta)
        return ready, output

    def step(self) -> Any:
        """One call of the engine's step function: the outputs of a finished step, or None."""
        sched, m = self.engine.scheduler, self.m
        if sched.has_requests():
            so = sched.schedule()
            self._account_waits(so.num_scheduled_tokens)
            m.cpu += m.cost.schedule_ms
            ready, output = self._execute(so)
            self.queue.appendleft((ready, output, so))
            executed = so.total_num_scheduled_tokens > 0
            if len(self.queue) < 2 and (executed or sched.has_requests()):
                return None
        elif not self.queue:
            return None
        ready, output, so = self.queue.pop()
        m.cpu = max(m.cpu, ready)
        outputs = sched.update_from_output(so, output)
        m.cpu += m.cost.update_ms
        return outputs.get(0)

    @property
    def busy(self) -> bool:
        return bool(self.queue) or self.engine.scheduler.has_requests()


@dataclass(frozen=True, slots=True)
class Served:
    """A request as the benchmark records it."""

    request_id: str
    ttft_ms: float
    prompt: int
    cached: int
    """Prompt tokens vLLM did not compute (its own prefix cache and the connector's)."""
    external: int
    """Of those, the connector's."""


@dataclass(slots=True)
class Replayed:
    served: list[Served]
    wall_s: float
    steps: int
    sync_wait_ms: float
    output_tokens: int
    held: int = 0
    """Requests held back (``replay``'s ``hold``)."""
    request_waits: dict[str, dict[str, float]] = field(default_factory=dict)
    """``EngineLoop.request_waits``."""

    @property
    def waits_ms(self) -> dict[str, float]:
        """Milliseconds requests spent waiting, summed over requests, by ``WAIT_KINDS``."""
        return {k: sum(w[k] for w in self.request_waits.values()) for k in WAIT_KINDS}


def warm_up(loop: EngineLoop, prompts: list[list[int]], again: list[int], tokens: int) -> None:
    """The benchmark's warm-up (``vllm_bench_engine.warmup``): ``prompts`` at once, then vLLM's
    prefix cache reset, ``again``, and another reset; the connectors keep what they stored. The
    clock runs on; the waits recorded so far are dropped."""
    engine, m = loop.engine, loop.m
    params = rv.sampling_params(tokens)
    for batch, tag in ((prompts, "a"), ([again], "b")):
        for i, prompt in enumerate(batch):
            request = rv.make_request(engine, f"warmup-{tag}{i}", prompt, params, m.cpu)
            engine.scheduler.add_request(request)
        while loop.busy:
            loop.step()
            m.cpu += m.cost.driver_ms
        if not engine.scheduler.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after the warm-up")
    loop.request_waits.clear()


def replay(
    loop: EngineLoop,
    convs: list[Any],
    concurrency: int,
    max_tokens: int,
    hold: tuple[int, float] | None = None,
) -> Replayed:
    """Keep ``concurrency`` conversations in flight, as ``vllm_gpu_bench.drive`` does: a
    conversation's next turn is sent when its previous one ends.

    ``hold`` = (every, ms): every ``every``-th request sent, when it is a later turn, reaches vLLM
    ``ms`` later (its TTFT counts from when it was sent; it holds no GPU block meanwhile), as a
    slow tier read before the engine allocates would keep it (what vLLM's fs tiering's stalls
    look like in the H100 grid)."""
    engine, m = loop.engine, loop.m
    began, steps, sync_wait_ms = m.cpu, m.steps, m.sync_wait_ms  # after a warm-up
    held: list[tuple[float, Any]] = []
    sent_count = [0, 0]  # requests sent, of them held
    params = rv.sampling_params(max_tokens)
    pending = deque(convs)
    active: dict[str, tuple[Any, float, int]] = {}
    first: dict[str, float] = {}
    cached: dict[str, tuple[int, int]] = {}
    served: list[Served] = []

    def submit(conv: Any) -> None:
        req_id, tokens = conv.next_request()
        active[req_id] = (conv, m.cpu, len(tokens))
        request = rv.make_request(engine, req_id, tokens, params, m.cpu)
        sent_count[0] += 1
        if hold is not None and sent_count[0] % hold[0] == 0 and not req_id.endswith(".t1"):
            sent_count[1] += 1
            held.append((m.cpu + hold[1], request))
        else:
            engine.scheduler.add_request(request)

    while pending and len(active) < concurrency:
        submit(pending.popleft())
    progress_at = m.cpu
    while active:
        if held and not loop.busy:
            m.cpu = max(m.cpu, min(due for due, _ in held))
        for item in [h for h in held if h[0] <= m.cpu]:
            held.remove(item)
            engine.scheduler.add_request(item[1])
        outputs = loop.step()
        m.cpu += m.cost.driver_ms
        if m.cpu - progress_at > STALL_MS:
            raise RuntimeError(
                f"replay stalled: no request finished in {STALL_MS / 1e3:g} simulated s "
                f"(waiting: {sorted(active)})"
            )
        for out in outputs.outputs if outputs is not None else ():
            req_id = out.request_id
            if req_id not in active:
                continue
            if out.prefill_stats is not None:
                ps = out.prefill_stats
                local, external = ps.num_local_cached_tokens, ps.num_external_cached_tokens
                cached[req_id] = (local + external, external)
            if out.new_token_ids:
                first.setdefault(req_id, m.cpu)
            if out.finish_reason is None:
                continue
            conv, sent, prompt = active.pop(req_id)
            progress_at = m.cpu
            hit, external = cached.get(req_id, (0, 0))
            ttft = first.get(req_id, m.cpu) - sent
            served.append(Served(req_id, round(ttft, 2), prompt, hit, external))
            if conv.turns:
                submit(conv)
            elif pending:
                submit(pending.popleft())
    return Replayed(
        served,
        (m.cpu - began) / 1e3,
        m.steps - steps,
        m.sync_wait_ms - sync_wait_ms,
        len(served) * max_tokens,
        sent_count[1],
        loop.request_waits,
    )
