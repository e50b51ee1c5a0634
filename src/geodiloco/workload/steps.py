"""One inner step and evaluation, shared by the DiLoCo sites and the synchronous baseline."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from geodiloco.config import InnerConfig


def make_inner_optimizer(model: nn.Module, cfg: InnerConfig) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def lr_at(cfg: InnerConfig, step: int) -> float:
    """Linear warm-up to ``cfg.lr`` over ``cfg.warmup_steps`` global steps, then constant or, with
    ``cfg.decay_steps``, a cosine decay to ``cfg.lr * cfg.min_lr_ratio`` over that many steps.

    A decayed lr makes the end of a run settle: without it, a small perturbation early on (a
    lossy codec, a different reduction order) moves the final loss of a short run by percents."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if not cfg.decay_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / cfg.decay_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, cfg: InnerConfig, step: int) -> None:
    """Set the lr of ``step`` (global) on every parameter group.

    Without a warm-up or decay the optimizer keeps the lr it was built with (a user's builder
    may set its own per parameter group)."""
    if not cfg.warmup_steps and not cfg.decay_steps:
        return
    for group in optimizer.param_groups:
        group["lr"] = lr_at(cfg, step)


def inner_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: InnerConfig,
    step: int,
    *batch: torch.Tensor,
) -> float:
    """One step on ``batch``, whose mean loss is ``model(*batch)``; returns the loss."""
    set_lr(optimizer, cfg, step)
    loss = model(*batch)
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


def evaluate(model: nn.Module, windows: torch.Tensor, batch_size: int = 32) -> tuple[float, int]:
    """Summed per-sequence mean loss over ``windows`` and their count (merge across ranks)."""
    batches = (windows[i : i + batch_size] for i in range(0, windows.shape[0], batch_size))
    return evaluate_batches(model, ((w[:, :-1], w[:, 1:]) for w in batches))


@torch.no_grad()
def evaluate_batches(model: nn.Module, batches: Iterable[tuple[torch.Tensor, ...]]) -> tuple[float, int]:
    """Summed mean loss ``model(*batch)`` weighted by each batch's rows, and the rows."""
    total, count = 0.0, 0
    for batch in batches:
        rows = batch[0].shape[0]
        total += float(model(*batch)) * rows
        count += rows
    return total, count
