"""The inner lr schedule: warm-up, then constant or cosine decay."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from geodiloco.config import InnerConfig
from geodiloco.workload.steps import lr_at, set_lr


def test_constant_without_decay_and_warmup_is_linear() -> None:
    cfg = InnerConfig(lr=1e-2, warmup_steps=4)
    assert [lr_at(cfg, s) for s in range(5)] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2])
    assert lr_at(cfg, 10_000) == 1e-2


def test_cosine_decay_reaches_the_floor_and_stays_there() -> None:
    cfg = InnerConfig(lr=1e-2, warmup_steps=10, decay_steps=100, min_lr_ratio=0.1)
    assert lr_at(cfg, 10) == pytest.approx(1e-2)
    assert lr_at(cfg, 60) == pytest.approx(1e-3 + 9e-3 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_at(cfg, 110) == pytest.approx(1e-3)
    assert lr_at(cfg, 500) == pytest.approx(1e-3)
    lrs = [lr_at(cfg, s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_set_lr_leaves_a_builders_own_lrs_alone_without_a_schedule() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [param], "lr": 0.5}])
    set_lr(optimizer, InnerConfig(), 3)
    assert optimizer.param_groups[0]["lr"] == 0.5
    set_lr(optimizer, InnerConfig(lr=1e-2, decay_steps=10), 10)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
