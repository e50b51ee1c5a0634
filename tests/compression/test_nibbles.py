"""The nibble split in front of zstd for int8 codes: exact, the same bytes with or without the
C kernel, as small as zstd over whole codes, and strict about what a frame holds."""

from __future__ import annotations

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from geodiloco.compression import CodecError, envelope, nibbles, parse_pipeline


def test_the_kernel_is_built() -> None:
    assert nibbles._kernels is not None


def _split_join(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    hi, lo = nibbles.split(codes)
    out = torch.empty_like(codes)
    nibbles.join(bytes(hi.numpy()), bytes(lo.numpy()), out)
    return hi, lo, out


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=3000))
def test_split_then_join_is_exact_and_the_paths_agree(data: bytes) -> None:
    codes = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    )
    fused = _split_join(codes)
    kernels, nibbles._kernels = nibbles._kernels, None
    try:
        reference = _split_join(codes)
    finally:
        nibbles._kernels = kernels
    for a, b in zip(fused, reference, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(fused[2], codes)
    assert fused[0].numel() == fused[1].numel() == (len(data) + 1) // 2


def test_the_layout_is_two_elements_per_byte() -> None:
    hi, lo = nibbles.split(torch.tensor([0x12, 0x34, 0xAB], dtype=torch.uint8))
    assert hi.tolist() == [0x31, 0x0A] and lo.tolist() == [0x42, 0x0B]


def test_q8_zstd_frames_are_the_same_without_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.randn(4097, generator=torch.Generator().manual_seed(5))
    pipeline = parse_pipeline("q8|zstd:1")
    fused = pipeline.encode(x)
    monkeypatch.setattr(nibbles, "_kernels", None)
    data, y = pipeline.roundtrip(x)
    assert data == fused
    assert torch.equal(y, parse_pipeline("q8").roundtrip(x)[1])


def test_zstd_over_high_nibbles_is_as_small_as_over_whole_codes() -> None:
    x = torch.randn(1 << 18, generator=torch.Generator().manual_seed(0))
    raw = parse_pipeline("q8").values.encode(x)
    whole = len(zstandard.ZstdCompressor(level=1).compress(raw.numpy().tobytes()))
    split = len(parse_pipeline("q8|zstd:1").encode(x)) - envelope.HEADER_SIZE
    assert whole < split < whole * 1.005
    assert split < raw.numel() / 1.05  # and it still gains the ~1.06x of Gaussian codes


def test_a_body_shorter_than_its_stored_part_is_refused() -> None:
    pipeline = parse_pipeline("q8|zstd:1")
    with pytest.raises(CodecError, match="shorter than its 532 stored"):
        pipeline.decode(envelope.seal(pipeline.tag, 1000, b"\0" * 100), 1000)
