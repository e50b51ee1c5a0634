"""Error feedback: what a lossy codec dropped stays with the sender and rides the next round."""

from __future__ import annotations

import torch


class ErrorFeedback:
    """Holds the residual of one sender for one flat tensor."""

    def __init__(self, numel: int) -> None:
        self.residual = torch.zeros(numel, dtype=torch.float32)

    def compensate(self, value: torch.Tensor) -> torch.Tensor:
        """The value to send this time: the new value plus what earlier sends dropped."""
        return value + self.residual

    def record(self, sent: torch.Tensor, decoded: torch.Tensor) -> None:
        """Keep what the receiver did not get."""
        torch.sub(sent, decoded, out=self.residual)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"residual": self.residual}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.residual.copy_(state["residual"])
