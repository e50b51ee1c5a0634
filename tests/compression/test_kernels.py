"""The fused C kernels (int8; top-k, Elias-Fano and the sign code below one bit) give exactly the
torch path's bytes and values, and refuse bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from geodiloco.compression import CodecError, Place, indices, levels, parse_pipeline, quantize, sparsify
from geodiloco.compression.quantize import BlockwiseAbsmax
from geodiloco.segment import Segment
from tests.compression.codec_strategies import tensors
from tests.helpers import same_bits


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


# ---- below one bit: top-k, Elias-Fano, the sign code -------------------------------------------

SPARSE_MODULES = (sparsify, indices, levels)
SPARSE_SPECS = [
    "topk:0.065:4096|sign:256",
    "topk:0.03:4096|sign:256",
    "topk:0.1:100|sign:7",
    "topk:0.5:3|sign:1",
    "topk:0.02|sign:4096",
    "topk:0.1:256|q2",
    "topk:0.05|fp32",
    "sign:256",
    "sign:5",
]


def _sparse_torch_paths() -> list[object]:
    kept = [m._kernels for m in SPARSE_MODULES]
    for m in SPARSE_MODULES:
        m._kernels = None  # type: ignore[assignment]
    return kept


def _sparse_kernels(kept: list[object]) -> None:
    for m, k in zip(SPARSE_MODULES, kept, strict=True):
        m._kernels = k  # type: ignore[assignment]


def _adversarial(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Ties (few distinct magnitudes), zeros of both signs, denormals, or x as it is."""
    if kind == "ties":
        return (x * 2).round().clamp(-3, 3)
    if kind == "zeros":
        return torch.where(torch.arange(x.numel()) % 3 == 0, -0.0, x * (x.abs() > 1))
    if kind == "denormal":
        return x * 1e-40
    return x


@settings(max_examples=30, deadline=None)
@given(
    x=tensors(),
    kind=st.sampled_from(["as is", "ties", "zeros", "denormal"]),
    spec=st.sampled_from(SPARSE_SPECS),
)
def test_sparse_kernels_give_the_torch_paths_bytes_and_values(x: torch.Tensor, kind: str, spec: str) -> None:
    """Frames and decoded values bit for bit, for blocks that do and do not divide the tensor."""
    x = _adversarial(x, kind)
    pipeline = parse_pipeline(spec)
    fused = pipeline.encode(x)
    decoded = pipeline.decode(fused, x.numel())
    kept = _sparse_torch_paths()
    try:
        assert pipeline.encode(x) == fused
        assert same_bits(pipeline.decode(fused, x.numel()), decoded)
    finally:
        _sparse_kernels(kept)


@pytest.mark.parametrize("block", [1, 5, 16, 100, 4096, 0])
@pytest.mark.parametrize("kind", ["as is", "ties", "zeros", "denormal"])
def test_the_avx512_and_portable_selections_agree(block: int, kind: str) -> None:
    """Where the CPU has AVX-512 the kernel selects with it; the portable path (any other CPU)
    keeps the same elements, and so does the torch path."""
    x = _adversarial(torch.randn(10_007, generator=torch.Generator().manual_seed(block)), kind)
    topk = sparsify.TopK(0.07, block)
    size = block or x.numel()
    k = topk._per_block(size)
    results = []
    for portable in (False, True):
        kept, values = (
            torch.empty(topk.count(x.numel()), dtype=torch.int64),
            torch.empty(topk.count(x.numel())),
        )
        assert sparsify._kernels.topk(x.numpy(), size, k, kept.numpy(), values.numpy(), portable)
        results.append((kept, values))
    reference = topk._select_torch(x, size)
    for kept, values in results:
        assert torch.equal(kept, reference) and same_bits(values, x[reference])


def test_ties_at_the_threshold_go_to_the_lowest_positions() -> None:
    """Equal magnitudes, either sign: the first ones of each block are kept."""
    x = torch.tensor([1.0, -2.0, 2.0, -2.0, 2.0, 0.5, -0.5, 0.5, 0.5, -0.5])
    for topk_block, expected in ((5, [1, 2, 5, 6]), (0, [1, 2, 3, 4])):
        topk = sparsify.TopK(0.4, topk_block)
        assert topk.select(x).tolist() == expected
        assert topk._select_torch(x, topk_block or x.numel()).tolist() == expected


