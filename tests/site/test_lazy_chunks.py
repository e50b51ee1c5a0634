"""LazyChunks: the sequence protocol over ``chunk(i)`` that the push stream and retries use."""

from __future__ import annotations

import pytest

from geodiloco.exchange import LazyChunks, WireChunk
from geodiloco.segment import Segment


class Counted(LazyChunks):
    def __init__(self, n: int) -> None:
        self.n = n
        self.made: list[int] = []

    def __len__(self) -> int:
        return self.n

    def chunk(self, i: int) -> WireChunk:
        self.made.append(i)
        return WireChunk(Segment(i, 1, 1, 1), bytes([i]))


def test_chunks_are_made_when_taken_and_indexed_like_a_sequence() -> None:
    seq = Counted(4)
    it = iter(seq)
    assert seq.made == []
    assert next(it).payload == b"\x00" and seq.made == [0]
    assert [c.payload for c in seq[1:3]] == [b"\x01", b"\x02"]
    assert seq[-1].segment.start == 3
    assert [c.payload for c in seq] == [bytes([i]) for i in range(4)]
    for bad in (4, -5):
        with pytest.raises(IndexError):
            seq[bad]
