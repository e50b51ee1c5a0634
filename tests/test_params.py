import pytest
import torch
from torch import nn

from geodiloco import params
from geodiloco.params import Checksum, canonical_name, canonical_parameters


def test_wrapper_prefixes_are_removed() -> None:
    assert canonical_name("module.blocks.0.fc.weight") == "blocks.0.fc.weight"
    assert canonical_name("_orig_mod.module.tok.weight") == "tok.weight"


def test_canonical_order_is_sorted_by_name() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    names = [n for n, _ in canonical_parameters(model)]
    assert names == sorted(names)


def test_the_checksum_kernel_gives_the_numpy_paths_sums(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C kernel and the numpy reference agree bit for bit (NaN, Inf, -0.0, odd starts)."""
    assert params._kernels is not None
    x = torch.randn(200_003)
    x[5], x[7], x[9] = float("nan"), float("-inf"), -0.0
    fast = Checksum()
    fast.add_range(12_345, x)
    monkeypatch.setattr(params, "_kernels", None)
    slow = Checksum()
    slow.add_range(12_345, x)
    assert (fast.low, fast.high, fast.count) == (slow.low, slow.high, slow.count)
