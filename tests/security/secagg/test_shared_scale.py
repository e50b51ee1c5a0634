"""Shared-scale quantisation: every proposal's grid holds its block, shards code as the whole
vector does, codes are clamped to the agreed grid, and the sum dequantises to the weighted sum."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from geodiloco.security.secagg import shared_scale
from geodiloco.security.secagg.secagg_errors import InvalidField


def test_a_proposal_is_the_smallest_quarter_octave_grid_holding_the_block() -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-30, 3, 1000)
    x[256:384] = 0
    first, q = shared_scale.propose(x, 0, 128)
    blocks = torch.nn.functional.pad(x, (0, 24)).view(-1, 128).abs().amax(dim=1).double().numpy()
    step = shared_scale.steps(q).astype(np.float64)
    assert first == 0 and q[2] == shared_scale.ZERO and step[2] == 0
    live = blocks > 0
    assert (127 * step[live] >= blocks[live]).all()
    below = shared_scale.steps(np.where(live, q - 1, q).astype(np.int16)).astype(np.float64)
    assert (127 * below[live] < blocks[live]).all()


def test_shards_code_as_the_whole_vector_and_values_are_clamped() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1000, generator=gen)
    q = np.full(shared_scale.n_blocks(1000, 64), shared_scale.ZERO, dtype=np.int16)
    for start, part in ((0, x[:333]), (333, x[333:])):
        shared_scale.merge(q, *shared_scale.propose(part, start, 64))
    assert np.array_equal(q, shared_scale.propose(x, 0, 64)[1])
    whole = shared_scale.quantise(x, 0, 64, q)
    parts = np.concatenate(
        [shared_scale.quantise(x[:101], 0, 64, q), shared_scale.quantise(x[101:], 101, 64, q)]
    )
    assert np.array_equal(whole, parts)
    step = torch.from_numpy(shared_scale.steps(q)).repeat_interleave(64)[:1000]
    back = shared_scale.dequantise(whole.astype(np.int32), 64, q, 1.0)
    assert ((back - x).abs() <= step / 2).all()
    assert np.abs(shared_scale.quantise(x * 1000, 0, 64, q)).max() == 127  # beyond the grid: cut to it


def test_sum_of_codes_dequantises_to_the_weighted_mean() -> None:
    gen = torch.Generator().manual_seed(2)
    xs, ws = [torch.randn(500, generator=gen) for _ in range(3)], [0.5, 0.3, 0.2]
    q = np.full(shared_scale.n_blocks(500, 128), shared_scale.ZERO, dtype=np.int16)
    for x, w in zip(xs, ws, strict=True):
        shared_scale.merge(q, *shared_scale.propose(x * w, 0, 128))
    total = sum(shared_scale.quantise(x * w, 0, 128, q).astype(np.int32) for x, w in zip(xs, ws, strict=True))
    mean = shared_scale.dequantise(total, 128, q, 1.0)
    exact = sum(x * w for x, w in zip(xs, ws, strict=True))
    step = torch.from_numpy(shared_scale.steps(q)).repeat_interleave(128)[:500]
    assert ((mean - exact).abs() <= 3 * step / 2 + 1e-7).all()


def test_bad_input_is_refused_by_name() -> None:
    with pytest.raises(InvalidField, match="delta"):
        shared_scale.propose(torch.tensor([1.0, float("nan")]), 0, 4)
    with pytest.raises(InvalidField, match="start"):
        shared_scale.quantise(torch.ones(10), 0, 4, np.zeros(2, np.int16))
    with pytest.raises(InvalidField, match="weight"):
        shared_scale.dequantise(np.zeros(4, np.int32), 4, np.zeros(1, np.int16), 0.0)
