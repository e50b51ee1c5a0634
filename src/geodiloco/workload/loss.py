"""The loss contract: how a batch and a model become the scalar each inner step minimises.

``workload.loss`` names a builder ``(cfg) -> LossFn``; ``loss_fn(model, batch)`` calls the model
and returns the batch's mean loss, a scalar tensor. By convention a data builder's batch is
``(*inputs, targets)``. Two are shipped:

- :func:`build_cross_entropy` (the default): ``model(*inputs)`` gives logits (a tensor, or an
  object with ``.logits`` as ``transformers`` models return), scored by cross-entropy over the
  last dimension against ``targets`` (next-token prediction when the targets are the inputs
  shifted by one, classification when they are labels);
- :func:`build_model_loss`: ``model(*batch)`` is the loss itself (a scalar tensor, or an object
  with ``.loss``), for models that compute their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from geodiloco.config import RunConfig

Batch = tuple[torch.Tensor, ...]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]


class LossContractError(TypeError):
    """A model output or batch that the loss function cannot score; the message says what it got."""


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def cross_entropy(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Mean cross-entropy of ``model(*inputs)``'s logits against the batch's last element."""
    if len(batch) < 2:
        raise LossContractError(f"expected a batch (*inputs, targets), got {len(batch)} element(s)")
    *inputs, targets = batch
    out = model(*inputs)
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if not isinstance(logits, torch.Tensor) or logits.ndim < 2:
        raise LossContractError(
            f"model(*inputs) returned {_describe(out)}, not logits (a tensor [..., classes] or an "
            "object with .logits)"
        )
    if logits.shape[:-1].numel() != targets.numel():
        raise LossContractError(
            f"logits of shape {tuple(logits.shape)} do not fit targets of shape {tuple(targets.shape)}"
        )
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def model_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``model(*batch)`` itself: a scalar tensor, or an object whose ``.loss`` is one."""
    out = model(*batch)
    loss = out if isinstance(out, torch.Tensor) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        raise LossContractError(
            f"model(*batch) returned {_describe(out)}, not a loss (a scalar tensor or an object with .loss)"
        )
    return loss


def build_cross_entropy(cfg: RunConfig) -> LossFn:
    """The default ``workload.loss``: the model gives logits."""
    return cross_entropy


def build_model_loss(cfg: RunConfig) -> LossFn:
    """``workload.loss`` for a model that returns its own loss from ``model(*batch)``."""
    return model_loss


def check_loss(loss: Any) -> torch.Tensor:
    """The loss a loss function returned, if it is a finite floating-point scalar."""
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        raise LossContractError(f"the loss function returned {_describe(loss)}, not a floating scalar")
    if not bool(torch.isfinite(loss.detach())):
        raise LossContractError(f"the loss is {float(loss.detach())} on the first batch")
    return loss
