"""The fused C kernels for int8 give exactly the torch path's bytes and values, and refuse bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geodiloco.compression import CodecError, Place, parse_pipeline, quantize
from geodiloco.compression.quantize import BlockwiseAbsmax
from geodiloco.segment import Segment
from tests.compression.codec_strategies import tensors


@pytest.fixture
def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantize, "_kernels", None)


def test_the_kernels_are_built() -> None:
    """The package builds them at install (pyproject.toml); without them int8 is ~4x slower."""
    assert quantize._kernels is not None
    assert BlockwiseAbsmax(bits=8).fused
    assert not BlockwiseAbsmax(bits=4).fused
    assert not BlockwiseAbsmax(bits=8, sr_seed=1).fused


def _both_paths(codec: BlockwiseAbsmax, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    fused = codec.encode(x)
    kernels, quantize._kernels = quantize._kernels, None
    try:
        reference = codec.encode(x)
    finally:
        quantize._kernels = kernels
    return fused, reference


@settings(max_examples=60, deadline=None)
@given(x=tensors(), block=st.sampled_from([1, 7, 32, 128, 4096]))
def test_fused_encode_and_decode_equal_the_torch_path(x: torch.Tensor, block: int) -> None:
    codec = BlockwiseAbsmax(bits=8, block=block)
    fused, reference = _both_paths(codec, x)
    assert torch.equal(fused, reference)
    decoded = codec.decode(fused, x.numel())
    kernels, quantize._kernels = quantize._kernels, None
    try:
        assert torch.equal(decoded, codec.decode(fused, x.numel()))
    finally:
        quantize._kernels = kernels


def test_ties_round_to_even_as_torch_does() -> None:
    """absmax 127 gives step 1, so x.5 values sit exactly between two codes."""
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])
    fused, reference = _both_paths(BlockwiseAbsmax(bits=8, block=8), x)
    assert torch.equal(fused, reference)
    assert fused[4:].view(torch.int8).tolist() == [127, 0, 2, 2, 0, -2, -2, 126]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("where", [0, 127, 128, 999])
def test_non_finite_input_is_refused(bad: float, where: int) -> None:
    x = torch.randn(1000)
    x[where] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        BlockwiseAbsmax(bits=8).encode(x)


def test_a_code_off_the_grid_is_refused_by_the_fused_decoder() -> None:
    codec = BlockwiseAbsmax(bits=8, block=128)
    raw = codec.encode(torch.randn(300))
    raw[4 * 3 + 299] = 0x80  # -128 as int8
    with pytest.raises(CodecError, match="-128"):
        codec.decode(raw, 300)


@settings(max_examples=40, deadline=None)
@given(x=tensors(), block=st.sampled_from([1, 7, 128, 4096]))
def test_the_norm_from_codes_equals_the_decoded_values_norm(x: torch.Tensor, block: int) -> None:
    """The coordinator's norm check reads a q8 chunk's codes and steps, never an fp32 copy."""
    codec = BlockwiseAbsmax(bits=8, block=block)
    raw = codec.encode(x)
    exact = float(codec.decode(raw, x.numel()).double().square().sum())
    # exact in double from code x step; the decoded values are those products rounded to fp32
    assert codec.sumsq(raw, x.numel()) == pytest.approx(exact, rel=1e-6, abs=1e-300)


def test_the_norm_from_codes_is_exact_for_blocks_whose_squares_pass_int32() -> None:
    """Σ code² of a block of 200,000 codes of ±127 is 3.2e9, past an int32: the kernel sums it in
    runs that each fit and gives the exact total."""
    codec = BlockwiseAbsmax(bits=8, block=200_000)
    x = torch.where(torch.arange(300_000) % 2 == 0, 1.0, -1.0)
    raw = codec.encode(x)
    steps = raw[:8].view(torch.float32).double().tolist()  # two blocks: 200,000 and 100,000 codes
    exact = steps[0] ** 2 * (200_000 * 127**2) + steps[1] ** 2 * (100_000 * 127**2)
    assert codec.sumsq(raw, x.numel()) == pytest.approx(exact, rel=1e-12)


def test_the_norm_from_codes_refuses_what_decoding_refuses() -> None:
    codec = BlockwiseAbsmax(bits=8, block=128)
    raw = codec.encode(torch.randn(300))
    off_grid = raw.clone()
    off_grid[4 * 3 + 299] = 0x80  # -128 as int8
    with pytest.raises(CodecError, match="-128"):
        codec.sumsq(off_grid, 300)
    bad_step = raw.clone()
    bad_step[:4] = torch.tensor([float("nan")]).view(torch.uint8)
    with pytest.raises(CodecError, match="step"):
        codec.sumsq(bad_step, 300)
    with pytest.raises(CodecError, match="bytes"):
        codec.sumsq(raw[:-1], 300)
    assert BlockwiseAbsmax(bits=4).sumsq(BlockwiseAbsmax(bits=4).encode(torch.randn(8)), 8) is None


def test_non_contiguous_and_non_fp32_inputs_take_a_correct_path() -> None:
    codec = BlockwiseAbsmax(bits=8, block=16)
    x = torch.randn(64, 3)
    column = x[:, 1]  # strided view
    assert torch.equal(codec.encode(column), codec.encode(column.contiguous()))
    assert torch.equal(codec.encode(column.double()), codec.encode(column.contiguous()))


def test_the_torch_path_still_works_alone(torch_path: None) -> None:
    codec = BlockwiseAbsmax(bits=8)
    x = torch.randn(1000)
    assert not codec.fused
    y = codec.decode(codec.encode(x), 1000)
    assert float((x - y).abs().max()) <= float(x.abs().max()) / 127 / 2 * (1 + 1e-5)


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize(
    ("rows", "row_len", "stride", "block"), [(1, 1000, 1000, 128), (6, 10, 25, 7), (3, 64, 64, 64)]
)
def test_folding_codes_equals_decoding_then_adding(
    first: bool, rows: int, row_len: int, stride: int, block: int
) -> None:
    """The coordinator folds a q8 chunk into the round's sum straight from its codes; the sum is
    what decoding and torch's mul (or add with alpha) would leave, bit for bit, rows and blocks
    in any alignment."""
    numel = rows * row_len
    pipeline = parse_pipeline(f"q8:{block}")
    raw = pipeline.unpack(pipeline.encode(torch.randn(numel)), numel)
    place = Place(0, Segment(3, rows, row_len, stride))
    total = torch.randn(3 + (rows - 1) * stride + row_len + 5)
    expected = total.clone()
    view = place.segment.view_of(expected)
    values = pipeline.decode_raw(raw, numel).view(rows, row_len)
    if first:
        torch.mul(values, 1234.0, out=view)
    else:
        view.add_(values, alpha=1234.0)
    pipeline.fold_raw(raw, place, total, 1234.0, first)
    assert torch.equal(total, expected)


def test_folding_refuses_a_code_off_the_grid_and_bad_layouts() -> None:
    pipeline = parse_pipeline("q8:128")
    raw = pipeline.unpack(pipeline.encode(torch.randn(300)), 300)
    raw[4 * 3 + 299] = 0x80  # -128 as int8
    with pytest.raises(CodecError, match="-128"):
        pipeline.fold_raw(raw, Place.span(0, 0, 300), torch.zeros(300), 1.0, True)
    steps, codes = raw[:12].view(torch.float32).numpy(), raw[12:].view(torch.int8).numpy()
    with pytest.raises(ValueError, match="row layout"):
        quantize._kernels.fold_q8(steps, codes, 128, torch.zeros(299).numpy(), 300, 300, 1.0, True)
    with pytest.raises(ValueError, match="row layout"):
        quantize._kernels.fold_q8(steps, codes, 128, torch.zeros(300).numpy(), 7, 7, 1.0, True)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(
    ("numel", "block"), [(1, 128), (4097, 128), (10_000, 100), (9_000, 5000), (70_001, 64)]
)
def test_applying_codes_equals_decoding_then_add_and_hash(
    with_residual: bool, numel: int, block: int
) -> None:
    """The round close and replay add a q8 update to θ straight from its codes: θ, the residual,
    the checksum sums and Σ θ² are those of decoding and then add_and_hash, bit for bit, for
    blocks that do and do not divide the kernel's tiles."""
    pipeline = parse_pipeline(f"q8:{block}")
    raw = pipeline.unpack(pipeline.encode(torch.randn(numel) * 0.3), numel)
    theta, residual = torch.randn(numel), torch.randn(numel)
    t, r = theta.clone(), residual.clone()
    expected = quantize._kernels.add_and_hash(
        t.numpy(), pipeline.decode_raw(raw, numel).numpy(), r.numpy() if with_residual else None, 77
    )
    t2, r2 = theta.clone(), residual.clone()
    assert pipeline.apply_raw(raw, t2, 77, r2 if with_residual else None) == expected
    assert torch.equal(t2, t) and torch.equal(r2, r)


