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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from kvtier.errors import ConfigError
from kvtier.keys import BlockKey

log = logging.getLogger(__name__)

FIELD = "vllm.trace_path"


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
    """The trace's salt file, created (exclusively, 0600) when missing. A salt written for
    another block size is refused: the ids of the two would not describe the same blocks."""
    path = salt_path(trace)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return _read_salt(path, block_tokens)
    except OSError as exc:
        raise ConfigError(FIELD, str(trace), f"a writable path ({path}: {exc.strerror})") from exc
    salt = TraceSalt(secrets.token_bytes(16), now_ms, block_tokens)
    record = {"salt": salt.salt.hex(), "origin_ms": now_ms, "block_tokens": block_tokens}
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    return salt


def _read_salt(path: Path, block_tokens: int) -> TraceSalt:
    try:
        data = json.loads(path.read_text())
        salt = TraceSalt(
            bytes.fromhex(data["salt"]), int(data["origin_ms"]), int(data["block_tokens"])
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(FIELD, str(path), f"a salt file this recorder wrote ({exc})") from exc
    if salt.block_tokens != block_tokens:
        raise ConfigError(
            FIELD,
            str(path),
            f"a trace of {block_tokens}-token blocks (this one has {salt.block_tokens}-token "
            "blocks: use another file)",
        )
    return salt


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
        self.salt = load_or_create_salt(self.path, block_tokens, self._now_ms())
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise ConfigError(FIELD, str(self.path), f"a writable file ({exc.strerror})") from exc
        self._file: TextIO | None = os.fdopen(fd, "a", buffering=1)  # a line at a time
        self._seen: set[str] = set()
        self.recorded = 0

    def _now_ms(self) -> int:
        return int(self._clock() * 1000)

    def record(self, request: Any, keys: Sequence[BlockKey]) -> None:
        """Write the request's line unless it was written already. Never raises: a failed write
        is logged and ends the recording (the engine goes on)."""
        req_id = request.request_id
        if self._file is None or req_id in self._seen:
            return
        self._seen.add(req_id)
        prompt = int(request.num_prompt_tokens)
        full = keys[: prompt // self.block_tokens]
        line = {
            "timestamp": max(self._now_ms() - self.salt.origin_ms, 0),
            "input_length": prompt,
            "output_length": int(getattr(request, "max_tokens", 0) or 0),
            "hash_ids": [self.salt.block_id(key) for key in full],
        }
        try:
            self._file.write(json.dumps(line) + "\n")
        except (OSError, ValueError) as exc:
            log.error("kvtier trace %s: cannot write (%s); recording stopped", self.path, exc)
            self.close()
            return
        self.recorded += 1

    def forget(self, req_id: str) -> None:
        """The request finished: its id may be reused."""
        self._seen.discard(req_id)

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                log.exception("kvtier trace %s: close failed", self.path)
            self._file = None
