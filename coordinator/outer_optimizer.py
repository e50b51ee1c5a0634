"""Outer optimizers on plain tensors; nothing here knows about gRPC.

Given the averaged pseudo-gradient Δ (θ_r minus the sites' trained parameters), each returns the
proposed change θ_{r+1} − θ_r. The coordinator compresses that change, and coordinator and sites
all apply the same decoded version.
"""

from __future__ import annotations

from typing import Protocol

import torch

from geodiloco.config import OuterConfig


class OuterOptimizer(Protocol):
    def step(self, avg_delta: torch.Tensor) -> torch.Tensor:
        """The proposed parameter change for this round's averaged pseudo-gradient, computed in
        place: ``avg_delta``'s storage holds it afterwards (no model-sized temporaries)."""
        ...

    def state_dict(self) -> dict[str, object]:
        """Everything needed to resume after a restart."""
        ...

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore from :meth:`state_dict`."""
        ...


class NesterovOuter:
    """SGD with Nesterov momentum, as in DiLoCo: m ← μm + Δ; change = −lr (Δ + μm).

    With ``warmup_rounds`` W, round r uses momentum μ·min(1, r/W): from-scratch runs over short
    horizons converge faster without early momentum.
    """

    def __init__(self, lr: float, momentum: float, warmup_rounds: int = 0) -> None:
        self.lr = lr
        self.momentum = momentum
        self.warmup_rounds = warmup_rounds
        self.buffer: torch.Tensor | None = None
        self.steps = 0

    def current_momentum(self) -> float:
        if not self.warmup_rounds:
            return self.momentum
        return self.momentum * min(1.0, self.steps / self.warmup_rounds)

    def step(self, avg_delta: torch.Tensor) -> torch.Tensor:
        mu = self.current_momentum()
        if self.buffer is None:
            self.buffer = torch.zeros_like(avg_delta)
        self.buffer.mul_(mu).add_(avg_delta)
        self.steps += 1
        return avg_delta.add_(self.buffer, alpha=mu).mul_(-self.lr)

    def state_dict(self) -> dict[str, object]:
        return {"buffer": self.buffer, "steps": self.steps}

    def load_state_dict(self, state: dict[str, object]) -> None:
        buffer = state["buffer"]
        self.buffer = buffer.clone() if isinstance(buffer, torch.Tensor) else None
        self.steps = int(state["steps"])  # type: ignore[call-overload]


class FedAvgOuter:
    """Plain federated averaging: θ_{r+1} is the sites' average, change = −lr·Δ (lr 1)."""

    def __init__(self, lr: float = 1.0) -> None:
        self.lr = lr

    def step(self, avg_delta: torch.Tensor) -> torch.Tensor:
        return avg_delta.mul_(-self.lr)

    def state_dict(self) -> dict[str, object]:
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:
        return None


def build_outer_optimizer(cfg: OuterConfig) -> OuterOptimizer:
    if cfg.optimizer == "fedavg":
        return FedAvgOuter(lr=cfg.lr)
    return NesterovOuter(lr=cfg.lr, momentum=cfg.momentum, warmup_rounds=cfg.warmup_rounds)
