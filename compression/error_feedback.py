"""Error feedback: what a lossy codec dropped stays with the sender and rides the next round."""

from __future__ import annotations

import torch


class ErrorFeedback:
    """Holds the residual of one sender for one flat tensor.

    ``decay`` < 1 shrinks the residual each round before it rides along (1: keep all of it,
    0: no error feedback). In DiLoCo a dropped coordinate's pseudo-gradients pile up while the
    replicas have not moved it, each computed from the same stale point, so sending their whole
    sum can overshoot; decay bounds what piles up to ``1 / (1 - decay)`` rounds' worth.
    """

    def __init__(self, numel: int, decay: float = 1.0) -> None:
        self.numel = numel
        self._residual: torch.Tensor | None = None  # zeros, made when first used (not on a restore)
        self.decay = decay

    @property
    def residual(self) -> torch.Tensor:
        if self._residual is None:
            self._residual = torch.zeros(self.numel, dtype=torch.float32)
        return self._residual

    @residual.setter
    def residual(self, value: torch.Tensor) -> None:
        self._residual = value

    def compensate(self, value: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The value to send this time: the new value plus (decayed) what earlier sends dropped
        (into ``out``, which may be ``value`` itself: no model-sized buffer of its own)."""
        if self.residual.device != value.device:  # the residual lives with the values (a GPU site's)
            self.residual = self.residual.to(value.device)
        return torch.add(value, self.residual, alpha=self.decay, out=out)

    def record(self, sent: torch.Tensor, decoded: torch.Tensor) -> None:
        """Keep what the receiver did not get."""
        torch.sub(sent, decoded, out=self.residual)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"residual": self.residual}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Take the saved residual (a tensor of the right size is adopted, not copied)."""
        saved = state["residual"]
        if saved.shape != (self.numel,):
            raise ValueError(f"residual has shape {tuple(saved.shape)}, expected ({self.numel},)")
        if self._residual is None or self._residual.device == saved.device:
            self._residual = saved.detach().to(torch.float32)
        else:
            self._residual.copy_(saved)
