"""What differs between the vLLM releases the connector supports, in one place.

Tested: 0.25.1 (the release built for PyTorch 2.11 + CUDA 13, run on an H100), 0.32 (the CPU build
CI runs) and 0.33 (API only: its hooks are unit-tested against its connector base class). The
connector refuses to start on a release outside ``[MIN_VERSION, END_VERSION)`` unless
``KVTIER_ALLOW_UNTESTED_VLLM=1``.

Where they differ:

* **KV cache layout.** 0.32 and later name physical layouts with ``KVCacheLayout`` (``BLNHC``:
  blocks outermost, ...) and let a connector ask for one. 0.25.1 only knows the page orders
  ``NHD`` / ``HND``; a block-outermost tensor (one allocation, a block's pages of all layers
  adjacent) is what it calls a cross-layer KV cache, asked for with ``prefer_cross_layer_blocks``
  and handed over with ``register_cross_layers_kv_cache``. ``vllm.kv_cache_layout`` keeps the
  0.32 names in every release; ``layout_request`` translates them.
* **Page bytes.** A 0.32 page is ``[tokens, heads, K+V]`` (or ``[heads, tokens, K+V]``); a 0.25.1
  FlashAttention page is ``[2, tokens, heads, head_size]`` (``HND``: heads before tokens). Both go
  into the namespace, so releases whose pages differ never share blocks.
* **Sleep mode** (0.33): ``unregister_kv_caches`` / ``restore_kv_caches`` around a sleep, which
  drain kvtier's copies before the KV memory is unmapped. Older releases release it without a
  word to connectors while copies may still be queued, so there kvtier refuses
  ``enable_sleep_mode`` at start.
* **Landed asynchronous loads.** 0.25.1's scheduler can stop every pass at a request that does
  not fit, in front of the requests whose loads landed and hold the blocks it needs (a stall for
  good with nothing running); 0.32 takes requests holding blocks first. Before 0.32 the
  connector defers the lookups of the requests in front of a landed load (``landed_loads``).
* Request block tables come from each step's scheduler output in every release (0.25.1 gives
  connectors no ``KVCacheManager``).
* **Prefix-cache hits by source** (``vllm:prompt_tokens_cached_by_source``): releases with
  ``vllm.v1.metrics.cache_hit_source`` ask the connector where its hits came from
  (``get_external_cache_hit_sources``); older ones never call it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import ConfigError

MIN_VERSION = (0, 25, 1)
END_VERSION = (0, 34)
"""First release not supported (exclusive)."""
ALLOW_UNTESTED_ENV = "KVTIER_ALLOW_UNTESTED_VLLM"
SLEEP_HOOKS_VERSION = (0, 33)
RELIABLE_RECOVERY_VERSION = (0, 32)
"""The first supported release where kvtier's tests saw vLLM recompute a failed load correctly
(0.32's CPU build). 0.25.1 on an H100 recomputed it into wrong tokens with both of its model
runners and with async scheduling on and off (vllm-project/vllm issue 49250)."""

HOLDING_FIRST_VERSION = (0, 32)
"""The first supported release whose scheduler is known to take in requests holding KV blocks
(landed asynchronous loads) before the others (read in 0.32's scheduler). Before it, kvtier
defers the lookups of the requests in front of a landed load (``landed_loads``)."""

LAYOUT_NAMES = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
"""``vllm.kv_cache_layout`` values besides ``engine``: vLLM 0.32's ``KVCacheLayout`` names."""
_PAGE_ORDER_0_25 = {"LBNHC": "NHD", "LBHNC": "HND", "BLNHC": "NHD", "BLHNC": "HND"}


def parse_version(text: str) -> tuple[int, ...]:
    """``0.25.1`` / ``0.33.0+cu130`` / ``0.33.1.dev4+g1a2b`` -> ``(0, 25, 1)`` / ``(0, 33, 0)``."""
    numbers: list[int] = []
    for part in text.split("+", 1)[0].split("."):
        digits = ""
        for char in part:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            break
        numbers.append(int(digits))
        if len(digits) != len(part):
            break
    if not numbers:
        raise ValueError(f"not a version: {text!r}")
    return tuple(numbers)


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def supported_range() -> str:
    return f">= {_dotted(MIN_VERSION)} and < {_dotted(END_VERSION)}"


def installed_version() -> tuple[int, ...]:
    import vllm

    return parse_version(str(vllm.__version__))


def check_version(version: tuple[int, ...]) -> None:
    """Refuse a release outside the tested range (``ConfigError`` naming it)."""
    if MIN_VERSION <= version < END_VERSION:
        return
    if os.environ.get(ALLOW_UNTESTED_ENV, "") == "1":
        return
    raise ConfigError(
        "vllm version",
        _dotted(version),
        f"a release {supported_range()} (tested: 0.25.1, 0.32, 0.33); "
        f"{ALLOW_UNTESTED_ENV}=1 starts anyway",
    )


def has_layout_names(version: tuple[int, ...]) -> bool:
    """Whether this release names layouts as ``KVCacheLayout`` (0.32 and later)."""
    return version >= (0, 32)


def check_sleep_mode(vllm_config: Any, version: tuple[int, ...]) -> None:
    """Sleep mode only where vLLM tells connectors before it releases the KV memory (0.33)."""
    enabled = bool(getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False))
    if enabled and version < SLEEP_HOOKS_VERSION:
        raise ConfigError(
            "enable_sleep_mode",
            True,
            f"False with vLLM {_dotted(version)}: kvtier follows a sleep from vLLM "
            f"{_dotted(SLEEP_HOOKS_VERSION)} on (earlier releases unmap the KV cache while its "
            "copies may still be queued)",
        )


def strands_landed_loads(version: tuple[int, ...]) -> bool:
    """Whether this release's scheduler can leave landed asynchronous loads behind a request
    that does not fit (``landed_loads``)."""
    return version < HOLDING_FIRST_VERSION


def warn_recovery(vllm_config: Any, version: tuple[int, ...]) -> str | None:
    """The warning to log where vLLM's recompute of a failed load is not trustworthy."""
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    policy = getattr(transfer, "kv_load_failure_policy", None)
    if policy != "recompute" or version >= RELIABLE_RECOVERY_VERSION:
        return None
    return (
        f"vLLM {_dotted(version)} can recompute a request whose KV load failed into wrong "
        "tokens (vllm-project/vllm issue 49250): with kv_load_failure_policy 'recompute', a "
        "kvtier copy failure (rare: a CUDA error) may change that request's output; 'fail' "
        f"fails the request instead. kvtier's tests see vLLM "
        f"{_dotted(RELIABLE_RECOVERY_VERSION)} (CPU build) recover correctly."
    )


@dataclass(frozen=True, slots=True)
class LayoutRequest:
    """What the connector asks of a vLLM release for one ``vllm.kv_cache_layout`` value."""

    layout: str | None
    """The value of ``get_required_kvcache_layout`` (None: no request)."""
    cross_layer: bool
    """Ask for one block-outermost tensor (0.25.1's ``prefer_cross_layer_blocks``)."""


def kv_events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV cache events (``--kv-events-config``): without it, the events a
    connector hands over are dropped."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(getattr(events, "enable_kv_cache_events", False))


def steps_in_flight(vllm_config: Any) -> int:
    """Steps the engine core runs at once: its batch queue, two under asynchronous scheduling
    (the CUDA builds' default in 0.25.1 and 0.32; the CPU build turns it off)."""
    return max(1, int(getattr(vllm_config, "max_concurrent_batches", 1)))


def layout_request(setting: str, version: tuple[int, ...]) -> LayoutRequest:
    if setting == "engine":
        return LayoutRequest(None, False)
    if has_layout_names(version):
        return LayoutRequest(setting, False)
    order = _PAGE_ORDER_0_25.get(setting)
    if order is None:
        raise ConfigError(
            "vllm.kv_cache_layout",
            setting,
            f"'engine' or one of {', '.join(sorted(_PAGE_ORDER_0_25))} on vLLM "
            f"{_dotted(version)} (its pages keep the heads inside; no layout puts them outside)",
        )
    return LayoutRequest(order, setting.startswith("B"))


def page_order(vllm_config: Any, asked: str | None, version: tuple[int, ...]) -> str | None:
    """The order of a page's dimensions as the engine will lay them out, for the namespace:
    ``NHC``/``HNC`` on 0.32+ (from the resolved ``KVCacheLayout``), ``2NHD``/``2HND`` on 0.25
    (K and V outermost). None where the release does not say (then the device alone names it)."""
    if has_layout_names(version):
        resolved = getattr(vllm_config.cache_config, "kv_cache_layout", None)
        if not resolved:
            return None
        return str(resolved).replace("L", "").replace("B", "")
    # 0.25: VLLM_KV_CACHE_LAYOUT wins over a connector's request; NHD is vLLM's default.
    return "2" + (os.environ.get("VLLM_KV_CACHE_LAYOUT") or asked or "NHD")


def cross_layer_views(kv_cache: Any, attn_backend: Any) -> list[Any]:
    """Per-layer views of 0.25.1's cross-layer KV tensor, in layer order: each is the layer's
    ``get_kv_cache_shape`` view (``[num_blocks, 2, ...]`` for FlashAttention) whose block stride
    spans all layers, as vLLM hands them to its attention layers."""
    try:
        order = tuple(attn_backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
    except (AttributeError, NotImplementedError):
        order = tuple(range(kv_cache.dim()))
    if sorted(order) != list(range(kv_cache.dim())):
        raise ValueError(f"stride order {order} does not permute a {kv_cache.dim()}-D KV tensor")
    logical = kv_cache.permute(*[order.index(i) for i in range(len(order))])
    return [logical[i] for i in range(logical.shape[0])]


_SOURCE_OF_KIND = {"memory": "HOST", "fs": "DISK", "redis": "EXTERNAL_UNSPECIFIED"}
"""vLLM's ``CacheHitSource`` member for each tier kind: host memory, a disk, a remote store."""


def _hit_source_enum() -> Any:
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:  # before hits by source existed
        return None
    return CacheHitSource


def hit_source_map(tiers: Sequence[Any]) -> dict[str, Any]:
    """kvtier tier name (``pool`` and each configured tier's ``name``) -> vLLM's
    ``CacheHitSource``; empty where this release has none."""
    enum = _hit_source_enum()
    if enum is None:
        return {}
    out = {"pool": enum.HOST}
    for tier in tiers:
        out[tier.name] = getattr(enum, _SOURCE_OF_KIND.get(tier.kind, "EXTERNAL_UNSPECIFIED"))
    return out


def unspecified_hit_source(tokens: int) -> dict[Any, int]:
    enum = _hit_source_enum()
    return {} if enum is None else {enum.EXTERNAL_UNSPECIFIED: tokens}
