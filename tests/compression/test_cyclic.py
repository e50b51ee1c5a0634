import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geodiloco.compression import (
    CodecError,
    Place,
    decode_chunks_into,
    encode_chunks,
    envelope,
    parse_pipeline,
)
from geodiloco.compression.cyclic import Cyclic
from geodiloco.segment import Segment


def kept(fraction: float, place: Place) -> torch.Tensor:
    """Canonical indices kept at ``place``."""
    return place.segment.positions()[Cyclic(fraction).select(place, place.segment.numel)]


@pytest.mark.parametrize("fraction", [0.5, 0.25, 0.1])
def test_every_element_gets_its_turn_once_every_one_over_f_rounds(fraction: float) -> None:
    period = round(1 / fraction)
    for first in (0, 17):
        turns = torch.zeros(5000, dtype=torch.int64)
        for r in range(first, first + period):
            turns[kept(fraction, Place.span(r, 0, 5000))] += 1
        assert bool((turns == 1).all())


def test_turns_are_at_most_ceil_one_over_f_rounds_apart() -> None:
    last = torch.full((3000,), -1, dtype=torch.int64)
    gaps = []
    for r in range(30):
        idx = kept(0.4, Place.span(r, 1000, 3000)) - 1000
        gaps.append(r - last[idx][last[idx] >= 0])
        last[idx] = r
    assert bool((last >= 27).all())
    assert set(torch.cat(gaps).tolist()) == {2, 3}


def test_the_set_depends_on_canonical_indices_not_on_how_chunks_are_cut() -> None:
    # a 40 x 30 matrix: the whole of it, a column shard (strided rows), and contiguous chunks
    whole = set(kept(0.3, Place.span(9, 500, 1200)).tolist())
    left = set(kept(0.3, Place(9, Segment(500, 40, 12, 30))).tolist())
    right = set(kept(0.3, Place(9, Segment(512, 40, 18, 30))).tolist())
    pieces = set().union(*(kept(0.3, Place.span(9, 500 + a, 100)).tolist() for a in range(0, 1200, 100)))
    assert left | right == whole == pieces and not left & right
    assert 0.25 < len(whole) / 1200 < 0.35


def test_an_average_of_updates_of_one_round_is_sent_whole_on_the_downlink() -> None:
    pipeline = parse_pipeline("cyclic:0.4")  # fp32 values: only the sparsifier loses anything
    gen = torch.Generator().manual_seed(1)
    ups = [pipeline.roundtrip(torch.randn(2000, generator=gen), Place.span(5, 0, 2000))[1] for _ in range(3)]
    mean = torch.stack(ups).mean(0)
    chunks, down = encode_chunks(pipeline, mean, 700, round_=5)
    assert torch.equal(down, mean)  # nothing dropped a second time
    out = torch.empty(2000)
    decode_chunks_into(pipeline, chunks, out, round_=5)
    assert torch.equal(out, mean)


def test_wrong_or_missing_place_is_a_clear_error() -> None:
    pipeline = parse_pipeline("cyclic:0.4|q2|zstd:1")
    x = torch.randn(1000)
    data = pipeline.encode(x, Place.span(3, 0, 1000))
    with pytest.raises(CodecError, match="encoded for round 3, decoded for 4"):
        pipeline.decode(data, 1000, Place.span(4, 0, 1000))
    with pytest.raises(CodecError, match="needs the chunk's round and place"):
        pipeline.encode(x)
    with pytest.raises(CodecError, match="needs the chunk's round and place"):
        pipeline.decode(data, 1000)
    with pytest.raises(CodecError, match="does not fit a chunk of 1000"):
        pipeline.encode(x, Place.span(3, 0, 999))
    with pytest.raises(CodecError, match="has no round"):
        pipeline.decode(envelope.seal(pipeline.tag, 0, b"abc"), 0, Place.span(0, 0, 0))


def test_a_frame_decoded_for_other_elements_of_the_same_size_is_refused() -> None:
    pipeline = parse_pipeline("cyclic:0.4|q2")
    column = Place(3, Segment(500, 40, 12, 30))  # a column shard of a 40 x 30 matrix
    data = pipeline.encode(torch.randn(480), column)
    with pytest.raises(CodecError, match="other elements than the 480 at 512"):
        pipeline.decode(data, 480, Place(3, Segment(512, 40, 12, 30)))
    # one set of elements, described two ways (a one-row strided segment is a contiguous span)
    row = pipeline.encode(torch.ones(12), Place(3, Segment(500, 1, 12, 30)))
    assert torch.equal(
        pipeline.decode(row, 12, Place.span(3, 500, 12)),
        pipeline.decode(row, 12, Place(3, Segment(500, 1, 12, 30))),
    )


def test_nan_is_refused_even_where_it_would_be_dropped() -> None:
    x = torch.zeros(100)
    x[1:] = float("nan")
    with pytest.raises(CodecError, match="NaN or Inf"):
        parse_pipeline("cyclic:0.01|q2").encode(x, Place.span(0, 0, 100))


@pytest.mark.parametrize(("spec", "bits"), [("cyclic:0.43|q2", 0.99), ("cyclic:0.46|q2:256", 0.99)])
def test_cyclic_two_bit_pipelines_are_under_one_bit_per_param(spec: str, bits: float) -> None:
    pipeline = parse_pipeline(spec)
    assert pipeline.bits_per_param(1 << 20) < bits
    x = torch.randn(1 << 18)
    for r in range(3):
        assert 8 * len(pipeline.encode(x, Place.span(r, 123, x.numel()))) / x.numel() < 1.0


@settings(max_examples=30, deadline=None)
@given(
    fraction=st.floats(0.01, 1.0),
    round_=st.integers(0, 2**40),
    start=st.integers(0, 2**40),
    numel=st.integers(0, 3000),
)
def test_the_count_stays_near_the_fraction(fraction: float, round_: int, start: int, numel: int) -> None:
    count = Cyclic(fraction).select(Place.span(round_, start, numel), numel).numel()
    assert abs(count - fraction * numel) <= 2 + 0.05 * numel
