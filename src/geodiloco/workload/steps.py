"""One inner step and evaluation, shared by the DiLoCo sites and the synchronous baseline."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

from geodiloco.workload.loss import Batch, LossFn, model_loss

if TYPE_CHECKING:
    from geodiloco.config import InnerConfig


@runtime_checkable
class Staged(Protocol):
    """A model that runs its own forward and backward over several ranks (a pipeline stage,
    :class:`geodiloco.site.parallel.pipeline_stages.Pipelined`): the loss is found on one rank and shared, and
    the gradient norm spans the ranks."""

    def train_step(self, batch: Batch, loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward of ``batch``; its mean loss, on every rank."""
        ...

    def evaluate(self, batch: Batch, loss_fn: LossFn) -> tuple[float, int]:
        """Summed loss and rows of ``batch``, counted on one rank of those that share it."""
        ...

    def clip_grad_norm(self, max_norm: float) -> float:
        """Clip the gradients of all the ranks to ``max_norm`` together; the norm before."""
        ...


def make_inner_optimizer(model: nn.Module, cfg: InnerConfig) -> torch.optim.AdamW:
    """The reference optimizer: AdamW with ``inner.lr`` and ``inner.weight_decay``."""
    if cfg.lr is None or cfg.weight_decay is None:
        raise ValueError("inner.lr and inner.weight_decay are unset: RunConfig fills them for AdamW")
    return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)


def lr_at(cfg: InnerConfig, base: float, step: int) -> float:
    """The lr of a parameter group built with lr ``base`` at ``step`` (global): a linear warm-up
    to ``base`` over ``cfg.warmup_steps`` steps, then constant or, with ``cfg.decay_steps``, a
    cosine decay to ``base * cfg.min_lr_ratio`` over that many steps.

    A decayed lr makes the end of a run settle: without it, a small perturbation early on (a
    lossy codec, a different reduction order) moves the final loss of a short run by percents."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return base * (step + 1) / cfg.warmup_steps
    if not cfg.decay_steps:
        return base
    progress = min(1.0, (step - cfg.warmup_steps) / cfg.decay_steps)
    floor = base * cfg.min_lr_ratio
    return floor + (base - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, cfg: InnerConfig, step: int) -> None:
    """Set the lr of ``step`` (global) on every parameter group, scaling the lr each group was
    built with (kept as ``initial_lr``, as torch's schedulers do), so a user's optimizer keeps
    its own lrs, per group, under the run's warm-up and decay. Without either, nothing changes."""
    if not cfg.warmup_steps and not cfg.decay_steps:
        return
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
        group["lr"] = lr_at(cfg, group["initial_lr"], step)


def inner_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    cfg: InnerConfig,
    step: int,
    *batch: torch.Tensor,
    loss_fn: LossFn = model_loss,
) -> float:
    """One step on ``batch``, whose mean loss is ``loss_fn(model, batch)``; returns the loss.

    Gradients are clipped to ``cfg.grad_clip`` (0: not clipped) whatever the optimizer. A
    :class:`Staged` model (a pipeline) runs its forward and backward itself."""
    set_lr(optimizer, cfg, step)
    if isinstance(model, Staged):
        optimizer.zero_grad(set_to_none=True)
        loss = model.train_step(batch, loss_fn)
    else:
        loss = loss_fn(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
    if cfg.grad_clip:
        if isinstance(model, Staged):
            model.clip_grad_norm(cfg.grad_clip)
        else:
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
    total = float(squared_grad_norm(grads, grads[0].device).sqrt())
    scale_grads(grads, total, max_norm)
    return total


@torch.no_grad()
def squared_grad_norm(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The squared norm of ``grads`` together (sharded ones over their mesh), fp32 on ``device``."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    # imported here: torch.distributed.tensor costs seconds to import, and the coordinator, which
    # reads the workload's config, must restart in a few
    from torch.distributed.tensor import DTensor

    squares = []
    for g in grads:
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).to(device) ** 2)
    return torch.stack(squares).sum()


@torch.no_grad()
def scale_grads(grads: list[torch.Tensor], total: float, max_norm: float) -> None:
    """Scale ``grads``, of norm ``total`` together, to a norm of at most ``max_norm``."""
    scale = max_norm / (total + 1e-6)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)


def evaluate(model: nn.Module, windows: torch.Tensor, batch_size: int = 32) -> tuple[float, int]:
    """Summed per-sequence mean loss over ``windows`` and their count (merge across ranks)."""
    batches = (windows[i : i + batch_size] for i in range(0, windows.shape[0], batch_size))
    return evaluate_batches(model, ((w[:, :-1], w[:, 1:]) for w in batches))


@torch.no_grad()
def evaluate_batches(
    model: nn.Module, batches: Iterable[tuple[torch.Tensor, ...]], loss_fn: LossFn = model_loss
) -> tuple[float, int]:
    """Summed mean loss ``loss_fn(model, batch)`` weighted by each batch's rows, and the rows.

    The model is in eval mode meanwhile (no dropout, batch norm's running statistics), then
    back in the mode it was in. A :class:`Staged` model counts each batch on one of its ranks."""
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            if isinstance(model, Staged):
                part, rows = model.evaluate(batch, loss_fn)
                total, count = total + part, count + rows
                continue
            rows = batch[0].shape[0]
            total += float(loss_fn(model, batch)) * rows
            count += rows
    finally:
        model.train(was_training)
    return total, count
