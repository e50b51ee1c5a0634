import pytest
import torch

from geodiloco.compression import parse_pipeline
from geodiloco.compression.sparsify import TopK


def test_per_tensor_topk_keeps_the_largest_magnitudes() -> None:
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    y = parse_pipeline("topk:0.02|fp32").roundtrip(x)[1]
    kept = y != 0
    assert int(kept.sum()) == 200
    assert torch.equal(y[kept], x[kept])
    assert float(x[~kept].abs().max()) <= float(x[kept].abs().min())


@pytest.mark.parametrize("numel", [1, 255, 256, 1000, 4097])
def test_per_block_topk_keeps_the_same_share_of_every_block(numel: int) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) + 0.01
    sparsifier = TopK(fraction=0.05, block=256)
    kept = sparsifier.select(x)
    assert kept.numel() == sparsifier.count(numel)
    per_block = torch.bincount(kept // 256, minlength=-(-numel // 256))
    assert bool((per_block[: numel // 256] == 13).all())
    assert bool((kept[1:] > kept[:-1]).all())


def test_topk_with_two_bit_values_is_under_one_bit_per_param() -> None:
    pipeline = parse_pipeline("topk:0.1|q2")
    assert pipeline.bits_per_param(1 << 20) < 1.0
    x = torch.randn(1 << 16)
    assert 8 * len(pipeline.encode(x)) / x.numel() < 1.0
