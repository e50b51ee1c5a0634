"""Outer optimizers on plain tensors; nothing here knows about gRPC.

Given the averaged pseudo-gradient Δ (θ_r minus the sites' trained parameters), each returns the
proposed change θ_{r+1} − θ_r. The coordinator compresses that change, and coordinator and sites
all apply the same decoded version.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from geodiloco.config import OuterConfig

try:  # the fused C kernels, built at install time; same values as the torch path
    from geodiloco.compression import _kernels
except ImportError:  # pragma: no cover - only where no C compiler was available at install
    _kernels = None  # type: ignore[assignment]

SpanStep = Callable[[torch.Tensor, int], torch.Tensor]


class OuterOptimizer(ABC):
    @abstractmethod
    def round_step(self, like: torch.Tensor) -> SpanStep:
        """This round's step for an averaged pseudo-gradient shaped, typed and placed like
        ``like`` (its state is made like it), as a function of one span of it and the span's first
        element: it returns the span's proposed change, computed in place (the
        span's storage holds it afterwards, no model-sized temporaries). Spans are disjoint and
        may be stepped in any order and in parallel, each while it is in cache; the round
        counts once, when this is called."""

    def send_step(
        self, total: torch.Tensor, divisor: float, residual: torch.Tensor, decay: float
    ) -> SpanStep:
        """This round's value to send, for one span of the round's weighted sum ``total`` (and the
        span's first element): step(span / divisor) + decay · the residual's span, written into
        the residual's span and returned. The span of ``total`` may be overwritten. The mean, the
        step and the error feedback in one call, so that an optimizer may fuse them into one
        pass over memory (the round counts once, when this is called)."""
        step = self.round_step(total)

        def send(span: torch.Tensor, start: int) -> torch.Tensor:
            out = residual[start : start + span.numel()]
            return torch.add(step(span.div_(divisor), start), out, alpha=decay, out=out)

        return send

    def step(self, avg_delta: torch.Tensor) -> torch.Tensor:
        """The proposed change for a whole averaged pseudo-gradient, in place."""
        return self.round_step(avg_delta)(avg_delta, 0)

    @abstractmethod
    def state_dict(self) -> dict[str, object]:
        """Everything needed to resume after a restart."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore from :meth:`state_dict`."""


class NesterovOuter(OuterOptimizer):
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

    def _begin_round(self, like: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The momentum buffer (made like ``like`` at the first round) and this round's μ."""
        mu = self.current_momentum()
        if self.buffer is None:
            self.buffer = torch.zeros_like(like)
        self.steps += 1
        return self.buffer, mu

    def round_step(self, like: torch.Tensor) -> SpanStep:
        buffer, mu = self._begin_round(like)
        lr = self.lr

        def step(avg: torch.Tensor, start: int) -> torch.Tensor:
            momentum = buffer[start : start + avg.numel()]
            momentum.mul_(mu).add_(avg)
            return avg.add_(momentum, alpha=mu).mul_(-lr)

        return step

    def send_step(
        self, total: torch.Tensor, divisor: float, residual: torch.Tensor, decay: float
    ) -> SpanStep:
        """On the host, one C pass per span: mean, momentum, step and error feedback (five torch
        passes otherwise); the same fp32 operations, so the same values."""
        host = (total, residual) if self.buffer is None else (total, residual, self.buffer)
        if _kernels is None or not all(
            t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in host
        ):
            return super().send_step(total, divisor, residual, decay)
        buffer, mu = self._begin_round(total)
        lr = self.lr

        def send(span: torch.Tensor, start: int) -> torch.Tensor:
            end = start + span.numel()
            out = residual[start:end]
            _kernels.nesterov_send(
                span.numpy(), buffer[start:end].numpy(), out.numpy(), divisor, mu, lr, decay
            )
            return out

        return send

    def state_dict(self) -> dict[str, object]:
        return {"buffer": self.buffer, "steps": self.steps}

    def load_state_dict(self, state: dict[str, object]) -> None:
        buffer = state["buffer"]
        self.buffer = buffer.clone() if isinstance(buffer, torch.Tensor) else None
        self.steps = int(state["steps"])  # type: ignore[call-overload]


class FedAvgOuter(OuterOptimizer):
    """Plain federated averaging: θ_{r+1} is the sites' average, change = −lr·Δ (lr 1)."""

    def __init__(self, lr: float = 1.0) -> None:
        self.lr = lr

    def round_step(self, like: torch.Tensor) -> SpanStep:
        lr = self.lr
        return lambda avg, start: avg.mul_(-lr)

    def state_dict(self) -> dict[str, object]:
        return {}

    def load_state_dict(self, state: dict[str, object]) -> None:
        return None


def build_outer_optimizer(cfg: OuterConfig) -> OuterOptimizer:
    if cfg.optimizer == "fedavg":
        return FedAvgOuter(lr=cfg.lr)
    return NesterovOuter(lr=cfg.lr, momentum=cfg.momentum, warmup_rounds=cfg.warmup_rounds)
