"""Pytest-only helpers; the set-ups themselves live in the testing wing (geodiloco.testing)."""

from __future__ import annotations

import pytest
import torch

CUDA = pytest.param(  # a device parameter: runs where CUDA is, marked gpu, skipped elsewhere
    "cuda",
    marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
)
DEVICES = ["cpu", CUDA]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Both fp32 and equal bit for bit (signed zeros and NaN payloads included)."""
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))
