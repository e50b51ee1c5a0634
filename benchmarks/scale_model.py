"""The scale benchmark's model: one flat seeded parameter (``workload.model =
scale_model:build_flat_model``). A module of its own, importing torch alone, because the
coordinator imports the model's module: importing ``scale`` itself would add the synthetic
site's client and its imports (about 40 MB) to the coordinator's measured memory."""

from __future__ import annotations

import torch
from torch import nn

from geodiloco.config import RunConfig


class FlatModel(nn.Module):
    def __init__(self, numel: int, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.flat = nn.Parameter(torch.randn(numel, generator=gen) * 0.02)

    def forward(self, *batch: torch.Tensor) -> torch.Tensor:
        """A loss for the coordinator's dry step (workload.loss = model loss); nothing trains."""
        return self.flat[:1].square().sum()


def build_flat_model(cfg: RunConfig) -> nn.Module:
    """One flat parameter of ``workload.options.params`` elements."""
    return FlatModel(int(cfg.workload.options["params"]), cfg.seed)
