import pytest
import torch
import zstandard

from geodiloco.compression import CodecError, parse_pipeline
from geodiloco.compression.quantize import BlockwiseInt8


@pytest.mark.parametrize("numel", [1, 127, 128, 1000, 65_537])
def test_int8_zstd_roundtrip_within_stated_bound(numel: int) -> None:
    torch.manual_seed(numel)
    x = torch.randn(numel) * torch.logspace(-4, 1, numel)  # blocks of very different scales
    pipeline = parse_pipeline("q8:128|zstd:3")
    data = pipeline.encode(x)
    y = pipeline.decode(data, numel)
    assert y.shape == x.shape and y.dtype == torch.float32
    blocks = torch.nn.functional.pad(x, (0, (-numel) % 128)).view(-1, 128)
    bound = (blocks.abs().amax(dim=1) / 254).repeat_interleave(128)[:numel]
    assert bool(((x - y).abs() <= bound * (1 + 1e-6) + 1e-12).all())
    assert len(data) <= BlockwiseInt8(128).encoded_size(numel) + 64


def test_int8_bits_per_param_is_stated() -> None:
    assert parse_pipeline("q8:128").bits_per_param(1 << 20) == pytest.approx(8.25)
    assert parse_pipeline("q8:256|zstd:1").bits_per_param(1 << 20) == pytest.approx(8.125)


def test_zero_tensor_roundtrips_exactly() -> None:
    pipeline = parse_pipeline("q8|zstd:3")
    assert torch.equal(pipeline.decode(pipeline.encode(torch.zeros(300)), 300), torch.zeros(300))


def test_decoding_is_deterministic_bitwise() -> None:
    x = torch.randn(10_000)
    pipeline = parse_pipeline("q8|zstd:3")
    data = pipeline.encode(x)
    assert torch.equal(pipeline.decode(data, 10_000), pipeline.decode(data, 10_000))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_is_refused(bad: float) -> None:
    x = torch.randn(100)
    x[17] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        parse_pipeline("q8|zstd:3").encode(x)


def test_truncated_and_corrupted_payloads_raise() -> None:
    pipeline = parse_pipeline("q8|zstd:3")
    data = pipeline.encode(torch.randn(5000))
    with pytest.raises(CodecError):
        pipeline.decode(data[: len(data) // 2], 5000)
    with pytest.raises(CodecError):
        pipeline.decode(data, 4999)  # mislabelled element count
    corrupted = bytearray(data)
    corrupted[len(corrupted) // 2] ^= 0xFF
    corrupted[10] ^= 0xFF
    with pytest.raises(CodecError):
        pipeline.decode(bytes(corrupted), 5000)


def test_raw_int8_rejects_bad_scales() -> None:
    codec = BlockwiseInt8(4)
    data = bytearray(codec.encode(torch.randn(8)))
    data[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(CodecError, match="scale"):
        codec.decode(bytes(data), 8)


def test_zstd_decompression_bomb_is_refused() -> None:
    bomb = zstandard.ZstdCompressor(level=1).compress(b"\0" * (64 << 20))  # 64 MiB of zeros
    assert len(bomb) < 1 << 16
    with pytest.raises(CodecError, match="declares"):
        parse_pipeline("q8|zstd").decode(bomb, 1000)


def test_unknown_stage_lists_known_ones() -> None:
    with pytest.raises(CodecError, match="known: fp32, q8"):
        parse_pipeline("q3|zstd")
    with pytest.raises(CodecError, match="known: zstd"):
        parse_pipeline("q8|gzip")
    with pytest.raises(CodecError, match="bad argument"):
        parse_pipeline("q8:abc")
