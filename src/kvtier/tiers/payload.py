"""The self-describing header that every block carries outside the process.

Layout (64 bytes, little-endian): magic ``KVTB``, format version (u16), flags (u16), namespace
digest (16 bytes), block key (16), payload length (u64), XXH3-128 checksum of the payload (16).
A reader checks all of it before a block becomes visible; any mismatch is a miss.
"""

from __future__ import annotations

import struct

import xxhash

from kvtier.keys import FORMAT_VERSION, BlockKey

MAGIC = b"KVTB"
HEADER = struct.Struct("<4sHH16s16sQ16s")
HEADER_BYTES = HEADER.size
KNOWN_FLAGS = 0
"""Flag bits this version understands; a header with any other bit set (say, a compressed payload
written by a newer kvtier) is rejected rather than misread."""


def checksum(payload: bytes | memoryview) -> bytes:
    return xxhash.xxh3_128_digest(payload)


def encode_header(namespace_digest: bytes, key: BlockKey, payload: bytes | memoryview) -> bytes:
    return HEADER.pack(
        MAGIC, FORMAT_VERSION, 0, namespace_digest, key, len(payload), checksum(payload)
    )


def header_matches(
    header: bytes | memoryview, namespace_digest: bytes, key: BlockKey, length: int
) -> bool:
    """True when ``header`` is a valid header for this namespace, key and payload length.

    The checksum is not checked here (see ``payload_matches``); this lets a reader reject a wrong
    file before reading its payload.
    """
    if len(header) != HEADER_BYTES:
        return False
    magic, version, flags, ns, stored_key, stored_len, _sum = HEADER.unpack(header)
    return bool(
        magic == MAGIC
        and version == FORMAT_VERSION
        and flags & ~KNOWN_FLAGS == 0
        and ns == namespace_digest
        and stored_key == key
        and stored_len == length
    )


def payload_matches(header: bytes | memoryview, payload: bytes | memoryview) -> bool:
    """True when the payload's checksum equals the one in an already-matched header."""
    return bool(HEADER.unpack(header)[6] == checksum(payload))


def block_matches(
    header: bytes | memoryview, namespace_digest: bytes, key: BlockKey, payload: bytes | memoryview
) -> bool:
    """The whole check of a block read back: its header is this namespace's, key's and payload
    length's, and the payload's checksum is the header's."""
    return header_matches(header, namespace_digest, key, len(payload)) and payload_matches(
        header, payload
    )
