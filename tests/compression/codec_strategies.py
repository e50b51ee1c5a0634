"""Hypothesis strategies shared by the codec tests: flat fp32 tensors of awkward sizes and scales."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

SIZES = st.one_of(st.sampled_from([0, 1, 2, 127, 128, 129, 1000]), st.integers(0, 5000), st.just(70_001))


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Gaussian, constant, sparse or heavy-tailed values, at scales from 1e-6 to 1e3."""
    numel = draw(SIZES)
    seed = draw(st.integers(0, 2**31 - 1))
    kind = draw(st.sampled_from(["gaussian", "constant", "sparse", "heavy"]))
    scale = draw(st.sampled_from([1e-6, 1e-3, 1.0, 1e3]))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    if kind == "constant":
        x = torch.full((numel,), float(x[0]) if numel else 0.0)
    elif kind == "sparse":
        x = x * (torch.rand(numel, generator=gen) < 0.05)
    elif kind == "heavy":
        x = x**3
    return (x * scale).to(torch.float32)
