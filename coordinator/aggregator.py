"""Token-weighted averaging of the sites' pseudo-gradients for one round."""

from __future__ import annotations

import torch


class WeightedMean:
    """Σ w_k Δ_k / Σ w_k, accumulated as contributions arrive (w_k = tokens trained on)."""

    def __init__(self, numel: int) -> None:
        self.total = torch.zeros(numel, dtype=torch.float64)
        self.weight = 0
        self.contributors: list[str] = []

    def add(self, site: str, delta: torch.Tensor, tokens: int) -> None:
        if tokens <= 0:
            raise ValueError("a contribution needs a positive token count")
        self.total.add_(delta.to(torch.float64), alpha=float(tokens))
        self.weight += tokens
        self.contributors.append(site)

    def mean(self) -> torch.Tensor:
        if not self.weight:
            raise ValueError("no contributions to average")
        return (self.total / self.weight).to(torch.float32)
