"""Promotions on behalf of waiting requests: how many pool slots they may hold, what a tier's
reads cost, and how long a request waits for them.

A request whose next blocks sit in a secondary tier waits (its lookup is pending) while they are
read into the pool. Under load, without these rules, promotions for many waiting requests evicted
each other's blocks before the requests loaded them (the same blocks were read again and again), a
tier with a backlog made a hit slower than computing the tokens, and a request waited for a read
that its own prefill would have beaten. So:

* **Budget.** Promotions hold at most ``budget`` pool slots: blocks being read plus blocks landed
  for a request that has not loaded them yet (those are pinned: no store or other promotion evicts
  them). Requests are served in the order they ask; one whose run does not fit gets the part that
  fits when no other promotion holds the budget (a further round once it landed, if there is
  room then); while others do, one whose run does not fit, or that finds the budget spent, gets
  the pool's hits at once instead of waiting.
* **Cost.** Each tier's read time per block is what the tier reports of its jobs
  (``JobResult.busy_s``; queueing excluded), and the engine's compute rate one request's share of
  its steps. A run is claimed only as far as reading it, behind what the tier still has to read,
  is expected to end before computing it would. A tier idle and unmeasured for a while, or
  declined again and again, is read again to measure it.
* **Deadline.** A waiting request stops waiting when computing the claimed tokens would have been
  done by now (but not before two engine steps), and takes what has landed; the rest is
  recomputed. The same deadline bounds a wait for room: a pool pinned full by tier writes frees
  slots as they end, but under a steady stream of stores there is always another write. A
  request waits for room once: asked again after its answer (the engine had no room for it
  yet), it takes the pool's hits at once until it leaves.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Container, Hashable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from itertools import repeat, takewhile
from operator import neg, or_, truth
from statistics import median

from kvtier.cache.retry import FailedPromotions
from kvtier.keys import BlockKey
from kvtier.tiers.base import Tier

EWMA_WEIGHT = 0.2
"""Weight of a new sample in the moving averages (about the last 5-10 jobs or steps count)."""
MIN_STEP_TOKENS = 64
"""Engine steps computing fewer tokens (pure decode) say little about its prefill rate."""
RATE_SAMPLES = 15
"""The compute rate is the median of this many last steps' rates: a step timed with the wrong
interval (the first after an engine's start or idle spell, while its batch queue fills) reads
100-1000x the rate, and one such sample in a moving average declined promotions for the next
~25 prefill steps (the opening burst of the scheduler replay at 8x2)."""
PROBE_AFTER_S = 1.0
PROBE_AFTER_DECLINES = 16
"""A tier whose reads were last measured ``PROBE_AFTER_S`` ago, or that was declined this many
times since, is read again as if unmeasured (when none of its reads runs): one slow sample (a
cold start, a burst of load) would otherwise decline every later promotion, and a declined
promotion measures nothing (the CPU demo lost all its fs hits so)."""
SHARED_WEIGHT = 2.0
"""While other requests share the engine's steps, a read is worth waiting for up to this many
times the request's own compute time: recomputing its tokens also takes that time from the
others (each step's tokens are shared), and a read takes none. Comparing with the request's time
alone declined most reads where a disk reads slower than the engine computes: on an H200 at 16
conversations in flight, 84,323 declined promotions against 4,032 in a run whose measured rate
was half as high, and the run with more declines was slower on every figure (docs/vllm.md, *The
H200*). In the scheduler replay with fs reads at 4 ms a block, 2 ran 1.02x the tokens/s of 1
at 16x2 and 16x4 (both with ``vllm.keep_order``'s hold bounded by engine steps); with that hold,
1.06-1.07x the earlier rules' at 16x2, 16x4, 16x8 and 32x4 (docs/vllm.md, *A disk slower than
the engine*)."""
LEASE_S = 30.0
"""A promise whose request never came back is dropped (its pins released) after this long."""
MAX_KEPT_ANSWERS = 4096
"""Waiting requests whose tier answers are kept (``KeptAnswers``); past it the one asked least
recently is dropped (an engine that never ends its requests would otherwise grow it)."""

Owner = Hashable
"""Who waits for a promotion: the engine's request id."""


@dataclass(slots=True)
class ReadCost:
    """One tier's reads: seconds per block and the blocks still to be read."""

    seconds_per_block: float | None = None
    """Moving average of a job's service time per block (None: no read measured yet)."""
    outstanding: int = 0
    """Blocks of read jobs submitted and not yet reported."""
    busy_until: float = 0.0
    """When the last measured job ended: a later job's service time starts no earlier."""
    measured_at: float = 0.0
    declined: int = 0
    """Lookups that declined this tier's blocks since it was last measured."""

    def started(self, blocks: int) -> None:
        self.outstanding += blocks

    def ended(self, blocks: int, submitted: float, now: float, busy_s: float | None = None) -> None:
        """A read job of ``blocks`` submitted at ``submitted`` was seen ended at ``now`` (ok or
        not: a failing tier is slow too). ``busy_s``: the tier's own measure of the time it
        worked on it; without one, the time since it was submitted or the previous job ended,
        which also counts how late the engine's step saw it end."""
        self.outstanding = max(0, self.outstanding - blocks)
        start = max(submitted, self.busy_until)
        self.busy_until = self.measured_at = now
        self.declined = 0
        if blocks <= 0:
            return
        seconds = busy_s if busy_s is not None else now - start
        sample = max(seconds, 1e-7) / blocks
        old = self.seconds_per_block
        self.seconds_per_block = sample if old is None else old + EWMA_WEIGHT * (sample - old)

    def expected_s(self, blocks: int, now: float) -> float | None:
        """Seconds until ``blocks`` more, read behind the outstanding ones, would have landed;
        None when unknown: never measured, or idle and not measured for ``PROBE_AFTER_S``."""
        spb = self.seconds_per_block
        stale = now - self.measured_at > PROBE_AFTER_S or self.declined >= PROBE_AFTER_DECLINES
        if spb is None or (stale and not self.outstanding):
            return None
        return (self.outstanding + blocks) * spb


@dataclass(slots=True)
class ComputeRate:
    """Tokens per second the engine computes for one request, from the tokens of each step, the
    requests sharing it and its duration: a request's prefill gets its share of each step, so
    recomputing its blocks takes longer than the engine's whole rate says (on an H100 at 8
    conversations in flight, comparing with the whole rate declined 40,277 block promotions from an
    fs tier and started 271, and the run cached 19% fewer tokens than vLLM's own offloading).
    An engine that schedules a step while the previous one runs (vLLM's asynchronous scheduling)
    reports each step's tokens when the step runs, not when it is scheduled
    (``PlannerSettings.steps_in_flight``): paired with the interval after its scheduling, a
    step's tokens overstated the rate ~20x (docs/vllm.md, *The compute rate under vLLM's batch
    queue*)."""

    tokens_per_s: float | None = None
    step_s: float = 0.0
    """Moving average of a step's duration (every step)."""
    shared: bool = False
    """The latest step ran more than one request (``SHARED_WEIGHT``)."""
    _last: float | None = None
    _tokens: int = 0
    _requests: int = 1
    _samples: deque[float] = field(default_factory=lambda: deque(maxlen=RATE_SAMPLES))

    def step(self, tokens: int, now: float, requests: int = 1, running: int = 1) -> None:
        """A step computing ``tokens`` for ``requests`` requests (those computing more than a
        token) of ``running`` in all runs from ``now`` until the next call (the previous one
        ended)."""
        last, done, shared = self._last, self._tokens, self._requests
        self._last, self._tokens, self._requests = now, tokens, max(1, requests)
        self.shared = running > 1
        if last is None or now <= last:
            return
        self.step_s += EWMA_WEIGHT * (now - last - self.step_s)
        if done < MIN_STEP_TOKENS:
            return
        self._samples.append(done / shared / (now - last))
        self.tokens_per_s = median(self._samples)

    def seconds(self, tokens: int) -> float | None:
        """What computing ``tokens`` costs, as a read's budget: one request's time, or
        ``SHARED_WEIGHT`` times it while others share the steps."""
        rate = self.tokens_per_s
        weight = SHARED_WEIGHT if self.shared else 1.0
        return None if not rate else weight * tokens / rate


@dataclass(slots=True)
class Promise:
    """Blocks being promoted for one waiting request."""

    keys: list[BlockKey]
    """The blocks claimed for it, in request order."""
    deadline: float
    """The request stops waiting at this time (``lookup`` answers with what landed)."""
    lease_end: float
    pinned: list[BlockKey] = field(default_factory=list)
    """Claimed blocks that landed: pinned until the request loads them or stops waiting."""
    done: bool = False
    """The deadline passed with blocks still being read: what had landed was the answer, and no
    further round starts until the request loaded (or left)."""


@dataclass(frozen=True, slots=True)
class PromotionSettings:
    budget: float = 0.5
    """Fraction of the pool's slots promotions may hold (``pool.promotion_budget``)."""
    weigh_costs: bool = True
    """Claim and wait only as far as reading beats computing (``pool.promotion_costs``); False:
    every block found is promoted and waited for up to the job timeout."""
    block_tokens: int = 1


DEFAULT_SETTINGS = PromotionSettings()


@dataclass(slots=True)
class Claim:
    """What a lookup may promote: the leading ``blocks`` of its run, and until when to wait."""

    blocks: int
    deadline: float


class PromotionRules:
    """Budget, costs and promises of a ``TieredCache``'s promotions (see the module docstring)."""

    def __init__(
        self, tiers: int, settings: PromotionSettings, num_slots: int, max_wait_s: float
    ) -> None:
        self.budget = int(num_slots * settings.budget)
        self.block_tokens = settings.block_tokens
        self.max_wait_s = max_wait_s
        self.weigh = settings.weigh_costs
        self.reads = [ReadCost() for _ in range(tiers)]
        self.compute = ComputeRate()
        self.promises: dict[Owner, Promise] = {}
        self.claimed_by: dict[BlockKey, Owner] = {}
        """Claimed blocks still being read -> the request they are read for."""
        self.promised_pins = 0
        """Landed blocks pinned for their requests (``Promise.pinned``, all promises)."""
        self.room_waits: dict[Owner, float] = {}
        """Requests that found the pool pinned full -> when they stop waiting for room."""

    def read_tokens_per_s(self, names: Sequence[str]) -> dict[str, float]:
        """Per tier (``names`` in tier order) whose reads were measured: tokens read a second."""
        return {
            name: self.block_tokens / cost.seconds_per_block
            for name, cost in zip(names, self.reads, strict=True)
            if cost.seconds_per_block
        }

    def claim(self, run_tiers: list[int], in_flight: int, now: float) -> Claim:
        """How many leading blocks of a run (the tier index of each) to promote now.

        ``in_flight``: blocks of promotions being read (any request). The budget caps the claim;
        then the longest prefix whose expected read time (per tier: behind its outstanding reads)
        is at most its compute time. Unmeasured tiers or engine: claimed (a first job measures).
        """
        room = self.budget - in_flight - self.promised_pins
        n = max(0, min(len(run_tiers), room))
        if n < len(run_tiers) and (in_flight or self.promised_pins):
            # Not a part while other promotions hold the budget: the rest would come in further
            # rounds, each a scheduling pass later than computing it (without this rule, p99
            # 1.16-1.23x the shipped rules' in the scheduler replay at 8x2 and 16x2; docs/vllm.md).
            n = 0
        if not self.weigh:
            return Claim(n, now + self.max_wait_s)
        best, wait = self._longest_worth(run_tiers, n, now)
        for tier in set(run_tiers[best:n]):
            self.reads[tier].declined += 1
        # An engine asks again once a step, and sees a landed block a step later: a wait shorter
        # than two steps would end before it could see anything land.
        wait = max(wait, 2 * self.compute.step_s)
        return Claim(best, now + min(self.max_wait_s, wait))

    def _longest_worth(self, run_tiers: list[int], n: int, now: float) -> tuple[int, float]:
        """The longest prefix of the run's first ``n`` blocks worth reading (expected to land
        before computing it would; unmeasured: worth it) and the wait for it: (0, 0.0) for none.

        Tried from the longest prefix down, so a run worth reading whole (the common case) costs
        one try, not one per block; a request that waits re-asks every step. A run of one tier
        that is not worth it at its first and last block is worth it at none (reading and
        computing grow linearly with the blocks), checked with a margin for rounding."""
        per_tier = dict(Counter(run_tiers[:n]))
        if n > 2 and len(per_tier) == 1 and self._worth_at_neither_end(per_tier, n, now):
            return 0, 0.0
        for blocks in range(n, 0, -1):
            read = self._read_s(per_tier, now)
            compute = self.compute.seconds(blocks * self.block_tokens)
            if read is None or compute is None or read <= compute:
                return blocks, compute if compute is not None else self.max_wait_s
            tier = run_tiers[blocks - 1]
            left = per_tier[tier] - 1
            if left:
                per_tier[tier] = left
            else:
                del per_tier[tier]
        return 0, 0.0

    def _worth_at_neither_end(self, per_tier: dict[int, int], n: int, now: float) -> bool:
        """For a run of one tier: reading its first block, and all ``n``, is slower than
        computing them by more than rounding could change, so no prefix is worth reading."""
        ((tier, _),) = per_tier.items()
        cost = self.reads[tier]
        for blocks in (1, n):
            read = cost.expected_s(blocks, now)
            compute = self.compute.seconds(blocks * self.block_tokens)
            if read is None or compute is None or read <= compute * (1 + 1e-9):
                return False
        return True

    def _read_s(self, per_tier: dict[int, int], now: float) -> float | None:
        # Tiers read in parallel: the run has landed when the slowest tier's part has.
        worst = 0.0
        for tier, blocks in per_tier.items():
            expected = self.reads[tier].expected_s(blocks, now)
            if expected is None:
                return None
            worst = max(worst, expected)
        return worst

    def promise(self, owner: Owner, keys: list[BlockKey], deadline: float, now: float) -> None:
        """``owner`` waits for ``keys`` until ``deadline``; a further round of a promise whose
        blocks all landed keeps the pins of the earlier rounds."""
        earlier = self.promises.get(owner)
        self.promises[owner] = Promise(list(keys), deadline, now + LEASE_S)
        if earlier is not None:
            self.promises[owner].pinned = earlier.pinned
        claimed = self.claimed_by
        for key in keys:
            claimed.setdefault(key, owner)

    def waits_for_room(self, owner: Owner | None, deadline: float, now: float) -> bool:
        """Whether ``owner``, whose claim found no free slot (the pool pinned full by tier
        writes), waits for one: until the deadline of its first such claim. Without an owner,
        as long as writes run."""
        if owner is None:
            return True
        return now < self.room_waits.setdefault(owner, deadline)

    def waits(self, owner: Owner, promoting: Set[BlockKey], now: float) -> bool | None:
        """Whether ``owner`` still waits for its promotion: True while a claimed block is being
        read before the deadline; False once the deadline passed with blocks still being read
        (what has landed is the answer, and no further round starts until the promise ends);
        None without a promise or when all its blocks landed in time (a lookup may start a
        further round: the run may go on past a block whose presence a tier could not tell yet,
        or past what the budget allowed)."""
        promise = self.promises.get(owner)
        if promise is None:
            return None
        if promise.done:
            return False
        if promoting.isdisjoint(promise.keys):
            return None
        if now < promise.deadline:
            return True
        promise.done = True
        return False

    def landed(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        """Promoted blocks arrived: those a waiting request claimed, in order (the caller pins
        them for it)."""
        claimed, promises = self.claimed_by, self.promises
        if not claimed:
            return []
        held: list[BlockKey] = []
        for key in keys:
            owner = claimed.pop(key, None)
            promise = None if owner is None else promises.get(owner)
            if promise is not None:
                promise.pinned.append(key)
                held.append(key)
        self.promised_pins += len(held)
        return held

    def dropped(self, key: BlockKey) -> None:
        """A promoted block will not arrive (its read failed or timed out)."""
        self.claimed_by.pop(key, None)

    def leave(self, owner: Owner) -> list[BlockKey]:
        """The request left (or holds nothing to load): its promise and its wait for room end.
        Returns the keys to unpin."""
        self.room_waits.pop(owner, None)
        return self.end(owner)

    def end(self, owner: Owner) -> list[BlockKey]:
        """The request took its hits for a load: its promise ends. Returns the keys to unpin.

        Its wait for room stays spent: an engine with no room for the request yet asks again
        every step, and a wait begun afresh at each ask kept the request out of the batch while
        the requests behind it went first (2.4 s in the 32x2 replay's slowest request)."""
        promise = self.promises.pop(owner, None)
        if promise is None:
            return []
        claimed = self.claimed_by
        for key in promise.keys:
            if claimed.get(key) == owner:
                del claimed[key]
        self.promised_pins -= len(promise.pinned)
        return promise.pinned

    def expired(self, now: float) -> list[Owner]:
        """Requests whose promise or wait for room outlived its lease (they never came back)."""
        gone = [owner for owner, p in self.promises.items() if p.lease_end <= now]
        return gone + [o for o, end in self.room_waits.items() if end + LEASE_S <= now]


Answer = list[bool | None]


def pool_hits(
    keys: Sequence[BlockKey], index: Container[BlockKey], loading: Mapping[BlockKey, int], held: int
) -> tuple[int, bool]:
    """How many leading ``keys`` are in the pool (``index``), and whether one of those is
    being loaded for another request (``loading``: loads in flight per key; one load of each of
    the first ``held`` keys is the caller's own). Loops in C: a request's hits are hundreds."""
    hits = len(list(takewhile(index.__contains__, keys)))
    if not loading or not hits:
        return hits, False
    own = min(held, hits)
    if own and max(map(loading.get, keys[:own], repeat(0))) > 1:
        return hits, True
    return hits, not loading.keys().isdisjoint(keys[own:hits])


def tier_run(
    rest: Sequence[BlockKey],
    answers: list[Answer],
    index: Container[BlockKey],
    inflight: Container[BlockKey],
    promoting: Container[BlockKey],
    failed: FailedPromotions,
) -> tuple[list[tuple[BlockKey, int]], bool]:
    """The blocks after the pool's hits that a lookup may count on, in order, as (key, the
    index of the first tier whose answer (``answers``, per tier, per key of ``rest``) holds
    it, or -1 for a key already in the pool), up to the first that none holds or that is in
    flight; and whether that end is unknown (a tier could not tell, or another request's
    promotion brings it). A tier whose promotion of a key failed lately (``failed``) does not
    count for it."""
    if len(answers) == 1 and not failed:
        found = _one_tier_run(rest, answers[0], index, inflight, promoting)
        if found is not None:
            return found
    run: list[tuple[BlockKey, int]] = []
    unknown = False
    check_failed = bool(failed)
    for i, key in enumerate(rest):
        if key in index:
            run.append((key, -1))
            continue
        if key in inflight:
            unknown = key in promoting
            break
        chosen = -1
        for tier_index, answer in enumerate(answers):
            present = answer[i]
            if present and not (check_failed and (tier_index, key) in failed):
                chosen = tier_index
                break
            if present is None:
                unknown = True
        if chosen < 0:
            break
        unknown = False
        run.append((key, chosen))
    return run, unknown


def _one_tier_run(
    rest: Sequence[BlockKey],
    answer: Answer,
    index: Container[BlockKey],
    inflight: Container[BlockKey],
    promoting: Container[BlockKey],
) -> tuple[list[tuple[BlockKey, int]], bool] | None:
    """``tier_run`` of one tier with no failed promotion, in C (a waiting request's tail is
    hundreds of blocks, asked every step): the leading keys each in the pool or held by the tier,
    each -1 (pool) or 0 (the tier); None when one of them is in flight (``tier_run`` decides)."""
    in_pool = index.__contains__
    held = map(or_, map(in_pool, rest), map(truth, answer))
    n = len(list(takewhile(truth, held)))
    keys = rest[:n]
    if any(map(inflight.__contains__, keys)):
        return None
    run = list(zip(keys, map(neg, map(in_pool, keys)), strict=True))
    if n == len(rest):
        return run, False
    # The key that ends the run is neither in the pool nor held (False or None) by the tier.
    key = rest[n]
    return run, key in promoting if key in inflight else answer[n] is None


def tier_answers(
    tiers: Sequence[Tier],
    rest: Sequence[BlockKey],
    ask: Callable[[Tier, Sequence[BlockKey]], Answer],
) -> list[Answer] | None:
    """Each tier's answer (``ask``: a lookup that never raises) for the blocks after the pool's
    hits; None when no tier can hold the first one. A tier that surely holds nothing
    (``Tier.is_empty``) is not asked, and the first block is asked alone first: a miss, the common
    answer, then costs one key per tier instead of the request's whole tail."""
    empty = [_surely_empty(tier) for tier in tiers]
    if all(empty):
        return None
    nothing: Answer = [False] * len(rest)
    first = [nothing[:1] if e else ask(t, rest[:1]) for t, e in zip(tiers, empty, strict=True)]
    if all(answer[0] is False for answer in first):
        return None
    if len(rest) == 1:
        return first
    return [nothing if a[0] is False else ask(t, rest) for t, a in zip(tiers, first, strict=True)]


def _surely_empty(tier: Tier) -> bool:
    try:
        return tier.is_empty() is True
    except Exception:  # a plugin's answer proves nothing: ask it
        return False


def _generations(tiers: Sequence[Tier]) -> list[int] | None:
    """Each tier's ``Tier.generation()``; None when one has none (or its call raises)."""
    out = []
    for tier in tiers:
        try:
            generation = tier.generation()
        except Exception:  # a plugin's: ask it every time
            return None
        if generation is None:
            return None
        out.append(generation)
    return out


@dataclass(slots=True)
class _Kept:
    rest: list[BlockKey]
    generations: list[int]
    """The tiers' generations read before they were asked."""
    answers: list[Answer] | None
    counted: list[tuple[int, int]]
    """Per tier: what asking added to its ``lookups`` and ``lookup_hits``."""


class KeptAnswers:
    """``tier_answers`` for waiting requests, kept while no tier changed.

    An engine asks again for each request it has no room for yet at every step (vLLM 0.25.1
    does), and with an fs tier each ask looked up the request's blocks after the pool's hits in
    every tier (0.5-0.7 ms of a slow step at 8 conversations in the vLLM replay). A request's
    answers are reused only for the same blocks and while every tier's ``Tier.generation()``,
    read before asking, is unchanged (a tier bumps it after each change of what it holds), so
    they are what asking again would return; a tier without one is asked every time, and so is
    every tier for a lookup without an owner. A reused answer counts in the tiers' lookup
    counters as asking did."""

    __slots__ = ("_ask", "_kept", "_tiers")

    def __init__(
        self, tiers: Sequence[Tier], ask: Callable[[Tier, Sequence[BlockKey]], Answer]
    ) -> None:
        self._tiers = tiers
        self._ask = ask
        self._kept: dict[Owner, _Kept] = {}

    def answers(self, rest: Sequence[BlockKey], owner: Owner | None) -> list[Answer] | None:
        """``tier_answers(tiers, rest, ask)``, kept for ``owner``."""
        tiers = self._tiers
        generations = None if owner is None else _generations(tiers)
        if generations is None:
            return tier_answers(tiers, rest, self._ask)
        keys = rest if type(rest) is list else list(rest)
        table = self._kept
        kept = table.pop(owner, None)  # put back last: the table's order is the asking order
        if kept is not None and kept.generations == generations and kept.rest == keys:
            for tier, (asked, hits) in zip(tiers, kept.counted, strict=True):
                counters = tier.counters
                counters.lookups += asked
                counters.lookup_hits += hits
        else:
            before = [(t.counters.lookups, t.counters.lookup_hits) for t in tiers]
            answers = tier_answers(tiers, keys, self._ask)
            if answers is not None and any(None in answer for answer in answers):
                return answers  # a tier that cannot tell yet may know at the next ask
            counted = [
                (t.counters.lookups - asked, t.counters.lookup_hits - hits)
                for t, (asked, hits) in zip(tiers, before, strict=True)
            ]
            kept = _Kept(keys, generations, answers, counted)
        table[owner] = kept
        if len(table) > MAX_KEPT_ANSWERS:
            del table[next(iter(table))]
        return kept.answers

    def hold_nothing(self) -> bool:
        """Every tier surely holds nothing (``Tier.is_empty``: an fs tier on a full disk), so no
        answer needs asking or keeping."""
        return all(map(_surely_empty, self._tiers))

    def forget(self, owner: Owner) -> None:
        """The request stopped waiting: its answers go."""
        self._kept.pop(owner, None)
