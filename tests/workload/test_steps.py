"""The inner lr schedule: warm-up, then constant or cosine decay, of each group's own lr."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from geodiloco.config import InnerConfig
from geodiloco.workload.steps import lr_at, set_lr


def test_constant_without_decay_and_warmup_is_linear() -> None:
    cfg = InnerConfig(warmup_steps=4)
    assert [lr_at(cfg, 1e-2, s) for s in range(5)] == pytest.approx([2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2])
    assert lr_at(cfg, 1e-2, 10_000) == 1e-2


def test_cosine_decay_reaches_the_floor_and_stays_there() -> None:
    cfg = InnerConfig(warmup_steps=10, decay_steps=100, min_lr_ratio=0.1)
    assert lr_at(cfg, 1e-2, 10) == pytest.approx(1e-2)
    assert lr_at(cfg, 1e-2, 60) == pytest.approx(1e-3 + 9e-3 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lr_at(cfg, 1e-2, 110) == pytest.approx(1e-3)
    assert lr_at(cfg, 1e-2, 500) == pytest.approx(1e-3)
    lrs = [lr_at(cfg, 1e-2, s) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_set_lr_scales_a_builders_own_lrs_and_leaves_them_alone_without_a_schedule() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([{"params": [param], "lr": 0.5}, {"params": [], "lr": 0.1}])
    set_lr(optimizer, InnerConfig(), 3)
    assert [g["lr"] for g in optimizer.param_groups] == [0.5, 0.1]
    set_lr(optimizer, InnerConfig(decay_steps=10), 10)
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.05, 0.01])
    set_lr(optimizer, InnerConfig(decay_steps=10), 0)  # from the lr each group was built with
    assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.5, 0.1])
