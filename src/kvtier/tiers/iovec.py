"""Scatter/gather I/O bookkeeping shared by the tiers' vectored syscalls."""

from __future__ import annotations


def advance(pending: list[memoryview], n: int) -> None:
    """Drop the first ``n`` bytes of ``pending`` (byte views a ``writev``/``readv``/``sendmsg``
    moved in part): whole views are removed, a partly moved one is cut to its rest."""
    while pending and n >= pending[0].nbytes:
        n -= pending[0].nbytes
        pending.pop(0)
    if n:
        pending[0] = pending[0][n:]
