import pytest
import torch
from codec_strategies import tensors
from hypothesis import given, settings
from hypothesis import strategies as st

from geodiloco.compression import CodecError, Place, known_stages, parse_pipeline
from geodiloco.compression.casts import FP16_MAX

LOSSY = [
    "fp16",
    "bf16",
    "q8",
    "q8:32|zstd:1",
    "q4",
    "q4:64:sr=3",
    "q2",
    "q2:32:sr",
    "fp4",
    "nf4:64",
    "lm2",
    "lm2:64|zstd:1",
    "topk:0.05|q2|zstd:3",
    "topk:0.1:256|q4",
    "topk:0.02",
    "cyclic:0.4|q2|zstd:1",
    "cyclic:0.1",
    "sign",
    "sign:7|zstd:1",
    "topk:0.05:64|sign:256",
    "cyclic:0.3|sign:16",
]


@settings(max_examples=40, deadline=None)
@given(
    spec=st.sampled_from(["fp32|zstd:1", *LOSSY]),
    x=tensors(),
    round_=st.integers(0, 2**40),
    start=st.integers(0, 2**40),
)
def test_roundtrip_is_within_the_stated_bound_and_deterministic(
    spec: str, x: torch.Tensor, round_: int, start: int
) -> None:
    pipeline = parse_pipeline(spec)
    place = Place.span(round_, start, x.numel())  # only cyclic uses it
    if spec == "fp16" and x.numel() and float(x.abs().max()) > FP16_MAX:
        with pytest.raises(CodecError, match="fp16 range"):
            pipeline.encode(x)
        return
    data, y = pipeline.roundtrip(x, place)
    assert y.shape == x.shape and y.dtype == torch.float32
    assert bool(((x - y).abs() <= pipeline.error_bound(x, place)).all())
    assert pipeline.encode(x.clone(), place) == data  # same input, same bytes
    assert torch.equal(pipeline.decode(data, x.numel(), place), y)  # what receivers get
    assert 8 * len(data) <= 8 * 64 + 8 * pipeline.raw_size(x.numel(), place) + 8 * 16


def test_canonical_spec_fills_in_defaults() -> None:
    assert parse_pipeline(" topk:0.05 | q2 | zstd ").canonical == "topk:0.05|q2:128|zstd:3"
    assert parse_pipeline("topk:0.1:256").canonical == "topk:0.1:256|fp32"
    assert parse_pipeline("q4:64:sr=9").canonical == "q4:64:sr=9"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("q3|zstd", "unknown codec stage 'q3'.*known: fp32, fp16, bf16, q8, q4, q2, fp4, nf4"),
        ("q8|gzip", "unknown codec stage 'gzip'.*topk, cyclic \\(sparsifier, first\\); zstd"),
        ("", "empty codec pipeline"),
        ("zstd", "no value codec"),
        ("q8|q4", "must be \\[sparsifier \\|\\] value codec"),
        ("q8|topk:0.1", "must be"),
        ("q8:1.5", "bad argument"),
        ("q8:abc", "unknown option"),
        ("q8:0", "block size"),
        ("q8:64:rounding=up", "unknown option"),
        ("topk", "needs a fraction"),
        ("topk:1.5|q2", "fraction must be in"),
        ("cyclic|q2", "cyclic needs a fraction"),
        ("cyclic:0|q2", "fraction must be in"),
        ("cyclic:0.4:0.5|q2", "at most 1 positional"),
        ("q8|zstd:99", "zstd level"),
    ],
)
def test_bad_specs_are_refused_clearly(spec: str, message: str) -> None:
    with pytest.raises(CodecError, match=message):
        parse_pipeline(spec)


def test_known_stages_cover_the_issue_codecs() -> None:
    assert set(known_stages()) >= {"fp32", "fp16", "bf16", "q8", "q4", "q2", "fp4", "topk", "zstd"}


def test_zstd_decompression_bomb_is_refused() -> None:
    import zstandard

    from geodiloco.compression import envelope

    bomb = zstandard.ZstdCompressor(level=1).compress(b"\0" * (64 << 20))  # 64 MiB of zeros
    # q4: zstd over the whole body; q8: over the high nibbles, after 532 stored bytes
    for spec, stored in [("q4|zstd", 0), ("q8|zstd", 4 * 8 + 500)]:
        pipeline = parse_pipeline(spec)
        frame = envelope.seal(pipeline.tag, 1000, b"\0" * stored + bomb)
        with pytest.raises(CodecError, match="declares"):
            pipeline.decode(frame, 1000)


@pytest.mark.parametrize(
    "spec", ["q8|zstd:1", "q4", "fp32|zstd:1", "fp32", "topk:0.1|q8", "cyclic:0.5|q2|zstd:1"]
)
def test_roundtrip_values_are_the_decoded_frame_and_never_alias_the_input(spec: str) -> None:
    """The CPU roundtrip decodes the encoder's raw bytes instead of the frame: the same values,
    in a tensor of their own (the commit subtracts them from the very tensor it encoded)."""
    pipeline = parse_pipeline(spec)
    x = torch.randn(5000) * 1e-2
    place = Place.span(2, 100, x.numel())
    data, values = pipeline.roundtrip(x, place)
    assert torch.equal(values.view(torch.int32), pipeline.decode(data, x.numel(), place).view(torch.int32))
    assert torch.equal(pipeline.decode_raw(pipeline.unpack(data, x.numel(), place), x.numel(), place), values)
    before = values.clone()
    x.sub_(values)
    assert torch.equal(values, before)


@pytest.mark.parametrize("spec", ["q8|zstd:1", "q8:32|zstd:3"])
def test_unpack_into_scratch_gives_the_same_bytes_in_the_scratch(spec: str) -> None:
    """A nibble-split frame (q8 with zstd) is joined into the scratch given (a receiver's reused
    buffer) where it fits, else into fresh memory: the same raw bytes either way."""
    pipeline, place = parse_pipeline(spec), Place.span(3, 0, 5000)
    frame = pipeline.encode(torch.randn(5000), place)
    fresh = pipeline.unpack(frame, 5000, place)
    scratch = torch.full((fresh.numel() + 7,), 0xAB, dtype=torch.uint8)
    joined = pipeline.unpack(frame, 5000, place, scratch)
    assert torch.equal(joined, fresh)
    assert joined.data_ptr() == scratch.data_ptr()
    small = torch.zeros(fresh.numel() - 1, dtype=torch.uint8)
    assert torch.equal(pipeline.unpack(frame, 5000, place, small), fresh)
    assert torch.equal(small, torch.zeros_like(small))  # too small: left alone