@pytest.mark.parametrize("spec", ["topk:0.1:256|sign:256", "topk:0.1|sign", "sign:64"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_the_sparse_kernels_refuse_non_finite_input(spec: str, bad: float) -> None:
    x = torch.randn(5000)
    x[4321] = bad
    with pytest.raises(CodecError, match="NaN or Inf"):
        parse_pipeline(spec).encode(x)


def test_elias_fano_kernel_refuses_what_the_torch_decoder_refuses() -> None:
    """Too many or too few entries, indices not increasing, an index past the universe: the same
    error from both decoders."""
    universe, count = 1000, 6
    raw = indices.encode(torch.tensor([3, 10, 11, 500, 998, 999]), universe)
    low_bytes = 6  # 7 low bits each, 42 bits; then the high part, 14 bits
    too_many = raw.clone()
    too_many[low_bytes] |= 0x80
    equal_low = raw.clone()  # 10 and 11 share their high part; 11's low bits (from bit 14) made 10
    equal_low[1] &= 0xBF
    past = indices.encode(torch.tensor([3, 10, 11, 500, 998, 999]), 1024)  # same layout as 1000
    for bad, universe_of, message in (
        (too_many, universe, "entries in the high part"),
        (equal_low, universe, "not strictly increasing"),
        (past, 1000 - 1, "outside"),
    ):
        errors = []
        for use_kernels in (True, False):
            kept = None if use_kernels else _sparse_torch_paths()
            try:
                with pytest.raises(CodecError, match=message) as caught:
                    indices.decode(bad, universe_of, count)
                errors.append(str(caught.value))
            finally:
                if kept is not None:
                    _sparse_kernels(kept)
        assert errors[0] == errors[1]
    with pytest.raises(CodecError, match="not strictly increasing"):
        indices.encode(torch.tensor([5, 5]), 10)


def test_the_sign_kernel_refuses_a_bad_scale() -> None:
    codec = parse_pipeline("sign:4").values
    raw = codec.encode(torch.randn(10))
    for scale in (float("nan"), -1.0, float("inf")):
        bad = raw.clone()
        bad[:4] = torch.tensor([scale]).view(torch.uint8)
        with pytest.raises(CodecError, match="block scale"):
            codec.decode(bad, 10)


@pytest.mark.parametrize("spec", ["topk:0.065:4096|sign:256", "topk:0.1:256|q2", "topk:0.05|fp32", "q8"])
def test_the_residual_without_a_dense_decode_is_x_minus_what_receivers_decode(spec: str) -> None:
    """Error feedback's record: encode_with_residual writes x − decoded, the same bits as the
    roundtrip's dense decoded tensor subtracted from x."""
    x = torch.randn(20_000, generator=torch.Generator().manual_seed(3))
    x[::7] = -0.0
    pipeline = parse_pipeline(spec)
    residual = torch.full_like(x, float("nan"))
    data = pipeline.encode_with_residual(x, residual)
    expected, back = pipeline.roundtrip(x)
    assert data == expected
    assert same_bits(residual, x - back)


@settings(max_examples=40, deadline=None)
@given(universe=st.integers(1, 100_000), fraction=st.floats(0.0, 1.0), seed=st.integers(0, 1000))
def test_elias_fano_kernels_give_the_torch_codes_bytes(universe: int, fraction: float, seed: int) -> None:
    """Any universe and count (low parts from 0 to 16 bits): the same bytes, the same indices back."""
    count = int(universe * fraction)
    idx = torch.randperm(universe, generator=torch.Generator().manual_seed(seed))[:count].sort().values
    fused = indices.encode(idx, universe)
    kept = _sparse_torch_paths()
    try:
        assert torch.equal(indices.encode(idx, universe), fused)
        assert torch.equal(indices.decode(fused, universe, count), idx)
    finally:
        _sparse_kernels(kept)
    assert torch.equal(indices.decode(fused, universe, count), idx)


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(
    ("spec", "numel"), [("topk:0.16:4096|sign:256", 10_000), ("topk:0.5:7|sign:3", 4097)]
)
def test_applying_a_sparse_update_equals_decoding_then_add_and_hash(
    with_residual: bool, spec: str, numel: int
) -> None:
    """A site adds a top-k + sign update to θ from its codes, the dense values never written: θ
    (−0.0 + 0 included), the residual, the checksum sums and Σ θ² are decode-then-add's."""
    pipeline = parse_pipeline(spec)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(5))
    x[:64] = 0.0  # a block of zeros: its scale is 0, its values ±0
    raw = pipeline.unpack(pipeline.encode(x), numel)
    theta, residual = torch.randn(numel), torch.randn(numel)
    theta[::5] = -0.0
    t, r = theta.clone(), residual.clone()
    expected = quantize._kernels.add_and_hash(
        t.numpy(), pipeline.decode_raw(raw, numel).numpy(), r.numpy() if with_residual else None, 99
    )
    t2, r2 = theta.clone(), residual.clone()
    assert pipeline.apply_raw(raw, t2, 99, r2 if with_residual else None) == expected
    assert same_bits(t2, t) and same_bits(r2, r)
    bad = raw.clone()
    bad[pipeline.sparsifier.index_size(numel) : pipeline.sparsifier.index_size(numel) + 4] = torch.tensor(
        [-1.0]
    ).view(torch.uint8)
    t3 = theta.clone()
    with pytest.raises(CodecError, match="block scale"):
        pipeline.apply_raw(bad, t3, 99)
    assert same_bits(t3, theta)  # refused before anything was added
