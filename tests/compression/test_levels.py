import pytest
import torch

from geodiloco.compression import parse_pipeline
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
