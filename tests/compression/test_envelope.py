import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geodiloco.compression import CodecError, parse_pipeline
from geodiloco.compression.envelope import HEADER_SIZE

SPECS = ["fp32", "q8", "q8|zstd:3", "q4:64", "q2|zstd:1", "fp4", "nf4:32", "topk:0.05|q2|zstd:3", "bf16"]


@settings(max_examples=60, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    numel=st.integers(1, 3000),
    position=st.floats(0, 1),
    mask=st.integers(1, 255),
)
def test_any_flipped_byte_is_a_clear_error(spec: str, numel: int, position: float, mask: int) -> None:
    pipeline = parse_pipeline(spec)
    data = bytearray(pipeline.encode(torch.randn(numel)))
    data[min(int(position * len(data)), len(data) - 1)] ^= mask
    with pytest.raises(CodecError, match=r"checksum|magic|version|flags|another codec|elements"):
        pipeline.decode(bytes(data), numel)


@settings(max_examples=40, deadline=None)
@given(spec=st.sampled_from(SPECS), numel=st.integers(0, 3000), keep=st.floats(0, 1, exclude_max=True))
def test_truncated_frames_are_a_clear_error(spec: str, numel: int, keep: float) -> None:
    pipeline = parse_pipeline(spec)
    data = pipeline.encode(torch.randn(numel))
    with pytest.raises(CodecError, match=r"truncated|checksum"):
        pipeline.decode(data[: int(keep * len(data))], numel)


def test_mislabelled_frames_are_a_clear_error() -> None:
    x = torch.randn(1000)
    data = parse_pipeline("q8|zstd:3").encode(x)
    with pytest.raises(CodecError, match="another codec pipeline"):
        parse_pipeline("q4|zstd:3").decode(data, 1000)
    with pytest.raises(CodecError, match="holds 1000 elements, the receiver expects 999"):
        parse_pipeline("q8|zstd:3").decode(data, 999)
    with pytest.raises(CodecError, match="magic"):
        parse_pipeline("q8|zstd:3").decode(b"\0" * 40, 1000)
    assert len(data) > HEADER_SIZE


def test_an_extended_frame_is_refused() -> None:
    pipeline = parse_pipeline("q8")
    data = pipeline.encode(torch.randn(100))
    with pytest.raises(CodecError, match="checksum"):
        pipeline.decode(data + b"\0", 100)
