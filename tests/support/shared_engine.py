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
import sys
import time
from dataclasses import dataclass

from kvtier.cache.factory import build_cache
from kvtier.cache.shared import SharedTieredCache
from kvtier.config import load_config
from kvtier.keys import BlockKey, Namespace, chain_keys
from kvtier.pool import HostPool

SLOT_BYTES = 4096
BLOCK_TOKENS = 4
NAMESPACE = Namespace(model="shared-test", dtype="float16", block_tokens=BLOCK_TOKENS)


def payload(key: BlockKey, size: int = SLOT_BYTES) -> bytes:
    return (key * (size // len(key) + 1))[:size]


def prompt_keys(prompt: int, blocks: int, namespace: Namespace = NAMESPACE) -> list[BlockKey]:
    return chain_keys(namespace, [prompt * 1000 + t for t in range(blocks * BLOCK_TOKENS)])


def open_cache(
    shm_dir: str, slots: int, share: str = "test", lock_timeout_s: float = 0.1
) -> tuple[HostPool, SharedTieredCache]:
    config = load_config(
        {
            "pool": {
                "size": slots * SLOT_BYTES,
                "shm_dir": shm_dir,
                "share": share,
                "share_lock_timeout_s": lock_timeout_s,
            }
        }
    )
    pool, cache = build_cache(config, NAMESPACE, SLOT_BYTES)
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
    hits = cache.lookup(keys).hits
    slots = cache.prepare_load(keys[:hits])
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


def main() -> None:
    """``shared_engine SHM_DIR SLOTS SECONDS SEED [PROMPTS]``: serve random prompts, print a
    line saying it is running, then a JSON record of what it served."""
    shm_dir, slots, seconds, seed = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    prompts = int(sys.argv[5]) if len(sys.argv) > 5 else 24
    rng = random.Random(seed)
    pool, cache = open_cache(shm_dir, slots)
    print("running", flush=True)
    served = Served()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        serve(pool, cache, rng.randrange(prompts), rng.randint(1, 8), served, 0.0005)
    cache.close()
    pool.close()
    print(json.dumps({f: getattr(served, f) for f in Served.__slots__}), flush=True)


if __name__ == "__main__":
    main()
