"""A site's parallel layout: which ranks replicate, shard (FSDP2), split tensors (TP) or run
pipeline stages (PP).

Each site chooses its own layout (``geodiloco site run --layout fsdp``); the wire never sees
it. Parallelism is applied with plain functions on an ordinary ``nn.Module``, in the order
torchtitan uses: tensor parallel first, then activation checkpointing and ``torch.compile`` per
block when asked (:mod:`geodiloco.site.parallel.per_block`), then FSDP2 over the data-parallel
dims (HSDP when some of them replicate), or DDP when every rank holds the whole model. With
``pp=N`` the model is cut into N stages first (:mod:`geodiloco.site.parallel.pipeline_stages`) and
the rest applies to each stage over its own ranks.

Mixed precision as people run it: ``bf16`` is FSDP2's ``MixedPrecisionPolicy`` (bf16 compute
parameters, fp32 gradient reduction) when the layout shards, else bf16 autocast around the
forward (DDP, TP). ``fp8`` adds torchao's float8 training linears (GPUs of compute capability
8.9 or newer) on top of bf16. The parameters the optimizer and the outer sync see stay fp32.

:class:`ParallelConfig` (the layout as the command line gives it) lives in
:mod:`geodiloco.site.parallel.layout_spec`, apart from torch, so that the launcher parses it without
importing torch; it is re-exported here.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.nn.parallel import DistributedDataParallel

from geodiloco.site.parallel import plans
from geodiloco.site.parallel.experts import apply_expert_parallel, expert_mesh
from geodiloco.site.parallel.layout_spec import ACTIVATION_CHECKPOINTING as ACTIVATION_CHECKPOINTING
from geodiloco.site.parallel.layout_spec import FP8_CAPABILITY as FP8_CAPABILITY
from geodiloco.site.parallel.layout_spec import FP8_MULTIPLE as FP8_MULTIPLE
from geodiloco.site.parallel.layout_spec import MESH_DIMS as MESH_DIMS
from geodiloco.site.parallel.layout_spec import MICROBATCHES as MICROBATCHES
from geodiloco.site.parallel.layout_spec import PRECISIONS as PRECISIONS
from geodiloco.site.parallel.layout_spec import PRESETS as PRESETS
from geodiloco.site.parallel.layout_spec import LayoutError as LayoutError
from geodiloco.site.parallel.layout_spec import ParallelConfig as ParallelConfig
from geodiloco.site.parallel.per_block import apply_block_options
from geodiloco.site.parallel.pipeline_stages import Pipelined, split_stage
from geodiloco.workload.model import ByteGPT


def build_mesh(config: ParallelConfig, device_type: str | None = None) -> DeviceMesh:
    """The site's mesh on ``device_type`` (default: cuda when torch sees it, else cpu)."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = (config.pp, config.dp_replicate, config.dp_shard, config.tp)
    return init_device_mesh(device_type, sizes, mesh_dim_names=MESH_DIMS)


def precision_problem(precision: str, device: torch.device) -> str | None:
    """Why ``precision`` cannot run on ``device`` (None: it can). Asks CUDA only for fp8 on a
    CUDA device."""
    if precision != "fp8":
        return None
    if device.type != "cuda":
        return f"mixed-precision: fp8 needs a CUDA GPU of compute capability 8.9 or newer, not {device.type}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return (
            f"mixed-precision: fp8 needs compute capability 8.9 or newer; "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}"
        )
    if importlib.util.find_spec("torchao") is None:
        return "mixed-precision: fp8 needs torchao (pip install 'geodiloco[fp8]')"
    return None


def apply_float8(model: nn.Module) -> int:
    """Swap every linear layer whose dims fit float8 matmuls for torchao's float8 training linear
    (weights stay fp32; casts happen inside the matmul); returns how many were swapped."""
    from torchao.float8 import convert_to_float8_training  # optional extra: geodiloco[fp8]

    def fits(module: nn.Module, _name: str) -> bool:
        return (
            isinstance(module, nn.Linear)
            and module.in_features % FP8_MULTIPLE == 0
            and module.out_features % FP8_MULTIPLE == 0
        )

    swapped = sum(1 for name, m in model.named_modules() if fits(m, name))
    convert_to_float8_training(model, module_filter_fn=fits)
    return swapped


