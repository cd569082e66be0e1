"""A stand-in engine over a shared pool, for tests with real processes (``python -m`` from the
repository's ``tests`` directory, or imported).

It does what an engine's planner does through the kvtier API: look up a prompt's keys, pin and
read the hit blocks, reserve the rest, write their bytes into the pool and publish them. A block's
bytes are a function of its key (``payload``), so a reader can tell a wrong or torn block from the
right one. Writes go in chunks with a pause between them, so a SIGKILL lands mid-write as often as
not.
"""

from __future__ import annotations

import json
import random
import signal
import sys
import time
from dataclasses import dataclass

from kvtier.cache.factory import build_cache
from kvtier.cache.shared import SharedTieredCache
from kvtier.config import load_config
from kvtier.keys import BlockKey, Namespace, chain_keys
from kvtier.pool import HostPool
from kvtier.tiers.fs import files
from kvtier.tiers.payload import HEADER_BYTES

SLOT_BYTES = 4096
BLOCK_TOKENS = 4
NAMESPACE = Namespace(model="shared-test", dtype="float16", block_tokens=BLOCK_TOKENS)


def payload(key: BlockKey, size: int = SLOT_BYTES) -> bytes:
    return (key * (size // len(key) + 1))[:size]


def prompt_keys(prompt: int, blocks: int, namespace: Namespace = NAMESPACE) -> list[BlockKey]:
    return chain_keys(namespace, [prompt * 1000 + t for t in range(blocks * BLOCK_TOKENS)])


FILE_BYTES = HEADER_BYTES + SLOT_BYTES
"""Bytes of a block's file in an fs tier."""


def open_cache(
    shm_dir: str,
    slots: int,
    share: str = "test",
    lock_timeout_s: float = 0.1,
    fs_path: str | None = None,
    fs_files: int = 0,
) -> tuple[HostPool, SharedTieredCache]:
    """This engine's cache over the shared pool; with ``fs_path``, an fs tier there behind it
    (``fs_files`` block files of capacity), shared as well."""
    raw: dict[str, object] = {
        "pool": {
            "size": slots * SLOT_BYTES,
            "shm_dir": shm_dir,
            "share": share,
            "share_lock_timeout_s": lock_timeout_s,
        }
    }
    if fs_path is not None:
        raw["tiers"] = [{"kind": "fs", "path": fs_path, "capacity": fs_files * FILE_BYTES}]
    pool, cache = build_cache(load_config(raw), NAMESPACE, SLOT_BYTES)
    assert isinstance(cache, SharedTieredCache)
    return pool, cache


@dataclass(slots=True)
class Served:
    requests: int = 0
    hit_blocks: int = 0
    stored_blocks: int = 0
    wrong: int = 0
    slowest_s: float = 0.0


def serve(
    pool: HostPool,
    cache: SharedTieredCache,
    prompt: int,
    blocks: int,
    served: Served,
    chunk_pause_s: float = 0.0,
) -> None:
    """One request: load what the pool holds (checking its bytes), store the rest."""
    began = time.monotonic()
    keys = prompt_keys(prompt, blocks)
    owner = (prompt, served.requests)
    result = cache.lookup(keys, owner)
    while not result.final:  # blocks promoted from the tier: step until they landed
        time.sleep(0.001)
        cache.step()
        result = cache.lookup(keys, owner)
    hits = result.hits
    slots = cache.prepare_load(keys[:hits], owner)
    for key, slot in zip(keys, slots, strict=False):
        if bytes(pool.view(slot)) != payload(key):
            served.wrong += 1
    cache.complete_load(keys[: len(slots)])
    served.hit_blocks += len(slots)
    reservation = cache.prepare_store(keys[len(slots) :])
    for key, slot in zip(reservation.keys, reservation.slots, strict=True):
        data = payload(key)
        view = pool.view(slot)
        for at in range(0, len(data), 1024):
            view[at : at + 1024] = data[at : at + 1024]
            if chunk_pause_s:
                time.sleep(chunk_pause_s)
    cache.complete_store(reservation.keys, True)
    cache.step()
    served.stored_blocks += len(reservation.keys)
    served.requests += 1
    served.slowest_s = max(served.slowest_s, time.monotonic() - began)


_write_all = files.write_all


def _slow_write_all(fd: int, buffers: list[memoryview]) -> None:
    for buffer in buffers:
        data = buffer.cast("B")
        for at in range(0, data.nbytes, 1024):
            _write_all(fd, [data[at : at + 1024]])
            time.sleep(0.002)


def main() -> None:
    """``shared_engine SHM_DIR SLOTS SECONDS SEED [PROMPTS [FS_PATH FS_FILES]]``: serve random
    prompts, print a line saying it is running, then (after SECONDS, or at SIGTERM) a JSON
    record of what it served."""
    shm_dir, slots, seconds, seed = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    prompts = int(sys.argv[5]) if len(sys.argv) > 5 else 24
    fs_path = sys.argv[6] if len(sys.argv) > 6 else None
    fs_files = int(sys.argv[7]) if len(sys.argv) > 7 else 0
    files.write_all = _slow_write_all  # block files written in chunks: a kill lands mid-write
    rng = random.Random(seed)
    pool, cache = open_cache(shm_dir, slots, fs_path=fs_path, fs_files=fs_files)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))  # ends it early
    print("running", flush=True)
    served = Served()
    end = time.monotonic() + seconds
    while time.monotonic() < end and not stop:
        serve(pool, cache, rng.randrange(prompts), rng.randint(1, 8), served, 0.0005)
    cache.close()
    pool.close()
    print(json.dumps({f: getattr(served, f) for f in Served.__slots__}), flush=True)


if __name__ == "__main__":
    main()
