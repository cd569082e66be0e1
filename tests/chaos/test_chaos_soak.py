"""The chaos soak: the manager with an fs tier and a Redis tier replays the bundled trace while
real faults are injected, and every promise is checked.

Faults (seeded, ``KVTIER_CHAOS_SEED``; length ``KVTIER_CHAOS_S`` seconds, 120 by default): a second
writer process on the shared fs directory killed with SIGKILL mid-write and restarted; the Redis
server killed and restarted, and stopped with SIGSTOP; Redis traffic slowed, trickled a byte at a
time and cut; kvtier keys in Redis overwritten with garbage and with values of the wrong type;
block files corrupted, truncated, swapped and replaced by FIFOs and symlinks; the fs tier's
filesystem filled to the last byte (a size-limited tmpfs, which needs root; without it that fault
is reported as not injected).

Asserted: no wrong payload is ever loaded, every manager call returns within ``MAX_CALL_S``, the
replay never hangs, pool and fs bounds hold throughout, no pin or slot leaks once the faults stop,
and the counters add up. The test prints what it injected; ``KVTIER_CHAOS_REPORT`` names a JSON file
to write the same report to.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import random
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest
from support import require
from support.redis_servers import RedisServer, binaries_missing

from chaos.faults import (
    ChaosProxy,
    DiskFiller,
    FileFault,
    ProxyMode,
    WriterProcess,
    inject_file_fault,
)
from kvtier.cache.manager import TierBinding, TieredCache
from kvtier.config import load_config
from kvtier.keys import BlockKey, keys_from_hashes
from kvtier.policies import LRUPolicy
from kvtier.pool import HostPool
from kvtier.sim.replay import payload_for
from kvtier.sim.simulate import simulation_namespace
from kvtier.sim.trace import bundled_trace_path, read_trace
from kvtier.tiers.base import WriteMode
from kvtier.tiers.fs.tier import FsTier
from kvtier.tiers.redis.tier import RedisTier

pytestmark = pytest.mark.redis

SOAK_S = float(os.environ.get("KVTIER_CHAOS_S", "120"))
SEED = int(os.environ.get("KVTIER_CHAOS_SEED", "20261124"))
MAX_CALL_S = 0.5
"""No manager call may take longer, whatever the tiers do (they never wait on I/O)."""
CLOSE_BOUND_S = 15.0
JOB_TIMEOUT_S = 2.0
SLOT_BYTES = 4 * 1024
POOL_SLOTS = 192
FS_CAPACITY = 16 * 1024 * 1024
TMPFS_BYTES = 40 * 1024 * 1024
"""Room for this process's fs capacity, the writer's and some more; the filler takes the rest."""
REDIS_MAXMEMORY = "8mb"

T = TypeVar("T")


@dataclass(slots=True)
class Report:
    seed: int
    seconds: float
    requests: int = 0
    looked_up_blocks: int = 0
    loaded_blocks: int = 0
    wrong_payloads: int = 0
    hangs: int = 0
    """Lookups still pending after the deadline the engine adapter would give them."""
    manager_calls: int = 0
    max_call_s: float = 0.0
    max_call: str = ""
    close_s: float = 0.0
    max_fs_used: int = 0
    """The most bytes the fs tier counted as used (its bound: ``FS_CAPACITY``)."""
    faults: Counter[str] = field(default_factory=Counter)
    not_injected: list[str] = field(default_factory=list)
    tiers: dict[str, dict[str, int]] = field(default_factory=dict)

    def print(self) -> None:
        print(f"\nchaos soak: seed {self.seed}, {self.seconds:.0f} s, {self.requests} requests")
        print(f"  faults injected: {sum(self.faults.values())}")
        for name, count in sorted(self.faults.items()):
            print(f"    {count:6d}  {name}")
        for name in self.not_injected:
            print(f"    not injected: {name}")
        print(
            f"  blocks looked up {self.looked_up_blocks}, loaded {self.loaded_blocks}, "
            f"wrong payloads {self.wrong_payloads}, hangs {self.hangs}"
        )
        print(
            f"  manager calls {self.manager_calls}, slowest {self.max_call_s * 1000:.1f} ms "
            f"({self.max_call}), close {self.close_s:.2f} s, fs used at most {self.max_fs_used}"
        )
        for name, counters in self.tiers.items():
            summary = ", ".join(f"{k} {v}" for k, v in counters.items() if v)
            print(f"  tier {name}: {summary}")


class TimedCache:
    """Times every manager call the replay makes."""

    def __init__(self, cache: TieredCache, report: Report) -> None:
        self.cache = cache
        self.report = report

    def call(self, name: str, fn: Callable[[], T]) -> T:
        start = time.perf_counter()
        try:
            return fn()
        finally:
            spent = time.perf_counter() - start
            r = self.report
            r.manager_calls += 1
            if spent > r.max_call_s:
                r.max_call_s, r.max_call = spent, name


@contextlib.contextmanager
def small_filesystem(path: Path, size: int) -> Iterator[bool]:
    """A tmpfs of ``size`` bytes mounted at ``path``; yields False (a plain directory) where
    mounting is not allowed."""
    path.mkdir(parents=True)
    mounted = (
        os.geteuid() == 0
        and subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


class Injector:
    """Injects one random fault at a time from its own thread, and undoes the lasting ones."""

    def __init__(
        self,
        rng: random.Random,
        report: Report,
        server: RedisServer,
        proxy: ChaosProxy,
        writer: WriterProcess,
        fs_root: Path,
        filler: DiskFiller | None,
        outside: Path,
        redis_keys: Callable[[], list[bytes]],
        upcoming_files: Callable[[], list[Path]],
    ) -> None:
        self.rng = rng
        self.report = report
        self.server = server
        self.proxy = proxy
        self.writer = writer
        self.fs_root = fs_root
        self.filler = filler
        self.outside = outside
        self.redis_keys = redis_keys
        self.upcoming_files = upcoming_files
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="chaos-injector", daemon=True)
        if filler is None:
            report.not_injected.append("disk full (needs root to mount a small tmpfs)")

    def start(self) -> None:
        self._thread.start()

    def finish(self) -> None:
        self.stop.set()
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the fault injector hung"
        self._heal()
        if self.error is not None:
            raise self.error

    def _count(self, name: str) -> None:
        self.report.faults[name] += 1

    def _run(self) -> None:
        try:
            self.writer.start(self.rng.randrange(1 << 30))
            while not self.stop.wait(self.rng.uniform(0.05, 0.4)):
                self._one()
        except BaseException as exc:  # surfaced by finish()
            self.error = exc

    def _hold(self, low: float, high: float) -> None:
        self.stop.wait(self.rng.uniform(low, high))

    def _one(self) -> None:
        rng = self.rng
        choice = rng.random()
        if choice < 0.45:
            fault = rng.choice(list(FileFault))
            wanted = self.upcoming_files()
            if inject_file_fault(self.fs_root, fault, rng, self.outside, wanted):
                self._count(f"fs: {fault.value}")
        elif choice < 0.55:
            if self.writer.running:
                self._hold(0.0, 0.5)
                self.writer.kill()
                self._count("fs: kill -9 of the writer process")
            self.writer.start(rng.randrange(1 << 30))
        elif choice < 0.62:
            self._redis_value_fault()
        elif choice < 0.70:
            self.server.kill()
            self._count("redis: server killed (SIGKILL)")
            self._hold(0.2, 1.5)
            self.server.restart()
        elif choice < 0.78:
            self.server.pause()
            self._count("redis: server stopped (SIGSTOP)")
            self._hold(0.5, 3.0)
            self.server.resume()
        elif choice < 0.86:
            mode = rng.choice([ProxyMode.SLOW, ProxyMode.TRICKLE])
            self.proxy.mode = mode
            self._count(f"redis: network {mode.value}")
            self._hold(0.5, 3.0)
            self.proxy.mode = ProxyMode.PASS
        elif choice < 0.92:
            if self.proxy.reset():
                self._count("redis: connections cut")
        elif self.filler is not None:
            self.filler.fill()
            self._count("fs: filesystem filled")
            self._hold(0.5, 3.0)
            self.filler.release()

    def _redis_value_fault(self) -> None:
        try:
            keys = self.redis_keys()
        except Exception:  # the server may be down or stopped right now: no fault this time
            return
        if not keys:
            return
        key = self.rng.choice(keys)
        client = self.server.client()
        try:
            kind = self.rng.choice(["garbage", "list", "truncate"])
            if kind == "garbage":
                client.set(key, os.urandom(self.rng.randrange(1, 200)))
            elif kind == "list":
                client.delete(key)
                client.rpush(key, b"not a block")
            else:
                value = client.get(key)
                if not isinstance(value, bytes) or len(value) < 2:
                    return
                client.set(key, value[: self.rng.randrange(len(value))])
            self._count(f"redis: value replaced ({kind})")
        except Exception:  # the server may be down or stopped right now: no fault this time
            return
        finally:
            client.close()

    def _heal(self) -> None:
        self.proxy.mode = ProxyMode.PASS
        with contextlib.suppress(Exception):
            self.server.resume()
        if not self.server_alive():
            self.server.restart()
        if self.filler is not None:
            self.filler.release()
        if self.writer.running:
            self.writer.kill()

    def server_alive(self) -> bool:
        process = self.server.process
        return process is not None and process.poll() is None


def test_chaos_soak(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    reason = binaries_missing()
    if reason is not None:
        require.missing("redis", reason)
    rng = random.Random(SEED)
    report = Report(SEED, SOAK_S)
    requests = read_trace(bundled_trace_path())
    redis_config = [f"maxmemory {REDIS_MAXMEMORY}", "maxmemory-policy allkeys-lru"]
    # Stopped after the test, also one that failed (a redis-server outlived a soak whose fault
    # injector raised).
    server = RedisServer(tmp_path / "redis", redis_config).start()
    request.addfinalizer(server.stop)
    proxy = ChaosProxy(server.port)
    request.addfinalizer(proxy.close)
    outside = tmp_path / "outside.kvb"
    outside.write_bytes(os.urandom(SLOT_BYTES + 64))
    with small_filesystem(tmp_path / "disk", TMPFS_BYTES) as mounted:
        fs_path = tmp_path / "disk" / "fs"
        config = load_config(
            {
                "model": "chaos",
                "pool": {"size": POOL_SLOTS * SLOT_BYTES, "shm_dir": str(tmp_path / "shm")},
                "block": {"tokens": 512, "bytes": SLOT_BYTES},
                "job_timeout_s": JOB_TIMEOUT_S,
                "tiers": [
                    {"kind": "fs", "path": str(fs_path), "capacity": FS_CAPACITY},
                    {
                        "kind": "redis",
                        "url": proxy.url(),
                        "write": "on_evict",
                        "timeout_s": 0.5,
                        "health_interval_s": 0.2,
                    },
                ],
            }
        )
        (tmp_path / "shm").mkdir()
        namespace = simulation_namespace(config)
        ids = sorted({h for r in requests for h in r.hash_ids})
        key_of = dict(zip(ids, keys_from_hashes(namespace, ids), strict=True))
        writer = WriterProcess(fs_path, "chaos", SLOT_BYTES, FS_CAPACITY // 2, ids[:3000])
        pool = HostPool.create(POOL_SLOTS, SLOT_BYTES, str(tmp_path / "shm"))
        fs_options, redis_options = (t.options for t in config.tiers)
        fs_tier = FsTier("fs", namespace, pool, fs_options)
        redis_tier = RedisTier("redis", namespace, pool, redis_options)
        cache = TieredCache(
            pool,
            LRUPolicy(),
            [TierBinding(fs_tier), TierBinding(redis_tier, WriteMode.ON_EVICT)],
            job_timeout_s=JOB_TIMEOUT_S,
        )
        prefix = f"kvtier:{namespace.hex}:".encode()
        position = [0]  # the replay's next request, read by the injector's thread

        def upcoming_keys() -> list[BlockKey]:
            start = position[0] % len(requests)
            return list({key_of[h] for r in requests[start : start + 40] for h in r.hash_ids})

        def redis_keys() -> list[bytes]:
            """Names of upcoming blocks that Redis holds (the faults worth injecting)."""
            names = [prefix + key.hex().encode() for key in upcoming_keys()]
            with server.client() as client:
                present = client.pipeline(transaction=False)
                for name in names:
                    present.exists(name)
                return [n for n, found in zip(names, present.execute(), strict=True) if found]

        def upcoming_files() -> list[Path]:
            root = fs_path / namespace.hex
            return [root / key.hex()[:2] / f"{key.hex()}.kvb" for key in upcoming_keys()]

        injector = Injector(
            rng,
            report,
            server,
            proxy,
            writer,
            fs_path / namespace.hex,
            DiskFiller(tmp_path / "disk") if mounted else None,
            outside,
            redis_keys,
            upcoming_files,
        )
        timed = TimedCache(cache, report)
        # In a full test run this process also holds every module pytest collected (torch and
        # vLLM among them): a full garbage collection of that heap stalls whatever call it lands
        # in for hundreds of ms (seen: 401 ms in one prepare_store). Long-lived objects are
        # frozen, as a serving process would do after start-up, so the bound measures kvtier.
        gc.freeze()
        try:
            injector.start()
            deadline = time.monotonic() + SOAK_S
            next_rescan = time.monotonic() + 1.0
            i = 0
            while time.monotonic() < deadline:
                keys = [key_of[h] for h in requests[i % len(requests)].hash_ids]
                i += 1
                position[0] = i
                replay_one(timed, pool, keys, report)
                report.max_fs_used = max(report.max_fs_used, fs_tier.used_bytes)
                if time.monotonic() >= next_rescan:
                    # Pick up the writer's files: the path a shared directory takes.
                    fs_tier.rescan()
                    next_rescan = time.monotonic() + 1.0
        finally:
            gc.unfreeze()
            injector.finish()
        drain(timed, report)
        check_settled(cache, pool)
        start = time.monotonic()
        cache.close()
        report.close_s = time.monotonic() - start
        stats = cache.stats()
        report.tiers = {name: asdict(c) for name, c in stats.tiers.items()}
        pool.close()
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():  # shown under -q too
        report.print()
    if os.environ.get("KVTIER_CHAOS_REPORT"):
        Path(os.environ["KVTIER_CHAOS_REPORT"]).write_text(json.dumps(asdict(report), indent=2))

    assert report.wrong_payloads == 0
    assert report.hangs == 0
    assert report.max_call_s < MAX_CALL_S, (report.max_call, report.max_call_s)
    assert report.close_s < CLOSE_BOUND_S
    assert report.max_fs_used <= FS_CAPACITY
    # A fault starts every 0.05-0.4 s unless the last one still lasts (up to 3 s): at least one
    # per 3 s, and every kind of fault that can be injected in a soak this long at least once.
    assert sum(report.faults.values()) >= SOAK_S / 3
    if SOAK_S >= 60:
        assert len(report.faults) >= 12, sorted(report.faults)
    # The counters add up: every block the replay loaded was counted once by the manager.
    assert stats.cache.loaded_blocks + stats.cache.load_failed == report.loaded_blocks
    assert stats.cache.hit_blocks >= report.loaded_blocks
    assert stats.cache.lookup_blocks >= stats.cache.hit_blocks
    assert report.loaded_blocks > 0
    # Both tiers met their failure paths under the faults: the soak exercised what it claims. (A
    # Redis fault that lands while no batch is in flight shows as refusals while the tier is
    # unhealthy, not as errors, so every failure counter counts.)
    for name in ("fs", "redis"):
        c = stats.tiers[name]
        assert c.corrupt + c.errors + c.timeouts + c.rejected > 0, (name, c)


def replay_one(timed: TimedCache, pool: HostPool, keys: list[BlockKey], report: Report) -> None:
    """One request as an engine adapter makes it: lookup (asking again while pending, for at
    most twice the job timeout), load the hit run and check every payload, store all."""
    cache = timed.cache
    report.requests += 1
    report.looked_up_blocks += len(keys)
    found = timed.call("lookup", lambda: cache.lookup(keys))
    give_up = time.monotonic() + 2 * JOB_TIMEOUT_S + 1.0
    while not found.final:
        if time.monotonic() > give_up:
            report.hangs += 1
            break
        timed.call("step", cache.step)
        time.sleep(0.002)
        found = timed.call("lookup", lambda: cache.lookup(keys))
    if found.hits:
        hit = keys[: found.hits]
        slots = timed.call("prepare_load", lambda: cache.prepare_load(hit))
        size = pool.slot_bytes
        wrong = sum(
            pool.view(slot) != payload_for(key, size) for key, slot in zip(hit, slots, strict=False)
        )
        report.wrong_payloads += wrong
        report.loaded_blocks += len(slots)
        timed.call("complete_load", lambda: cache.complete_load(hit[: len(slots)], ok=True))
    reservation = timed.call("prepare_store", lambda: cache.prepare_store(keys))
    for key, slot in zip(reservation.keys, reservation.slots, strict=True):
        pool.view(slot)[:] = payload_for(key, pool.slot_bytes)
    timed.call("complete_store", lambda: cache.complete_store(reservation.keys, ok=True))
    timed.call("step", cache.step)
    timed.call("take_events", cache.take_events)


def drain(timed: TimedCache, report: Report) -> None:
    """Once the faults stopped, every tier job ends (or times out) within a bound."""
    cache = timed.cache
    deadline = time.monotonic() + 4 * JOB_TIMEOUT_S + 5.0
    while cache.jobs_in_flight and time.monotonic() < deadline:
        timed.call("step", cache.step)
        time.sleep(0.01)
    assert cache.jobs_in_flight == 0, f"{cache.jobs_in_flight} tier jobs never ended"


def check_settled(cache: TieredCache, pool: HostPool) -> None:
    """No pin, load or held slot survives its job; every used slot belongs to a visible key."""
    stats = cache.stats()
    assert stats.pool_pinned == 0
    assert stats.pool_used <= stats.pool_slots
    cache.check_invariants(settled=True)
