import pytest
import torch

from geodiloco.compression import CodecError, parse_pipeline
from geodiloco.compression.levels import e2m1_levels, normal_float_levels


def test_e2m1_levels_are_the_fp4_values() -> None:
    levels = [v * 6 for v in e2m1_levels()]
    assert levels == pytest.approx([-6, -4, -3, -2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2, 3, 4, 6])


def test_normal_float_levels_are_symmetric_in_unit_range() -> None:
    levels = torch.tensor(normal_float_levels())
    assert levels.numel() == 16 and float(levels.max()) == pytest.approx(1.0)
    assert torch.allclose(levels, -levels.flip(0), atol=1e-6)


@pytest.mark.parametrize("spec", ["fp4", "fp4:32", "nf4"])
def test_values_on_the_grid_roundtrip_exactly(spec: str) -> None:
    pipeline = parse_pipeline(spec)
    table = torch.tensor(pipeline.values.levels)  # type: ignore[attr-defined]
    x = table[torch.randint(0, table.numel(), (128,))] * 0.5
    x[0] = 0.5  # the block's absmax is the scale
    assert torch.equal(pipeline.roundtrip(x)[1], x)


def test_nf4_beats_uniform_4_bit_on_gaussian_data() -> None:
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0))
    errors = {s: float((x - parse_pipeline(s).roundtrip(x)[1]).norm()) for s in ("nf4", "q4", "fp4")}
    assert errors["nf4"] < errors["q4"]


@pytest.mark.parametrize(
    ("make", "lm2_at_most"),
    [(torch.randn, 0.12), (lambda n, generator: torch.rand(n, generator=generator) * 2 - 1, 0.08)],
)
def test_lm2_beats_absmax_two_bit_on_gaussian_and_uniform_data(make: object, lm2_at_most: float) -> None:
    x = make(1 << 16, generator=torch.Generator().manual_seed(0))  # type: ignore[operator]
    mse = {
        s: float((x - parse_pipeline(s).roundtrip(x)[1]).square().mean() / x.square().mean())
        for s in ("lm2", "q2")
    }
    assert mse["lm2"] < lm2_at_most < mse["q2"]
    assert parse_pipeline("lm2").bits_per_param(1 << 20) == parse_pipeline("q2").bits_per_param(1 << 20)


def test_lm2_never_decodes_to_inf_and_refuses_a_forged_scale() -> None:
    pipeline = parse_pipeline("lm2:4")
    x = torch.tensor([3e38, -3e38, 3e38, 1.0])
    y = pipeline.roundtrip(x)[1]
    assert bool(torch.isfinite(y).all()) and bool(((x - y).abs() <= pipeline.error_bound(x)).all())
    raw = pipeline.values.encode(x)
    raw[:4] = torch.tensor([3.4e38], dtype=torch.float32).view(torch.uint8)
    with pytest.raises(CodecError, match="scale is negative, not finite or too large"):
        pipeline.values.decode(raw, 4)


def test_lm2_scales_a_short_last_block_by_its_own_elements() -> None:
    x = torch.cat([torch.zeros(128), torch.full((5,), 2.0)])  # a last block of 5 in blocks of 128
    raw = parse_pipeline("lm2").values.encode(x)
    scales = raw[:8].view(torch.float32)
    assert scales.tolist() == [0.0, 2.0]  # the RMS of the 5 values, not of them and 123 zeros


def test_sign_sends_each_sign_times_its_blocks_mean_magnitude() -> None:
    x = torch.tensor([3.0, -1.0, 0.0, -4.0, 2.0, 2.0])  # blocks of 4 and a short one of 2
    pipeline = parse_pipeline("sign:4")
    assert pipeline.values.encoded_size(6) == 2 * 4 + 1  # a scale per block, a bit per element
    y = pipeline.roundtrip(x)[1]
    assert y.tolist() == [2.0, -2.0, -2.0, -2.0, 2.0, 2.0]  # a zero takes the lower level
    # the mean magnitude minimises the squared error of a sign code: no other scale does better
    for scale in (1.9, 2.1):
        assert float((x[:4] - scale * y[:4].sign()).square().sum()) > float((x[:4] - y[:4]).square().sum())


def test_sign_costs_a_bit_less_than_q2_and_refuses_a_forged_scale() -> None:
    bits = {s: parse_pipeline(s).bits_per_param(1 << 20) for s in ("sign:256", "q2:256")}
    assert bits["sign:256"] == pytest.approx(bits["q2:256"] - 1)
    pipeline = parse_pipeline("sign:4")
    raw = pipeline.values.encode(torch.ones(4))
    raw[:4] = torch.tensor([float("inf")], dtype=torch.float32).view(torch.uint8)
    with pytest.raises(CodecError, match="scale is negative, not finite or too large"):
        pipeline.values.decode(raw, 4)
