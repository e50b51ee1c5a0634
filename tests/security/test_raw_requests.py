"""A push chunk parsed with its payload left unparsed (security/wire.py ``decode_cut``) reads
exactly as the whole parse reads it, for every byte string: same fields, same payload, same
refusals; and the payload it gives is a view of the received bytes, not a copy."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from geodiloco.security.raw_requests import CutMessage, MalformedRequest, cut_field, decode, decode_cut
from geodiloco.v1 import outer_sync_pb2

DeltaChunk = outer_sync_pb2.DeltaChunk
PAYLOAD = DeltaChunk.PAYLOAD_FIELD_NUMBER
FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def chunk(payload: bytes = b"") -> bytes:
    msg = DeltaChunk(tokens=7, total_chunks=3, part=1, parts=2, payload=payload)
    msg.header.site, msg.header.round, msg.header.seq, msg.header.numel = "site-a", 4, 2, 1000
    msg.header.nonce = b"\x01" * 12
    return msg.SerializeToString()


def same(parsed: object, data: bytes) -> None:
    """``parsed`` reads as the whole parse of ``data``: every field, the payload included."""
    whole = DeltaChunk.FromString(data)
    assert bytes(parsed.payload) == whole.payload  # type: ignore[attr-defined]
    rest = parsed.message if isinstance(parsed, CutMessage) else parsed
    assert isinstance(rest, DeltaChunk)
    trimmed = DeltaChunk()
    trimmed.CopyFrom(whole)
    trimmed.ClearField("payload")
    if isinstance(parsed, CutMessage):
        assert rest == trimmed
    else:
        assert rest == whole


def test_the_payload_is_a_view_of_the_received_bytes() -> None:
    payload = os.urandom(1 << 20)
    data = chunk(payload)
    parsed = decode_cut(DeltaChunk, data)
    assert isinstance(parsed, CutMessage) and isinstance(parsed.payload, memoryview)
    assert parsed.payload.obj is data  # no copy of the megabyte
    assert parsed.payload == payload and not parsed.message.payload
    assert parsed.header.site == "site-a" and parsed.tokens == 7 and parsed.parts == 2
    same(parsed, data)


@pytest.mark.parametrize("where", ["first", "middle", "twice"])
def test_any_field_order_and_a_repeated_payload_read_as_a_parser_reads_them(where: str) -> None:
    head = DeltaChunk(tokens=9, total_chunks=5)
    head.header.site = "site-b"
    field = lambda p: bytes([PAYLOAD << 3 | 2, len(p)]) + p  # noqa: E731
    tail = DeltaChunk(part=3, parts=4).SerializeToString()
    if where == "first":
        data = field(b"abc") + head.SerializeToString() + tail
    elif where == "middle":
        data = head.SerializeToString() + field(b"abc") + tail
    else:  # the last value wins
        data = field(b"old") + head.SerializeToString() + field(b"abc") + tail
    parsed = decode_cut(DeltaChunk, data)
    assert isinstance(parsed, CutMessage) and parsed.payload == b"abc"
    assert (parsed.tokens, parsed.part, parsed.header.site) == (9, 3, "site-b")
    same(parsed, data)


def test_no_payload_or_bytes_that_do_not_scan_take_the_whole_parse() -> None:
    empty = chunk()
    assert cut_field(empty, PAYLOAD) is None
    assert not isinstance(decode_cut(DeltaChunk, empty), CutMessage)
    cut = chunk(b"x" * 300)[:-10]  # the payload runs past the end
    assert cut_field(cut, PAYLOAD) is None
    with pytest.raises(MalformedRequest, match="malformed DeltaChunk"):
        decode_cut(DeltaChunk, cut)
    with pytest.raises(MalformedRequest):
        decode_cut(DeltaChunk, b"\xff" * 11)  # a varint longer than any


def reads_as_the_whole_parse(data: bytes) -> None:
    """The cut parse refuses exactly what the whole parse refuses, and reads the same message
    from the rest."""
    try:
        decode(DeltaChunk, data)
    except MalformedRequest:
        with pytest.raises(MalformedRequest):
            decode_cut(DeltaChunk, data)
        return
    same(decode_cut(DeltaChunk, data), data)


@FUZZ
@given(st.binary(max_size=400), st.integers(0, 399), st.binary(max_size=8))
def test_any_bytes_read_as_the_whole_parse_reads_them(payload: bytes, at: int, noise: bytes) -> None:
    """Bytes of a real chunk with a span overwritten."""
    data = bytearray(chunk(payload))
    data[at : at + len(noise)] = noise
    reads_as_the_whole_parse(bytes(data))


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_read_as_the_whole_parse_reads_them(data: bytes) -> None:
    reads_as_the_whole_parse(data)
