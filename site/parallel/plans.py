"""Per-model tensor-parallel plans and FSDP2 units, chosen by the model's structure.

- The reference GPT (``model.blocks[i]`` with an ``fc``/``out`` MLP): the MLP is split, up
  projection by columns and down projection by rows; its fused qkv attention stays replicated
  (splitting it by columns would cut heads apart).
- Llama-style decoder layers (Llama, Mistral, Qwen2 and the like in ``transformers``: a
  ``self_attn`` with ``q_proj``/``k_proj``/``v_proj``/``o_proj`` and an ``mlp`` with
  ``gate_proj``/``up_proj``/``down_proj``): head-aware. q, k and v are split by columns, so each
  rank holds whole heads (``num_heads / tp`` query heads, ``num_kv_heads / tp`` key/value
  heads; the attention reshapes with ``-1`` heads, so it runs on the local ones), ``o_proj``
  by rows; gate and up by columns, down by rows. One all-reduce after attention and one after
  the MLP per layer, as Megatron does; embeddings, norms and the output layer stay replicated.

FSDP2 wraps each repeated block (the reference's ``blocks``, or the classes a ``transformers``
model names in ``_no_split_modules``, its decoder layers), then the root.
"""

from __future__ import annotations

from typing import NoReturn

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from geodiloco.site.parallel.layout_spec import LayoutError

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _refuse(message: str) -> NoReturn:
    raise LayoutError(message)


def _has(module: nn.Module | None, names: tuple[str, ...]) -> bool:
    return module is not None and all(isinstance(getattr(module, n, None), nn.Linear) for n in names)


def llama_block_plan(block: nn.Module, tp: int) -> dict[str, ParallelStyle] | None:
    """The head-aware plan of a Llama-style decoder layer (None: not one); refuses head counts
    that ``tp`` does not divide."""
    attn, mlp = getattr(block, "self_attn", None), getattr(block, "mlp", None)
    if not (_has(attn, ATTENTION) and _has(mlp, MLP)):
        return None
    assert attn is not None
    head_dim = int(getattr(attn, "head_dim", 0))
    if head_dim < 1:
        _refuse(f"tensor parallel: {type(attn).__name__} has no head_dim to split its heads by")
    heads, kv_heads = attn.q_proj.out_features // head_dim, attn.k_proj.out_features // head_dim
    if heads % tp or kv_heads % tp:
        _refuse(
            f"tensor parallel: tp={tp} must divide the attention's {heads} query heads and "
            f"{kv_heads} key/value heads"
        )
    plan: dict[str, ParallelStyle] = {f"self_attn.{n}": ColwiseParallel() for n in ATTENTION[:3]}
    plan["self_attn.o_proj"] = RowwiseParallel()
    plan.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel()})
    plan["mlp.down_proj"] = RowwiseParallel()
    return plan


def blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: ``model.blocks`` (a list, or a pipeline stage's dict), else
    the modules of the classes a ``transformers`` model names in ``_no_split_modules`` (its
    decoder layers)."""
    found = getattr(model, "blocks", None)
    if isinstance(found, nn.ModuleList):
        return list(found)
    if isinstance(found, nn.ModuleDict):  # a pipeline stage's blocks, keyed by their index
        return list(found.values())
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def tensor_parallel_plans(model: nn.Module, tp: int) -> list[tuple[nn.Module, dict[str, ParallelStyle]]]:
    """(block, plan) for every block; refuses a model none of whose blocks has a plan."""
    found = blocks(model)
    plans: list[tuple[nn.Module, dict[str, ParallelStyle]]] = []
    for block in found:
        plan = llama_block_plan(block, tp)
        if plan is None and _has(block, ("fc", "out")):
            plan = {"fc": ColwiseParallel(), "out": RowwiseParallel()}
        if plan is None:
            _refuse(
                f"tensor parallel: no plan for {type(block).__name__} (known: the reference GPT's "
                "blocks[i].fc/out, and Llama-style self_attn.q/k/v/o_proj + mlp.gate/up/down_proj)"
            )
        plans.append((block, plan))
    if not plans:
        _refuse(
            f"tensor parallel: {type(model).__name__} has no blocks to split (model.blocks, or "
            "decoder layers named in a transformers model's _no_split_modules)"
        )
    return plans
