"""The ``redis`` tier's storage: one pipelined round trip per call moves a batch of blocks
(``SET``, ``GET``/``GETEX``), or asks about a batch of keys (``EXISTS``, ``DEL``), on the
connection and within the command deadline its caller holds.

On a standalone server the block bytes move between the socket and the pool slots directly
(``redis_wire``); in cluster mode redis-py's cluster pipeline routes each key to its node. A read
lands each value's header and payload in the buffers the tier skeleton hands it
(``block_tier.BlockTier`` verifies them); a value that cannot be a block of ours (another size,
another Redis type: ``WRONGTYPE``) is ``Got.DAMAGED``, and a key the server no longer holds is a
miss reported evicted and counted in ``evictions``. Nothing read from the server is ever
unpickled or executed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from kvtier.keys import BlockKey
from kvtier.pool import HostPool
from kvtier.tiers.block_tier import Got, Put, Views
from kvtier.tiers.payload import HEADER_BYTES
from kvtier.tiers.redis import wire as redis_wire
from kvtier.tiers.redis.client import BlockValue, Client
from kvtier.tiers.redis.health import Count, Health
from kvtier.tiers.redis.keys import KeySpace
from kvtier.tiers.redis.options import Options
from kvtier.tiers.redis.presence import Presence, clock, present_until

log = logging.getLogger("kvtier.tiers.redis")

_Block = tuple[BlockKey, memoryview, memoryview]
"""A block to read: its key, its header buffer and its pool slot."""


@dataclass(frozen=True, slots=True)
class Parts:
    """What the parts of one tier share."""

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

    An error reply of one block goes to ``health.failed`` with no block counted (the skeleton
    counts the block's ``Put.FAILED`` / ``Got.FAILED``); a failed round trip raises."""

    def __init__(self, parts: Parts) -> None:
        self.options = parts.options
        self.pool = parts.pool
        self._keys = parts.keys
        self._presence = parts.presence
        self._health = parts.health
        self._count = parts.count
        self._report_evicted = parts.report_evicted
        self._wire = not parts.options.cluster
        """Standalone: blocks move on the socket directly (redis_wire); cluster: redis-py
        pipelines, which route each key to its node."""

    # -- blocks ---------------------------------------------------------------------------------

    def write(
        self,
        client: Client,
        lane: redis_wire.Lane,
        keys: Sequence[BlockKey],
        headers: Sequence[bytes],
        payloads: Views,
    ) -> list[Put]:
        """``SET`` each block (header and slot, ``PX`` with a TTL); a reply other than OK or an
        error reply fails the batch as a ``ProtocolError``."""
        ttl = self.options.ttl_ms
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
        out: list[Put] = []
        for key, reply in zip(keys, replies, strict=True):
            if isinstance(reply, Exception):
                self._health.failed(reply, 0)
                self._presence.forget([key])
                out.append(Put.FAILED)
            elif reply is True or reply == b"OK" or reply == "OK":
                self._presence.set(key, True, until)
                out.append(Put.STORED)
            else:
                # SET answers OK or an error, nothing else: the batch fails as a protocol error.
                raise redis_wire.ProtocolError(f"SET answered {str(reply)[:60]!r}")
        return out

    def read(
        self,
        client: Client,
        lane: redis_wire.Lane,
        keys: Sequence[BlockKey],
        headers: Views,
        payloads: Views,
    ) -> list[Got]:
        """``GET`` (``GETEX`` to restart a TTL) each block into its header buffer and slot."""
        ttl = self.options.ttl_ms if self.options.ttl_touch_on_read else None
        rkeys = [self._keys.redis_key(key) for key in keys]
        blocks = list(zip(keys, headers, payloads, strict=True))
        if self._wire:
            out = self._read_wire(client, lane, blocks, redis_wire.get_command(rkeys, ttl))
        else:
            out = self._read_pipeline(client, blocks, rkeys, ttl)
        # Believed present from now on; a value the skeleton finds corrupt is deleted, which
        # makes it absent again.
        until = present_until(self.options.ttl_s)
        for key, got in zip(keys, out, strict=True):
            if got is Got.FOUND:
                self._presence.set(key, True, until)
        return out

    def _read_wire(
        self, client: Client, lane: redis_wire.Lane, blocks: list[_Block], command: bytes
    ) -> list[Got]:
        """Standalone: each value's header into its buffer, its payload straight into the slot
        (``recv_into``)."""
        out: list[Got] = []
        with lane.on(client) as wire:
            wire.send([command])
            for key, header, payload in blocks:
                got = wire.block(header, payload)
                out.append(Got.FOUND if got is redis_wire.Got.VALUE else self._not_read(key, got))
                if got is redis_wire.Got.TOO_BIG:
                    # Its bytes were not read: the replies after it cannot be either.
                    out += [Got.FAILED] * (len(blocks) - len(out))
                    break
        return out

    def _read_pipeline(
        self, client: Client, blocks: list[_Block], rkeys: list[bytes], ttl: int | None
    ) -> list[Got]:
        """Cluster: redis-py's pipeline, each value copied once into its buffers."""
        pipe = client.pipeline(transaction=False)
        for rkey in rkeys:
            if ttl is None:
                pipe.execute_command("GET", rkey)
            else:
                pipe.execute_command("GETEX", rkey, "PX", ttl)
        replies = pipe.execute(raise_on_error=False)
        out: list[Got] = []
        for (key, header, payload), reply in zip(blocks, replies, strict=True):
            if isinstance(reply, bytes) and len(reply) == self._keys.value_bytes:
                data = memoryview(reply)
                header[:] = data[:HEADER_BYTES]
                payload[:] = data[HEADER_BYTES:]  # the one unavoidable copy here
                out.append(Got.FOUND)
            elif isinstance(reply, bytes):
                out.append(self._not_read(key, redis_wire.Got.WRONG_SIZE))
            elif reply is None:
                out.append(self._not_read(key, redis_wire.Got.MISSING))
            else:
                out.append(self._not_read(key, reply))
        return out

    def _not_read(self, key: BlockKey, outcome: Any) -> Got:
        """A read that found no usable value: missing, not a block of ours, or an error."""
        if outcome is redis_wire.Got.MISSING:
            # The server dropped it (TTL, maxmemory) or never had it: a miss, not an error.
            self._presence.set(key, False, clock() + self.options.negative_cache_s)
            self._report_evicted(key)
            self._count(evictions=1)
            return Got.MISSING
        if (
            outcome in (redis_wire.Got.WRONG_SIZE, redis_wire.Got.TOO_BIG)
            or not isinstance(outcome, BaseException)
            or (isinstance(outcome, ResponseError) and str(outcome).startswith("WRONGTYPE"))
        ):
            # Not a block of ours: another size, or a list, hash, set... at a kvtier key.
            return Got.DAMAGED
        self._health.failed(outcome, 0)
        return Got.FAILED

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
