"""Which copy backend moves a rank's blocks: the one ``kvtier.registry.COPY_BACKENDS`` names for
the device type its KV tensors live on (``copy/<device>.py`` or ``copy/<device>/``, or one
registered for another device), built by its ``create(kv_caches, setup)``.

The engine's per-layer KV tensors are taken as they are; the backend recognises their layout (the
CUDA backend: ``copy.cuda.plan.cuda_layout``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvtier.copy.base import BackendSetup, CopyBackend
from kvtier.registry import COPY_BACKENDS

BackendFactory = Callable[[Sequence[Any], BackendSetup], CopyBackend]
"""``make_backend``'s signature: (KV tensors, setup)."""


def make_backend(kv_caches: Sequence[Any], setup: BackendSetup) -> CopyBackend:
    """The copy backend for the device the KV tensors live on: ``cls.create(kv_caches, setup)``
    (``CopyBackend.create``). ``NotImplementedError`` for a device without one."""
    if not kv_caches:
        raise ValueError("register_kv_caches gave no KV tensors")
    device = kv_caches[0].device.type
    if device not in COPY_BACKENDS:
        known = ", ".join(repr(name) for name in COPY_BACKENDS)
        raise NotImplementedError(f"kvtier has no copy backend for {device!r} KV (only {known})")
    cls: type[CopyBackend] = COPY_BACKENDS.load(device, "copy backend")
    return cls.create(kv_caches, setup)