def test_applying_refuses_a_code_off_the_grid_and_mismatched_sizes() -> None:
    pipeline = parse_pipeline("q8:128")
    raw = pipeline.unpack(pipeline.encode(torch.randn(300)), 300)
    bad = raw.clone()
    bad[4 * 3 + 299] = 0x80  # -128 as int8
    with pytest.raises(CodecError, match="-128"):
        pipeline.apply_raw(bad, torch.zeros(300), 0)
    with pytest.raises(CodecError, match="bytes, expected"):  # θ's size is not the chunk's
        pipeline.apply_raw(raw, torch.zeros(299), 0)
    steps, codes = raw[:12].view(torch.float32).numpy(), raw[12:].view(torch.int8).numpy()
    with pytest.raises(ValueError, match="apply_q8"):
        quantize._kernels.apply_q8(torch.zeros(300).numpy(), steps, codes, 128, torch.zeros(3).numpy(), 0)
    with pytest.raises(ValueError, match="apply_q8"):
        quantize._kernels.apply_q8(torch.zeros(300).numpy(), steps[:2], codes, 128, None, 0)
    assert parse_pipeline("q4").apply_raw(raw, torch.zeros(300), 0) is None  # decodes instead
    raw = pipeline.unpack(pipeline.encode(torch.randn(9000)), 9000)
    raw[-1] = 0x80  # the last code, after two whole tiles: refused before any was added
    theta = torch.randn(9000)
    before = theta.clone()
    with pytest.raises(CodecError, match="-128"):
        pipeline.apply_raw(raw, theta, 0)
    assert torch.equal(theta, before)