class Autocast(nn.Module):
    """Runs the wrapped module's forward under bf16 autocast (DDP and TP sites); the parameters,
    gradients and optimizer state stay fp32. Its ``module.`` prefix is not canonical."""

    def __init__(self, module: nn.Module, device_type: str) -> None:
        super().__init__()
        self.module = module
        self.device_type = device_type

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.module(*args, **kwargs)


def data_parallel_rank(mesh: DeviceMesh) -> int:
    """This rank's index among the ranks that train on different batches."""
    replicate, shard = mesh["dp_replicate"].get_local_rank(), mesh["dp_shard"].get_local_rank()
    return replicate * mesh["dp_shard"].size() + shard


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh) -> None:
    """Split each block by the plan its structure calls for (:mod:`geodiloco.site.parallel.plans`): the
    reference GPT's MLP, or a Llama-style layer's attention heads and MLP."""
    for block, plan in plans.tensor_parallel_plans(model, mesh.size()):
        parallelize_module(block, mesh, plan)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, mixed_precision: str) -> None:
    """FSDP2 per block (the reference's blocks, a transformers model's decoder layers), then the
    root (its own parameters: embeddings, final norm, output layer)."""
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if mixed_precision != "fp32" else None, reduce_dtype=torch.float32
    )
    for block in plans.blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def parallelize(model: nn.Module, config: ParallelConfig, mesh: DeviceMesh) -> nn.Module:
    """Apply the layout and precision to ``model`` (on its device already); returns the module to
    call in training (a DDP wrapper for ``ddp``, an autocast one for bf16 without FSDP2).

    Parameters keep their canonical names: FSDP2 and TP change them in place, DDP and autocast
    add only a ``module.`` prefix that :func:`geodiloco.params.canonical_name` strips. With pipeline
    stages, ``model`` keeps only this rank's stage (see
    :func:`geodiloco.site.parallel.pipeline_stages.split_stage`) and the module returned runs the
    pipeline schedule."""
    if config.mixed_precision == "fp8":
        apply_float8(model)  # before TP and FSDP2, as torchao asks
    if config.tp > 1:
        apply_tensor_parallel(model, mesh["tp"])
    if config.pp > 1:
        if not isinstance(model, ByteGPT):
            raise LayoutError(
                f"pipeline parallel: no stage split for {type(model).__name__} (ByteGPT has one)"
            )
        if len(model.blocks) < config.pp:
            raise LayoutError(
                f"pipeline parallel: {config.pp} stages need at least {config.pp} blocks, "
                f"the model has {len(model.blocks)}"
            )
        stage = split_stage(model, mesh)
        return Pipelined(data_parallel(stage, config, mesh), mesh, config.stage_microbatches)
    return data_parallel(model, config, mesh)


def data_parallel(model: nn.Module, config: ParallelConfig, mesh: DeviceMesh) -> nn.Module:
    """Expert parallel (with DDP only), the per-block options (activation checkpointing,
    compile), then FSDP2 over the data-parallel dims that shard (HSDP when some replicate), else
    DDP where they replicate, else ``model`` itself (under bf16 autocast when asked)."""
    if config.ep > 1:
        apply_expert_parallel(model, expert_mesh(config.ep, mesh.device_type), config.data_parallel)
    apply_block_options(model, config)
    if config.dp_shard > 1:
        dims = ("dp_replicate", "dp_shard") if config.dp_replicate > 1 else ("dp_shard",)
        apply_fsdp(model, mesh[dims], config.mixed_precision)
        return model
    trained: nn.Module = model
    if config.dp_replicate > 1:
        trained = DistributedDataParallel(model, process_group=mesh["dp_replicate"].get_group())
    if config.mixed_precision != "fp32":
        trained = Autocast(trained, mesh.device_type)
    return trained


def layout_summary(config: ParallelConfig) -> str:
    world = dist.get_world_size() if dist.is_initialized() else 1
    stages = f"pp={config.pp} x {config.stage_microbatches} microbatches, " if config.pp > 1 else ""
    experts = f", ep={config.ep}" if config.ep > 1 else ""
    options = f", activation checkpointing {config.activation_checkpointing}"
    options = options if config.activation_checkpointing != "none" else ""
    options += ", compiled blocks" if config.compile else ""
    return (
        f"{config.name} over {world} ranks ({stages}dp_replicate={config.dp_replicate}, "
        f"dp_shard={config.dp_shard}, tp={config.tp}{experts}, {config.mixed_precision}{options})"
    )
