"""One inner step and evaluation, shared by the DiLoCo sites and the synchronous baseline."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from geodiloco.config import InnerConfig


def make_inner_optimizer(model: nn.Module, cfg: InnerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, cfg: InnerConfig, step: int) -> None:
    """Linear warm-up over ``cfg.warmup_steps`` global steps, then constant."""
    scale = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    for group in optimizer.param_groups:
        group["lr"] = cfg.lr * scale


def inner_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: InnerConfig,
    step: int,
    x: torch.Tensor,
    y: torch.Tensor,
) -> float:
    set_lr(optimizer, cfg, step)
    loss = model(x, y)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip:
        clip_grad_norm(model.parameters(), cfg.grad_clip)
    optimizer.step()
    return float(loss.detach())


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> float:
    """Scale gradients to a total norm of at most ``max_norm``; returns the norm before.

    Unlike ``torch.nn.utils.clip_grad_norm_`` it accepts a mix of sharded (DTensor) and plain
    gradients, as a tensor-parallel model with replicated layers has."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return 0.0
    squares = []
    for g in grads:
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = float(torch.stack(squares).sum().sqrt())
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
    return total


@torch.no_grad()
def evaluate(model: nn.Module, windows: torch.Tensor, batch_size: int = 32) -> tuple[float, int]:
    """Summed per-sequence mean loss over ``windows`` and their count (merge across ranks)."""
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch_size):
        w = windows[i : i + batch_size]
        total += float(model(w[:, :-1], w[:, 1:])) * w.shape[0]
        count += w.shape[0]
    return total, count
