import pytest
import torch

from geodiloco.compression import CodecError, parse_pipeline


def test_fp32_is_exact_and_fp16_bf16_within_their_bounds() -> None:
    x = torch.randn(10_000) * torch.logspace(-6, 3, 10_000)
    assert torch.equal(parse_pipeline("fp32").roundtrip(x)[1], x)
    for spec, rel in (("fp16", 2.0**-11), ("bf16", 2.0**-8)):
        pipeline = parse_pipeline(spec)
        y = pipeline.roundtrip(x)[1]
        assert bool(((x - y).abs() <= pipeline.error_bound(x)).all())
        assert float((x - y).norm() / x.norm()) < rel
        assert pipeline.bits_per_param(1 << 20) == pytest.approx(16.0, abs=0.01)


def test_fp16_refuses_values_beyond_its_range() -> None:
    with pytest.raises(CodecError, match="fp16 range"):
        parse_pipeline("fp16").encode(torch.tensor([1.0, 70_000.0]))


@pytest.mark.parametrize("spec", ["fp32", "fp16", "bf16"])
def test_non_finite_payload_values_are_refused(spec: str) -> None:
    pipeline = parse_pipeline(spec)
    codec = pipeline.values
    raw = codec.encode(torch.ones(4))
    raw.view({"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[spec])[2] = float("inf")
    with pytest.raises(CodecError, match="NaN or Inf"):
        codec.decode(raw, 4)
