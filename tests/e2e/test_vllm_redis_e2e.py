"""End to end: two vLLM engine processes share one real redis-server through kvtier's redis tier.

The first process computes and stores; the second (a new process, empty host pool) gets its
hits from redis (promotions) and its outputs equal the no-kvtier reference.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support import require
from support.redis_servers import RedisServer, binaries_missing

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.redis,
    require.unless("vllm", require.vllm_missing()),
    pytest.mark.timeout(240),
]


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    missing = binaries_missing()
    if missing:
        require.missing("redis", missing)
    srv = RedisServer(tmp_path / "redis").start()
    yield srv
    srv.kill()


def test_two_engines_share_redis(
    model_dir: Path, reference: dict[str, list[list[int]]], tmp_path: Path, redis_server: Any
) -> None:
    from e2e import vllm_harness as h
    from e2e import vllm_jobs as jobs

    tier = {"kind": "redis", "name": "shared", "url": redis_server.url(), "ttl_s": 600}
    results = []
    for i in (1, 2):
        extra = jobs.kvtier_config(tmp_path / f"stats{i}.json", tiers=[tier])
        results.append(
            h.run_in_fresh_process(
                "e2e.vllm_jobs:run_rounds", str(model_dir), extra, ["basic"], False, timeout=200
            )
        )
    first, second = results
    assert first["outputs"][0] == reference["basic"]
    assert second["outputs"][0] == reference["basic"]
    assert first["stats"]["cache"]["loaded_blocks"] == 0
    assert first["stats"]["tiers"]["shared"]["write_blocks"] >= 27, first["stats"]["tiers"]
    cache = second["stats"]["cache"]
    assert cache["promoted_blocks"] >= 27, cache
    assert cache["loaded_blocks"] >= 27, cache
    assert second["stats"]["promoted"]["shared"] >= 27, second["stats"]["promoted"]
