"""The ``redis`` tier's storage: one pipelined round trip per call moves a batch of blocks
(``SET``, ``GET``/``GETEX``), or asks about a batch of keys (``EXISTS``, ``DEL``), on the
connection and within the command deadline its caller holds.

On a standalone server the block bytes move between the socket and the pool slots directly
(``redis_wire``); in cluster mode redis-py's cluster pipeline routes each key to its node. A read
reports a block only after its value's header matched and the checksum of the bytes landed in the
slot did. A value that is not a block of ours (a mismatch, another size, another Redis type:
``WRONGTYPE``) is corrupt: counted, deleted and reported evicted; a key the server no longer
holds is a miss reported evicted and counted in ``evictions``. Nothing read from the server is
ever unpickled or executed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from kvtier.keys import BlockKey
from kvtier.pool import HostPool
from kvtier.tiers import redis_wire
from kvtier.tiers.payload import HEADER_BYTES
from kvtier.tiers.redis_client import BlockValue, Client
from kvtier.tiers.redis_health import Count, Health
from kvtier.tiers.redis_keys import KeySpace
from kvtier.tiers.redis_options import Options
from kvtier.tiers.redis_presence import Presence, clock, present_until

log = logging.getLogger("kvtier.tiers.redis")


@dataclass(frozen=True, slots=True)
class Parts:
    """What the parts of one tier share."""

    name: str
    options: Options
    pool: HostPool
    keys: KeySpace
    presence: Presence
    health: Health
    count: Count
    """The tier's counter update."""
    report_evicted: Callable[[BlockKey], None]
    """Hand a key the tier dropped to ``take_evicted``."""


