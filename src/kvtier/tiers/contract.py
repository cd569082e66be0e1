"""What the manager accepts from a tier at run time (the ``Tier`` contract in ``tiers/base.py``).

A tier may be a plugin: its answers are checked here before the manager uses them. Each function
returns the answer in the manager's form, or None when it is malformed; the manager then counts an
error in the tier's ``counters`` and treats the answer as a miss or a failed job. Nothing here
raises, whatever object a tier hands over (an attribute or ``__eq__`` that raises, a generator, an
infinite iterator: only lists and tuples are read, never iterated past their length).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kvtier.keys import BlockKey
from kvtier.metrics import TierCounters


def lookup_flags(answer: object, n: int) -> list[bool | None] | None:
    """``lookup``'s answer for ``n`` keys: a list or tuple of ``n`` flags, each True, False or
    None (not known yet); the same list when it already is one."""
    if not isinstance(answer, list | tuple) or len(answer) != n:
        return None
    for flag in answer:
        if flag is not True and flag is not False and flag is not None:
            return None
    return answer if type(answer) is list else list(answer)


def job_flags(ok: object, n: int) -> list[bool] | None:
    """A job result's ok-list for a job of ``n`` keys: ``n`` flags, each True or False."""
    if not isinstance(ok, list | tuple) or len(ok) != n:
        return None
    for flag in ok:
        if flag is not True and flag is not False:
            return None
    return ok if type(ok) is list else list(ok)


Report = tuple[int, object, float | None]
"""A job's report: its id, its ok-list as reported, its ``busy_s`` (None unless a finite number
of seconds, not negative)."""


def job_reports(results: object) -> tuple[list[Report], int] | None:
    """``poll``'s answer as reports, plus how many results were malformed (no integer
    ``job_id``, no ``ok``) and left out; None when it is no list or tuple. A job left out is never
    settled by its tier: it times out after ``job_timeout_s``."""
    if not isinstance(results, list | tuple):
        return None
    reports: list[Report] = []
    malformed = 0
    for result in results:
        try:
            job_id, ok = result.job_id, result.ok
        except Exception:
            malformed += 1
            continue
        if type(job_id) is not int:
            malformed += 1
            continue
        busy = getattr(result, "busy_s", None)
        finite = type(busy) is float and 0.0 <= busy < math.inf
        reports.append((job_id, ok, busy if finite else None))
    return reports, malformed


def evicted_keys(evicted: object) -> Sequence[BlockKey] | None:
    """``take_evicted``'s answer: a list or tuple of keys (bytes)."""
    if not isinstance(evicted, list | tuple):
        return None
    for key in evicted:
        if type(key) is not bytes:
            return None
    return evicted


def tier_lacks(tier: object) -> str | None:
    """What a newly built tier lacks of what the manager reads of every tier (a ``name`` that is
    a string, ``counters`` that are ``TierCounters``), None when nothing: checked once, when it
    is built, so no run-time error path can fail on it."""
    try:
        name, counters = getattr(tier, "name", None), getattr(tier, "counters", None)
    except Exception:
        return "can be inspected"
    if not isinstance(name, str):
        return "has a name (did its constructor call Tier.__init__?)"
    if not isinstance(counters, TierCounters):
        return "has TierCounters as counters (did its constructor call Tier.__init__?)"
    return None
