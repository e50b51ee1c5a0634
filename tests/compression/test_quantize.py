import pytest
import torch

from geodiloco.compression import CodecError, parse_pipeline
from geodiloco.compression.quantize import BlockwiseAbsmax


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("numel", [1, 127, 128, 1000, 65_537])
def test_roundtrip_within_half_a_step(bits: int, numel: int) -> None:
    torch.manual_seed(numel)
    x = torch.randn(numel) * torch.logspace(-4, 1, numel)  # blocks of very different scales
    pipeline = parse_pipeline(f"q{bits}:128|zstd:3")
    y = pipeline.roundtrip(x)[1]
    half_range = {8: 127, 4: 7, 2: 1.5}[bits]
    blocks = torch.nn.functional.pad(x, (0, (-numel) % 128)).view(-1, 128)
    step = (blocks.abs().amax(dim=1) / half_range).repeat_interleave(128)[:numel]
    assert bool(((x - y).abs() <= step / 2 * (1 + 1e-5) + 1e-12).all())


def test_bits_per_param_is_stated() -> None:
    assert parse_pipeline("q8:128").values.encoded_size(1 << 20) * 8 / (1 << 20) == pytest.approx(8.25)
    assert parse_pipeline("q4:64").values.encoded_size(1 << 20) * 8 / (1 << 20) == pytest.approx(4.5)
    assert parse_pipeline("q2:128").values.encoded_size(1 << 20) * 8 / (1 << 20) == pytest.approx(2.25)
    assert parse_pipeline("q8:256|zstd:1").bits_per_param(1 << 20) == pytest.approx(8.125, abs=1e-3)


def test_two_bit_grid_uses_four_levels_and_zero_blocks_stay_zero() -> None:
    x = torch.tensor([-3.0, -1.0, 1.0, 3.0, 0.0, 0.0, 0.0, 0.0])
    y = parse_pipeline("q2:4").roundtrip(x)[1]
    assert torch.equal(y, x)


def test_stochastic_rounding_is_unbiased_and_deterministic() -> None:
    x = torch.full((4096,), 0.3)
    x[0] = 1.0  # absmax 1: 0.3 lies between the levels 1/3 and -1/3 of the 2-bit grid
    codec = parse_pipeline("q2:4096:sr=7")
    data, y = codec.roundtrip(x)
    assert codec.encode(x) == data
    assert y[1:].unique().tolist() == pytest.approx([-1 / 3, 1 / 3])
    assert float(y[1:].mean()) == pytest.approx(0.3, abs=0.02)
    assert codec.encode(x * 0.5) != parse_pipeline("q2:4096:sr=8").encode(x * 0.5)


def test_rejects_bad_codes_and_scales() -> None:
    codec = BlockwiseAbsmax(bits=8, block=4)
    raw = codec.encode(torch.randn(8))
    bad = raw.clone()
    bad[0:4] = torch.frombuffer(bytearray(torch.tensor([float("nan")]).numpy().tobytes()), dtype=torch.uint8)
    with pytest.raises(CodecError, match="block scale"):
        codec.decode(bad, 8)
    bad = raw.clone()
    bad[-1] = 0x80  # int8 -128 is not on the symmetric grid
    with pytest.raises(CodecError, match="outside the grid"):
        codec.decode(bad, 8)
    codec4 = BlockwiseAbsmax(bits=4, block=4)
    raw4 = codec4.encode(torch.randn(8))
    raw4[-1] = 0xFF  # code 15 does not exist on the 15-level grid
    with pytest.raises(CodecError, match="exceeds"):
        codec4.decode(raw4, 8)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize(
    "spec", ["q8", "q4", "q2:64:sr", "fp4", "nf4", "fp16", "bf16", "fp32", "topk:0.1|q2"]
)
def test_non_finite_input_is_refused(spec: str, bad: float) -> None:
    x = torch.randn(300)
    x[257] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        parse_pipeline(spec).encode(x)