class BlockStore:
    """Batches of blocks in one tier's namespace; see the module docstring.

    ``delete_later`` queues keys whose values turned out corrupt for a ``DEL`` off the data path.
    Failed commands go to ``health.failed`` (counted; unreachable -> unhealthy)."""

    def __init__(self, parts: Parts, delete_later: Callable[[list[BlockKey]], None]) -> None:
        self.name = parts.name
        self.options = parts.options
        self.pool = parts.pool
        self._keys = parts.keys
        self._presence = parts.presence
        self._health = parts.health
        self._count = parts.count
        self._report_evicted = parts.report_evicted
        self._delete_later = delete_later
        self._wire = not parts.options.cluster
        """Standalone: blocks move on the socket directly (redis_wire); cluster: redis-py
        pipelines, which route each key to its node."""

    # -- blocks ---------------------------------------------------------------------------------

    def write(
        self, client: Client, lane: redis_wire.Lane, keys: list[BlockKey], slots: list[int]
    ) -> list[bool]:
        """``SET`` each block (header and slot, ``PX`` with a TTL); a reply other than OK or an
        error reply fails the batch as a ``ProtocolError``."""
        view = self.pool.view
        ttl = self.options.ttl_ms
        payloads = [view(slot) for slot in slots]
        headers = [self._keys.header(k, p) for k, p in zip(keys, payloads, strict=True)]
        rkeys = [self._keys.redis_key(key) for key in keys]
        replies: list[Any]
        if self._wire:
            with lane.on(client) as wire:
                wire.send(redis_wire.set_chunks(rkeys, headers, payloads, ttl))
                replies = [wire.simple() for _ in keys]
        else:
            pipe = client.pipeline(transaction=False)
            for rkey, header, payload in zip(rkeys, headers, payloads, strict=True):
                value = BlockValue(header, payload)
                if ttl is None:
                    pipe.execute_command("SET", rkey, value)
                else:
                    pipe.execute_command("SET", rkey, value, "PX", ttl)
            replies = pipe.execute(raise_on_error=False)
        until = present_until(self.options.ttl_s)
        ok: list[bool] = []
        for key, reply in zip(keys, replies, strict=True):
            if isinstance(reply, Exception):
                self._health.failed(reply, 1)
                self._presence.forget([key])
                ok.append(False)
            elif reply is True or reply == b"OK" or reply == "OK":
                self._presence.set(key, True, until)
                ok.append(True)
            else:
                # SET answers OK or an error, nothing else: the batch fails as a protocol error.
                raise redis_wire.ProtocolError(f"SET answered {str(reply)[:60]!r}")
        written = sum(ok)
        self._count(write_blocks=written, write_bytes=written * self.pool.slot_bytes)
        return ok

    def read(
        self, client: Client, lane: redis_wire.Lane, keys: list[BlockKey], slots: list[int]
    ) -> list[bool]:
        """``GET`` (``GETEX`` to restart a TTL) each block into its slot and verify it."""
        ttl = self.options.ttl_ms if self.options.ttl_touch_on_read else None
        rkeys = [self._keys.redis_key(key) for key in keys]
        if self._wire:
            ok = self._read_wire(client, lane, keys, slots, rkeys, ttl)
        else:
            ok = self._read_pipeline(client, keys, slots, rkeys, ttl)
        got_blocks = sum(ok)
        self._count(read_blocks=got_blocks, read_bytes=got_blocks * self.pool.slot_bytes)
        return ok

    def _read_wire(
        self,
        client: Client,
        lane: redis_wire.Lane,
        keys: list[BlockKey],
        slots: list[int],
        rkeys: list[bytes],
        ttl: int | None,
    ) -> list[bool]:
        """Standalone: each value's header into a small buffer, its payload straight into the
        slot (``recv_into``)."""
        ok: list[bool] = []
        header = memoryview(bytearray(HEADER_BYTES))
        with lane.on(client) as wire:
            wire.send([redis_wire.get_command(rkeys, ttl)])
            for key, slot in zip(keys, slots, strict=True):
                target = self.pool.view(slot)
                got = wire.block(header, target)
                if got is redis_wire.Got.VALUE:
                    ok.append(self._verify(key, header, target))
                else:
                    ok.append(self._not_read(key, got))
                if got is redis_wire.Got.TOO_BIG:
                    # Its bytes were not read: the replies after it cannot be either.
                    unread = len(keys) - len(ok)
                    self._count(errors=unread)
                    ok += [False] * unread
                    break
        return ok

    def _read_pipeline(
        self,
        client: Client,
        keys: list[BlockKey],
        slots: list[int],
        rkeys: list[bytes],
        ttl: int | None,
    ) -> list[bool]:
        """Cluster: redis-py's pipeline, each value copied once into its slot."""
        ok: list[bool] = []
        pipe = client.pipeline(transaction=False)
        for rkey in rkeys:
            if ttl is None:
                pipe.execute_command("GET", rkey)
            else:
                pipe.execute_command("GETEX", rkey, "PX", ttl)
        replies = pipe.execute(raise_on_error=False)
        for key, slot, reply in zip(keys, slots, replies, strict=True):
            if isinstance(reply, bytes) and len(reply) == self._keys.value_bytes:
                data = memoryview(reply)
                target = self.pool.view(slot)
                target[:] = data[HEADER_BYTES:]  # the one unavoidable copy here
                ok.append(self._verify(key, data[:HEADER_BYTES], target))
            elif isinstance(reply, bytes):
                ok.append(self._not_read(key, redis_wire.Got.WRONG_SIZE))
            elif reply is None:
                ok.append(self._not_read(key, redis_wire.Got.MISSING))
            else:
                ok.append(self._not_read(key, reply))
        return ok

    def _verify(self, key: BlockKey, header: memoryview, payload: memoryview) -> bool:
        """A value's header and the checksum of the bytes now in the slot."""
        if self._keys.matches(header, key, payload):
            self._presence.set(key, True, present_until(self.options.ttl_s))
            return True
        return self._corrupt(key)

    def _not_read(self, key: BlockKey, outcome: Any) -> bool:
        """A read that found no usable value: missing, of the wrong size, or an error."""
        if outcome is redis_wire.Got.MISSING:
            # The server dropped it (TTL, maxmemory) or never had it: a miss, not an error.
            self._presence.set(key, False, clock() + self.options.negative_cache_s)
            self._report_evicted(key)
            self._count(evictions=1)
        elif (
            outcome in (redis_wire.Got.WRONG_SIZE, redis_wire.Got.TOO_BIG)
            or not isinstance(outcome, BaseException)
            or (isinstance(outcome, ResponseError) and str(outcome).startswith("WRONGTYPE"))
        ):
            # Not a block of ours: another size, or a list, hash, set... at a kvtier key.
            self._corrupt(key)
        else:
            self._health.failed(outcome, 1)
        return False

    def _corrupt(self, key: BlockKey) -> bool:
        """A value that is not a valid block of this key: count it, drop it, report it."""
        self._count(corrupt=1)
        log.warning("redis tier %s: corrupt value for key %s dropped", self.name, key.hex())
        self._presence.set(key, False, clock() + self.options.negative_cache_s)
        self._report_evicted(key)
        self._delete_later([key])
        return False

    # -- keys -----------------------------------------------------------------------------------

    def exists(self, client: Client, lane: redis_wire.Lane, keys: list[BlockKey]) -> None:
        """``EXISTS`` each key; the answers go to the presence cache (failed ones are forgotten:
        the next lookup asks again)."""
        replies = self._meta_replies(client, lane, b"EXISTS", keys)
        known: list[BlockKey] = []
        present: list[bool] = []
        failed: list[BlockKey] = []
        for key, reply in zip(keys, replies, strict=True):
            if isinstance(reply, Exception):
                failed.append(key)
                self._health.failed(reply, 0)
            else:
                known.append(key)
                present.append(reply > 0)
        now = clock()
        self._presence.resolve(
            known,
            present,
            present_until(self.options.ttl_s, now),
            now + self.options.negative_cache_s,
        )
        if failed:
            self._presence.forget(failed)

    def delete(self, client: Client, lane: redis_wire.Lane, keys: list[BlockKey]) -> None:
        """``DEL`` each key (only keys of this namespace: ``redis_key`` puts every one under the
        tier's prefix)."""
        for reply in self._meta_replies(client, lane, b"DEL", keys):
            if isinstance(reply, Exception):
                self._health.failed(reply, 0)

    def _meta_replies(
        self, client: Client, lane: redis_wire.Lane, command: bytes, keys: list[BlockKey]
    ) -> list[Any]:
        """``command <redis key>`` for each key in one round trip; each reply must be an
        integer or an error reply (anything else is a ``ProtocolError``)."""
        rkeys = [self._keys.redis_key(key) for key in keys]
        if self._wire:
            replies = self._health.ask(client, lane, [(command, rkey) for rkey in rkeys])
        else:
            pipe = client.pipeline(transaction=False)
            for rkey in rkeys:
                pipe.execute_command(command.decode(), rkey)
            replies = pipe.execute(raise_on_error=False)
        for reply in replies:
            if not isinstance(reply, int | Exception) or isinstance(reply, bool):
                raise redis_wire.ProtocolError(f"{command.decode()} answered {str(reply)[:60]!r}")
        self._health.replied()
        return replies
