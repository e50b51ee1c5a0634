import os

import numpy as np
import pytest
import torch

from geodiloco.compression import parse_pipeline
from geodiloco.compression.entropy import FAST_LEVEL, MIN_SAMPLED, Zstd, estimated_gain


def test_bytes_that_cannot_shrink_skip_entropy_coding() -> None:
    data = os.urandom(1 << 18)
    assert estimated_gain(data) < 0.02
    zstd = Zstd(level=3)
    assert zstd.effective_level(data) == FAST_LEVEL
    frame = zstd.encode(data)
    assert len(frame) <= len(data) + 64  # stored, not expanded
    assert zstd.decode(frame, len(data)) == data


def test_skewed_bytes_are_coded_at_the_configured_level() -> None:
    rng = np.random.default_rng(0)
    codes = np.clip(np.round(rng.normal(0, 8, 1 << 18)), -127, 127).astype(np.int8).tobytes()
    zstd = Zstd(level=3)
    assert estimated_gain(codes) > 0.3
    assert zstd.effective_level(codes) == 3
    frame = zstd.encode(codes)
    assert len(frame) < 0.75 * len(codes)
    assert zstd.decode(frame, len(codes)) == codes


def test_small_inputs_always_use_the_configured_level() -> None:
    data = os.urandom(MIN_SAMPLED - 1)
    assert Zstd(level=5).effective_level(data) == 5


def test_q8_of_uniform_values_is_stored_and_decodes_exactly_like_q8() -> None:
    """Codes of values spread uniformly in each block (as real pseudo-gradients are) gain nothing."""
    x = torch.rand(1 << 18, generator=torch.Generator().manual_seed(1)) * 2 - 1
    coded, plain = parse_pipeline("q8|zstd:3"), parse_pipeline("q8")
    data, y = coded.roundtrip(x)
    assert coded.encode(x) == data
    assert torch.equal(y, plain.roundtrip(x)[1])
    assert len(data) == pytest.approx(len(plain.encode(x)), rel=1e-3)


def test_fp32_bytes_are_sampled_at_every_byte_position() -> None:
    """fp32 Gaussian data: the exponent bytes make zstd worth ~8%; a stride of 4 would miss them."""
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    pipeline = parse_pipeline("fp32|zstd:1")
    assert estimated_gain(x.numpy().tobytes()) > 0.05
    assert len(pipeline.encode(x)) < 0.95 * 4 * x.numel()
