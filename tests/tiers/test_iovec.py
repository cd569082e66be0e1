from __future__ import annotations

from kvtier.tiers.iovec import advance


def test_advance_drops_whole_and_partial_buffers() -> None:
    pending = [memoryview(b"abc"), memoryview(b"defg"), memoryview(b"hi")]
    advance(pending, 5)  # all of "abc", "de" of the second
    assert [bytes(v) for v in pending] == [b"fg", b"hi"]
    advance(pending, 2)
    assert [bytes(v) for v in pending] == [b"hi"]
    advance(pending, 0)
    assert [bytes(v) for v in pending] == [b"hi"]
    advance(pending, 2)
    assert pending == []
