from __future__ import annotations

import struct

import pytest
from support.blocks import make_key, payload_for

from kvtier.keys import FORMAT_VERSION, Namespace
from kvtier.tiers.payload import (
    HEADER,
    HEADER_BYTES,
    MAGIC,
    checksum,
    encode_header,
    header_matches,
    payload_matches,
)

KEY = make_key(1)
PAYLOAD = payload_for(KEY, 5000)


@pytest.fixture
def digest(namespace: Namespace) -> bytes:
    return namespace.digest


def test_layout_is_64_bytes_little_endian(digest: bytes) -> None:
    header = encode_header(digest, KEY, PAYLOAD)
    assert HEADER_BYTES == 64 and len(header) == 64
    assert header[:4] == MAGIC
    assert struct.unpack_from("<H", header, 4)[0] == FORMAT_VERSION
    assert struct.unpack_from("<H", header, 6)[0] == 0
    assert header[8:24] == digest
    assert header[24:40] == KEY
    assert struct.unpack_from("<Q", header, 40)[0] == len(PAYLOAD)
    assert header[48:64] == checksum(PAYLOAD)


def test_round_trip_matches(digest: bytes) -> None:
    header = encode_header(digest, KEY, memoryview(PAYLOAD))
    assert header_matches(header, digest, KEY, len(PAYLOAD))
    assert header_matches(memoryview(header), digest, KEY, len(PAYLOAD))
    assert payload_matches(header, PAYLOAD)
    assert payload_matches(header, memoryview(PAYLOAD))


def test_wrong_namespace_key_or_length(digest: bytes, other_namespace: Namespace) -> None:
    header = encode_header(digest, KEY, PAYLOAD)
    assert not header_matches(header, other_namespace.digest, KEY, len(PAYLOAD))
    assert not header_matches(header, digest, make_key(2), len(PAYLOAD))
    assert not header_matches(header, digest, KEY, len(PAYLOAD) + 1)


@pytest.mark.parametrize(
    "offset",
    [0, 3, 4, 5, 6, 7, 8, 23, 24, 39, 40, 47],
    ids=lambda o: f"byte{o}",
)
def test_every_flipped_header_byte_is_rejected(digest: bytes, offset: int) -> None:
    header = bytearray(encode_header(digest, KEY, PAYLOAD))
    header[offset] ^= 0x01
    assert not header_matches(bytes(header), digest, KEY, len(PAYLOAD))


@pytest.mark.parametrize("offset", [48, 55, 63])
def test_flipped_checksum_byte_fails_payload_check(digest: bytes, offset: int) -> None:
    header = bytearray(encode_header(digest, KEY, PAYLOAD))
    header[offset] ^= 0x80
    assert header_matches(bytes(header), digest, KEY, len(PAYLOAD))  # checked later, by design
    assert not payload_matches(bytes(header), PAYLOAD)


@pytest.mark.parametrize("offset", [0, 2500, 4999])
def test_flipped_payload_byte_fails(digest: bytes, offset: int) -> None:
    header = encode_header(digest, KEY, PAYLOAD)
    damaged = bytearray(PAYLOAD)
    damaged[offset] ^= 0x01
    assert not payload_matches(header, bytes(damaged))


def test_unknown_flag_bits_are_rejected(digest: bytes) -> None:
    # A newer writer's flag (say, compression) must not be misread as a plain payload.
    fields = list(HEADER.unpack(encode_header(digest, KEY, PAYLOAD)))
    fields[2] = 1
    assert not header_matches(HEADER.pack(*fields), digest, KEY, len(PAYLOAD))


@pytest.mark.parametrize("size", [0, 1, 63, 65])
def test_header_of_wrong_size_is_rejected(digest: bytes, size: int) -> None:
    header = (encode_header(digest, KEY, PAYLOAD) * 2)[:size]
    assert not header_matches(header, digest, KEY, len(PAYLOAD))


def test_empty_payload(digest: bytes) -> None:
    header = encode_header(digest, KEY, b"")
    assert header_matches(header, digest, KEY, 0)
    assert payload_matches(header, b"")
    assert not payload_matches(header, b"\0")
