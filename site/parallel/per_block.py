"""Activation checkpointing and ``torch.compile``, applied to each transformer block.

As torchtitan does, both go on every repeated block (the reference model's ``blocks``, a
``transformers`` model's decoder layers: :func:`geodiloco.site.parallel.plans.blocks`) after
tensor parallel and before FSDP2 or DDP, so that FSDP2's per-block units gather a block's
parameters around its (compiled, recomputed) forward. Unlike torchtitan's wrappers, neither
renames a parameter: checkpointing replaces the block's ``forward`` on the instance and compile
is ``nn.Module.compile`` (in place), so hashes, the outer sync's shards and checkpoints see the
names of the plain layout.

- ``block``: only each block's input is kept; its forward runs again in the backward.
- ``selective``: op-level selective checkpointing
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of matmuls,
  attention and collectives are kept, the rest (norms, activations, residual adds, casts) is
  recomputed, which frees what a block holds besides its matmul outputs (with a 4x MLP, the
  activation's output and the norms' outputs). No matmul runs twice: on a GPU, where the
  recomputed ops are memory-bound and the matmuls dominate, that is the cheap trade (and why it
  was chosen over checkpointing every other block, which recomputes half the matmuls). On a CPU
  those ops are not cheap next to small matmuls: measured, it cost 17-20% of the tokens per
  CPU-second for less memory than ``block`` saves (docs/measurements.md).

Both recompute the same ops on the same inputs, so a step's arithmetic is that of the plain
layout (bit-identical parameters, tested). ``compile`` changes kernels (fused, reordered), so its
losses match the plain layout's within rounding, not bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from geodiloco.site.parallel import plans
from geodiloco.site.parallel.layout_spec import ACTIVATION_CHECKPOINTING, LayoutError, ParallelConfig

# kept by "selective": expensive to recompute (matmuls, attention) or a collective to redo
_SAVED_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "linear",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_attention_math",
)
_SAVED_COLLECTIVES = ("reduce_scatter_tensor", "all_to_all_single", "all_gather_into_tensor", "all_reduce")


@functools.cache
def saved_ops() -> frozenset[Any]:
    """The ops whose outputs ``selective`` keeps (those this torch build has: every overload)."""
    packets = [getattr(torch.ops.aten, name, None) for name in _SAVED_NAMES]
    functional = getattr(torch.ops, "_c10d_functional", None)
    packets += [getattr(functional, name, None) for name in _SAVED_COLLECTIVES]
    return frozenset(getattr(p, overload) for p in packets if p is not None for overload in p.overloads())


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_policy)


def _checkpointed_forward(
    block: nn.Module, context_fn: Callable[[], Any] | None, *args: Any, **kwargs: Any
) -> Any:
    """``block``'s own forward under non-reentrant checkpointing (run plainly without autograd,
    as in evaluation: nothing to recompute then)."""
    forward = functools.partial(type(block).forward, block)
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    if context_fn is None:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


def _no_kv_cache(model: nn.Module) -> None:
    """A ``transformers`` model keeps a key/value cache by default; in training it is unused,
    and recomputing a layer would append to it twice (as ``transformers``' own checkpointing,
    switch it off)."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "use_cache", False):
        config.use_cache = False


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Checkpoint every block of ``model`` in ``mode`` (``none``: nothing); returns how many."""
    if mode not in ACTIVATION_CHECKPOINTING:
        raise LayoutError(
            f"parallel.activation_checkpointing: {mode!r} is not one of {', '.join(ACTIVATION_CHECKPOINTING)}"
        )
    if mode == "none":
        return 0
    found = _blocks(model, "parallel.activation_checkpointing")
    _no_kv_cache(model)
    context_fn = _selective_contexts if mode == "selective" else None
    for block in found:
        # the instance's forward, called by nn.Module's __call__ (and so inside FSDP2's hooks):
        # a partial of the block itself, so that a deepcopy of the model checkpoints its copy
        block.forward = functools.partial(_checkpointed_forward, block, context_fn)
    return len(found)


def apply_compile(model: nn.Module) -> int:
    """``torch.compile`` each block in place (``nn.Module.compile``: the names stay); returns how
    many. Blocks of one class share their compiled code, so a model compiles once per class."""
    found = _blocks(model, "parallel.compile")
    for block in found:
        block.compile()
    return len(found)


def apply_block_options(model: nn.Module, config: ParallelConfig) -> None:
    """Checkpointing, then compile (which then compiles the recomputed forward too), as the
    layout asks; before FSDP2 or DDP wrap the blocks."""
    apply_activation_checkpointing(model, config.activation_checkpointing)
    if config.compile:
        apply_compile(model)


def _blocks(model: nn.Module, key: str) -> list[nn.Module]:
    found = plans.blocks(model)
    if not found:
        raise LayoutError(
            f"{key}: {type(model).__name__} has no blocks to apply it to (model.blocks, or decoder "
            "layers named in a transformers model's _no_split_modules)"
        )
    return found
