"""The round controller's own checks on a decoded pseudo-gradient (whatever codec produced it)."""

from __future__ import annotations

import pytest
import torch

from geodiloco.coordinator.edge.server import data_shard_sizes, initial_parameters
from geodiloco.coordinator.refusals import InvalidArgument
from geodiloco.coordinator.rounds import RoundController
from geodiloco.params import state_hash

from .conftest import hostile_config


async def test_non_finite_absurd_or_mistyped_deltas_are_refused_without_a_trace() -> None:
    cfg = hostile_config()
    c = RoundController(cfg, initial_parameters(cfg), data_shard_sizes(cfg))
    await c.join("site-a", "")
    n = c.num_params
    nan = torch.zeros(n)
    nan[3] = float("nan")
    cases = {
        "NaN or Inf": nan,
        "max_delta_norm_ratio": torch.full((n,), 50.0),
        "float32": torch.zeros(n, dtype=torch.float64),
    }
    for message, delta in cases.items():
        with pytest.raises(InvalidArgument, match=message):
            await c.contribute("site-a", "", 0, 100, delta)
    assert not c.mean.contributors and c.sites["site-a"].accepted == 0
    assert state_hash(c.theta) == c.hashes[0]
    limit = cfg.limits.max_delta_norm_ratio * c.theta_norm
    just_under = torch.ones(n) * (0.99 * limit / n**0.5)
    assert await c.contribute("site-a", "", 0, 100, just_under)  # an honest large step still passes


def test_the_norm_limit_can_be_turned_off() -> None:
    cfg = hostile_config(limits__max_delta_norm_ratio=0.0)
    c = RoundController(cfg, initial_parameters(cfg), data_shard_sizes(cfg))
    c._check_values(torch.full((c.num_params,), 1e6))
