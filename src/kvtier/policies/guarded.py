"""The run-time boundary around an eviction policy from outside kvtier (``make_policy`` wraps every
plugin policy in ``GuardedPolicy``; kvtier's own policies run unwrapped, on the hot path).

The manager and the fs and memory tiers trust their policy's answers: a victim must be a key they
hold and not pinned, ``coldest`` must name keys. A plugin may raise or answer anything, so the
guard keeps its own record of the keys it was told about (in insertion order, with hits moved to
the end: an LRU order) and hands on only answers that fit it:

* an exception from any method is counted in ``errors`` (the first one logged with its traceback)
  and the call goes on as if the policy were not there;
* ``evict`` passes on only tracked, unpinned keys, each once, at most ``n``; a tracked key it
  gives up but cannot use (pinned, one too many) is handed back with ``insert``. When the policy
  offers fewer than ``n`` usable victims while unpinned keys remain (it raised, answered
  nonsense, or lost track of keys), the guard's own LRU order makes up the rest, and those keys
  are removed from the policy: a broken policy costs hit ratio, never the pool's use;
* ``coldest`` passes on only tracked keys, at most ``n`` (the guard's order when it fails);
* ``len`` is the guard's count, whatever the policy says.

``SystemExit`` and ``KeyboardInterrupt`` are not caught: a plugin that asks the process to stop at
run time is obeyed.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Container, Sequence
from typing import Any

from kvtier.keys import BlockKey
from kvtier.metrics import TierCounters
from kvtier.policies.base import EvictionPolicy
from kvtier.policies.hints import RequestHint

log = logging.getLogger(__name__)


class GuardedPolicy(EvictionPolicy):
    """``policy`` behind the boundary described in the module docstring; ``name`` (its class
    path) names it in log messages."""

    def __init__(self, policy: EvictionPolicy, name: str) -> None:
        self.policy = policy
        self.name = name
        self.errors = 0
        """Calls that raised or answered something unusable."""
        self.counters: TierCounters | None = None
        """A tier's counters, when the policy is a tier's: each failure counts in its ``errors``
        too (the tier sets it; ``tiers/eviction.count_errors_in``)."""
        self._tracked: OrderedDict[BlockKey, None] = OrderedDict()

    def insert(self, key: BlockKey) -> None:
        self._tracked[key] = None
        self._call(self.policy.insert, key)

    def access(self, key: BlockKey) -> None:
        if key in self._tracked:
            self._tracked.move_to_end(key)
        self._call(self.policy.access, key)

    def remove(self, key: BlockKey) -> None:
        self._tracked.pop(key, None)
        self._call(self.policy.remove, key)

    def evict(self, n: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        if n <= 0:
            return []
        victims = self._usable_victims(n, pinned)
        if len(victims) < n:
            extra = self._first(n - len(victims), pinned, set(victims))
            if extra:
                self._failed("evict", None)  # unpinned keys left that the policy did not offer
                for key in extra:
                    self._call(self.policy.remove, key)
                victims += extra
        for key in victims:
            del self._tracked[key]
        return victims

    def coldest(self, n: int) -> list[BlockKey]:
        try:
            answer = self.policy.coldest(n)
            if isinstance(answer, list | tuple):
                tracked = self._tracked
                return [k for k in answer[: max(0, n)] if type(k) is bytes and k in tracked]
            self._failed("coldest", None)
        except Exception as exc:
            self._failed("coldest", exc)
        return list(self._first(max(0, n), (), ()))

    def on_request(self, keys: Sequence[BlockKey], hint: RequestHint) -> None:
        self._call(self.policy.on_request, keys, hint)

    def __len__(self) -> int:
        return len(self._tracked)

    # -- internals ------------------------------------------------------------------------------

    def _usable_victims(self, n: int, pinned: Container[BlockKey]) -> list[BlockKey]:
        """The policy's victims that fit (see the module docstring); the others handed back."""
        try:
            offered = self.policy.evict(n, pinned)
        except Exception as exc:
            self._failed("evict", exc)
            return []
        if not isinstance(offered, list | tuple):
            self._failed("evict", None)
            return []
        tracked = self._tracked
        victims: list[BlockKey] = []
        chosen: set[BlockKey] = set()
        for key in offered:
            if type(key) is not bytes or key not in tracked or key in chosen:
                continue  # not a key of ours: nothing to hand back
            if key in pinned or len(victims) >= n:
                self._call(self.policy.insert, key)  # the policy let it go: rank it again
                continue
            victims.append(key)
            chosen.add(key)
        return victims

    def _first(
        self, n: int, pinned: Container[BlockKey], taken: Container[BlockKey]
    ) -> list[BlockKey]:
        """Up to ``n`` tracked keys in the guard's LRU order, skipping ``pinned`` and ``taken``."""
        out: list[BlockKey] = []
        for key in self._tracked:
            if len(out) >= n:
                break
            if key not in pinned and key not in taken:
                out.append(key)
        return out

    def _call(self, method: Callable[..., Any], *args: Any) -> None:
        try:
            method(*args)
        except Exception as exc:
            self._failed(getattr(method, "__name__", "a method"), exc)

    def _failed(self, what: str, exc: Exception | None) -> None:
        self.errors += 1
        if self.counters is not None:
            self.counters.errors += 1
        if self.errors == 1:
            log.warning(
                "eviction policy %s broke its contract in %s%s; kvtier goes on without its "
                "answer (further failures are counted, not logged)",
                self.name,
                what,
                "" if exc is None else f" ({type(exc).__name__})",
                exc_info=exc,
            )
