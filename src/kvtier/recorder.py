"""A recorder of live traffic: every request an engine looks up, as a line of a Mooncake-format
trace that ``kvtier simulate --trace`` replays.

One JSON object per line: ``timestamp`` (milliseconds since the trace's first request),
``input_length`` (prompt tokens), ``output_length`` (the request's ``max_tokens``: the line is
written at the lookup, before generation) and ``hash_ids``: one id per full prompt block of
kvtier (``block_tokens`` tokens each, not Mooncake's 512). An id is a keyed BLAKE2b digest of the
block's kvtier key with a random per-file salt, so equal prefixes get equal ids while neither the
tokens nor the keys can be recovered or matched against another trace. The salt lives next to the
trace in ``<trace>.salt`` (mode 0600, with the time origin and the block size), so an engine
restarted on the same file goes on with the same ids, as a persistent tier keeps the same blocks.

Both files are opened through :mod:`kvtier.safe_files`: a FIFO, device or symbolic link at either
name is a ``ConfigError`` (never a blocked engine), and the salt is created whole or not at all. A
write that fails for want of room (a full disk, a quota) stops the recording with one logged error;
the engine goes on.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import math
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.safe_files import create_new, open_append, read_text
from kvtier.sim.trace import TRACE_LINE_MAX_BYTES
from kvtier.validation import INT64_MAX

log = logging.getLogger(__name__)

FIELD = "vllm.trace_path"
SALT_MAX_BYTES = 4096
"""A salt file is under 100 bytes; a larger one is not one this recorder wrote."""
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})
"""Write failures of the disk, not of the config: recording stops, the engine goes on."""


class NoRoom(OSError):
    """A trace file could not be written for want of room (``NO_ROOM``)."""


@dataclass(frozen=True, slots=True)
class TraceSalt:
    salt: bytes
    origin_ms: int
    """Wall-clock milliseconds of the trace's time 0."""
    block_tokens: int

    def block_id(self, key: BlockKey) -> int:
        digest = hashlib.blake2b(key, key=self.salt, digest_size=8).digest()
        return int.from_bytes(digest, "big") >> 1  # 63 bits: a non-negative int64 everywhere


def salt_path(trace: Path) -> Path:
    return trace.with_name(trace.name + ".salt")


def load_or_create_salt(trace: Path, block_tokens: int, now_ms: int) -> TraceSalt:
    """The trace's salt file, created (whole or not at all, 0600) when missing. A salt written
    for another block size is refused: the ids of the two would not describe the same blocks.
    ``NoRoom`` where the disk has no room for it, ``ConfigError`` for any other failure."""
    path = salt_path(trace)
    salt = TraceSalt(secrets.token_bytes(16), now_ms, block_tokens)
    record = {"salt": salt.salt.hex(), "origin_ms": now_ms, "block_tokens": block_tokens}
    try:
        create_new(path, json.dumps(record).encode(), SALT_MAX_BYTES)
    except FileExistsError:
        return _read_salt(path, block_tokens)
    except OSError as exc:
        raise _open_error(trace, path, exc) from exc
    return salt


def _open_error(trace: Path, path: Path, exc: OSError) -> Exception:
    if exc.errno in NO_ROOM:
        return NoRoom(exc.errno, exc.strerror, str(path))
    return ConfigError(FIELD, str(trace), f"a writable path ({path}: {exc.strerror or exc})")


def _read_salt(path: Path, block_tokens: int) -> TraceSalt:
    try:
        data = json.loads(read_text(path, SALT_MAX_BYTES))
        salt = TraceSalt(
            bytes.fromhex(data["salt"]), int(data["origin_ms"]), int(data["block_tokens"])
        )
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError(FIELD, str(path), f"a salt file this recorder wrote ({reason})") from exc
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
        raise ConfigError(FIELD, str(path), f"a salt file this recorder wrote ({exc})") from exc
    if salt.block_tokens != block_tokens:
        raise ConfigError(
            FIELD,
            str(path),
            f"a trace of {block_tokens}-token blocks (this one has {salt.block_tokens}-token "
            "blocks: use another file)",
        )
    return salt


def _count(value: object) -> int | None:
    """A token count the engine gave, or None where it is not a whole number of 0 to 2**63-1
    (NaN, infinite, fractional, None, a string)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
        return None
    return int(value) if 0 <= value <= INT64_MAX else None


class TraceRecorder:
    """Appends one trace line per request (the first time it is looked up)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        block_tokens: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path)
        self.block_tokens = block_tokens
        self._clock = clock
        self.salt: TraceSalt | None = None
        self._file: TextIO | None = None
        try:
            self.salt = load_or_create_salt(self.path, block_tokens, self._now_ms())
            try:
                fd = open_append(self.path)
            except OSError as exc:
                raise _open_error(self.path, self.path, exc) from exc
        except NoRoom as exc:
            log.error("kvtier trace %s: cannot start (%s); not recording", exc.filename, exc)
        else:
            self._file = os.fdopen(fd, "a", buffering=1)  # a line at a time
        self._seen: set[str] = set()
        self.recorded = 0

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def record(self, request: Any, keys: Sequence[BlockKey]) -> None:
        """Write the request's line unless it was written already. Never raises: odd fields
        are recorded as what the keys say (a prompt count) or 0 (an output count), a failed
        write is logged and ends the recording (the engine goes on)."""
        if self._file is None or self.salt is None:
            return
        req_id = str(getattr(request, "request_id", ""))
        if req_id in self._seen:
            return
        self._seen.add(req_id)
        prompt = _count(getattr(request, "num_prompt_tokens", None))
        if prompt is None:  # the keys are the full blocks of the prompt so far
            prompt = len(keys) * self.block_tokens
        full = keys[: prompt // self.block_tokens]
        line = {
            "timestamp": max(self._now_ms() - self.salt.origin_ms, 0),
            "input_length": prompt,
            "output_length": _count(getattr(request, "max_tokens", 0)) or 0,
            "hash_ids": [self.salt.block_id(key) for key in full],
        }
        text = json.dumps(line) + "\n"
        if len(text) > TRACE_LINE_MAX_BYTES:  # more than any replay reads: not written
            log.warning("kvtier trace %s: request %.64r too long to record", self.path, req_id)
            return
        try:
            self._file.write(text)
        except (OSError, ValueError) as exc:
            log.error("kvtier trace %s: cannot write (%s); recording stopped", self.path, exc)
            self.close()
            return
        self.recorded += 1

    def forget(self, req_id: str) -> None:
        """The request finished: its id may be reused."""
        self._seen.discard(str(req_id))

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                log.exception("kvtier trace %s: close failed", self.path)
            self._file = None
