"""Pipeline stages: the reference model cut into N stages and trained with a 1F1B schedule.

A ``pp=N`` site holds the model in N stages along its mesh's ``pp`` dim: the first stage has the
embeddings and the first blocks, the last has the last blocks, the final norm and the head,
stages between have blocks only. The reference model ties its head to the token embedding, so
the first and last stages both hold ``tok.weight``; after every step its gradient is summed over
the two, so the copies never drift apart.

A stage keeps the canonical names of its parameters (``blocks.3.fc.weight`` on whichever stage
holds block 3) and the rank's model records the whole model's parameter list
(:class:`~geodiloco.site.shards.StagePlacement`), so the outer sync places a stage's elements in
the canonical vector and every element keeps exactly one owner in the site.

Microbatches flow through ``torch.distributed.pipelining`` (1F1B for training, forward-only for
evaluation); the loss is found on the last stage and shared with the others, so every rank of a
stage group reports the same step loss. The loss function must give a microbatch's *mean* loss.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from geodiloco.params import canonical_parameters
from geodiloco.site.shards import PLACEMENT_ATTR, PP_DIM, StagePlacement, local_tensor
from geodiloco.workload.loss import Batch, LossFn
from geodiloco.workload.model import ByteGPT
from geodiloco.workload.steps import scale_grads, squared_grad_norm

if TYPE_CHECKING:  # torch.distributed.pipelining pulls in dynamo (~1.6 s per rank): only pp sites pay
    from torch.distributed.pipelining.schedules import _PipelineSchedule


class ByteGPTStage(nn.Module):
    """The part of a :class:`ByteGPT` one stage runs, sharing its modules (and their names)."""

    def __init__(self, model: ByteGPT) -> None:
        super().__init__()
        self.tok: nn.Embedding | None = getattr(model, "tok", None)
        self.pos: nn.Embedding | None = getattr(model, "pos", None)
        blocks = model.get_submodule("blocks")
        assert isinstance(blocks, nn.ModuleDict), "split_model first"
        self.blocks = blocks
        self.ln_f: nn.LayerNorm | None = getattr(model, "ln_f", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids to activations (first stage), activations on, or activations to logits (last)."""
        if self.pos is not None:
            assert self.tok is not None
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        if self.ln_f is not None:
            assert self.tok is not None
            x = self.ln_f(x) @ self.tok.weight.T
        return x


def stage_blocks(blocks: int, stages: int, stage: int) -> range:
    """The blocks ``stage`` of ``stages`` runs: an even split, in order."""
    return range(blocks * stage // stages, blocks * (stage + 1) // stages)


def _holders(name: str, blocks: int, stages: int) -> tuple[int, ...]:
    if name.startswith("blocks."):
        block = int(name.split(".")[1])
        return tuple(s for s in range(stages) if block in stage_blocks(blocks, stages, s))
    if name.startswith("tok."):  # the embedding, and the tied head
        return tuple(sorted({0, stages - 1}))
    if name.startswith("pos."):
        return (0,)
    if name.startswith("ln_f."):
        return (stages - 1,)
    raise ValueError(f"pipeline parallel: no stage holds the reference model's parameter {name}")


def split_model(model: ByteGPT, stage: int, stages: int) -> tuple[ByteGPTStage, StagePlacement]:
    """Keep in ``model`` only what ``stage`` holds (in place: what the optimizer, the outer sync
    and the checkpoint see) and return the module that runs it, and its placement (without
    process groups: :func:`split_stage` adds those)."""
    canonical = tuple((name, tuple(p.shape)) for name, p in canonical_parameters(model))
    holders = {name: _holders(name, len(model.blocks), stages) for name, _ in canonical}
    kept = stage_blocks(len(model.blocks), stages, stage)
    setattr(model, "blocks", nn.ModuleDict({str(i): b for i, b in enumerate(model.blocks) if i in kept}))  # noqa: B010
    first, last = stage == 0, stage == stages - 1
    if not first:
        del model.pos
    if not (first or last):
        del model.tok
    if not last:
        del model.ln_f
    return ByteGPTStage(model), StagePlacement(canonical, holders, stage)


def _my_group(rows: list[list[int]]) -> ProcessGroup | None:
    """A group per row of global ranks (every rank creates every one, in order); this rank's."""
    mine = None
    for row in rows:
        group = dist.new_group(row)
        if dist.get_rank() in row:
            mine = group
    return mine


def split_stage(model: ByteGPT, mesh: DeviceMesh) -> ByteGPTStage:
    """:func:`split_model` for this rank's stage of the site's mesh (dim ``pp`` first), leaving
    the placement on ``model`` for :class:`~geodiloco.site.shards.ShardMap`."""
    names = mesh.mesh_dim_names
    assert names is not None and names[0] == PP_DIM
    pp = mesh[PP_DIM]
    stage, stages = pp.get_local_rank(), pp.size()
    module, placement = split_model(model, stage, stages)
    coord = mesh.get_coordinate()
    assert coord is not None
    dp_index, dp_count = 0, 1
    for dim in range(1, mesh.ndim):
        dp_index, dp_count = dp_index * mesh.size(dim) + coord[dim], dp_count * mesh.size(dim)
    ranks = mesh.mesh  # [pp, ...]: the global ranks
    by_stage = ranks.reshape(stages, -1)
    stage_group = _my_group(by_stage.tolist()) if dp_count > 1 else None
    shared = {}
    for holders in sorted({h for h in placement.holders.values() if len(h) > 1}):
        group = pp.get_group() if len(holders) == stages else _my_group(by_stage[list(holders)].T.tolist())
        if stage in holders and group is not None:
            shared[holders] = group
    placed = StagePlacement(
        placement.canonical, placement.holders, stage, dp_index, dp_count, stage_group, shared
    )
    setattr(model, PLACEMENT_ATTR, placed)
    setattr(module, PLACEMENT_ATTR, placed)
    return module


class _Emitted(nn.Module):
    """A stand-in model whose output is a stage's output: lets a loss function written as
    ``loss_fn(model, (*inputs, targets))`` score the last stage's logits."""

    def __init__(self, output: torch.Tensor) -> None:
        super().__init__()
        self.output = output

    def forward(self, *_: Any) -> torch.Tensor:
        return self.output


class Pipelined(nn.Module):
    """This rank's stage of the site's pipeline (``stage``: already data-parallel wrapped).

    It trains and evaluates whole batches through a schedule (:meth:`train_step`,
    :meth:`evaluate`; see :class:`geodiloco.workload.steps.Staged`); calling it runs the batch
    forward and gives the last stage's logits on every stage (the join-time dry step)."""

    def __init__(self, stage: nn.Module, mesh: DeviceMesh, microbatches: int) -> None:
        super().__init__()
        self.stage = stage
        placement = getattr(stage, PLACEMENT_ATTR, None) or getattr(
            getattr(stage, "module", None), PLACEMENT_ATTR, None
        )
        assert isinstance(placement, StagePlacement)
        self.placement = placement
        pp = mesh[PP_DIM]
        self.group = pp.get_group()
        self.index, self.stages = pp.get_local_rank(), pp.size()
        self.last = dist.get_global_rank(self.group, self.stages - 1)
        self.microbatches = microbatches
        cuda = mesh.device_type == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self._schedules: dict[tuple[Any, ...], _PipelineSchedule] = {}
        self._loss_fn: LossFn | None = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.stages - 1

    def _score(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self._loss_fn is not None
        return self._loss_fn(_Emitted(output), (output, target))

    def _schedule(self, inputs: tuple[torch.Tensor, ...], microbatches: int, mode: str) -> _PipelineSchedule:
        """A schedule per batch shape and mode (a stage learns its tensors' shapes on first use)."""
        if len(inputs) != 1:  # refused on every stage alike: none is left waiting for another
            raise TypeError(f"pipeline stages take one input (token ids), not {len(inputs)}")
        key = (tuple((tuple(t.shape), t.dtype) for t in inputs), microbatches, mode)
        schedule = self._schedules.get(key)
        if schedule is None:
            from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

            stage = PipelineStage(self.stage, self.index, self.stages, self.device, group=self.group)
            loss = self._score if mode != "logits" else None
            kind = Schedule1F1B if mode == "train" else ScheduleGPipe
            schedule = self._schedules[key] = kind(stage, microbatches, loss_fn=loss)
        return schedule

    def _shared_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean of the last stage's microbatch losses, on every stage."""
        if self.is_last:
            loss = torch.stack([t.detach().to(torch.float32) for t in losses]).mean()
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self.device)
        dist.broadcast(loss, src=self.last, group=self.group)
        return loss

    def train_step(self, batch: Batch, loss_fn: LossFn) -> torch.Tensor:
        """Forward and backward of ``batch`` (inputs, targets) in microbatches; tied copies'
        gradients summed. Returns the batch's mean loss on every stage."""
        *inputs, target = batch
        if target.shape[0] % self.microbatches:
            raise ValueError(
                f"layout: {self.microbatches} microbatches do not divide a batch of {target.shape[0]} rows"
            )
        self._loss_fn = loss_fn
        schedule = self._schedule(tuple(inputs), self.microbatches, "train")
        losses: list[torch.Tensor] = []
        args = tuple(inputs) if self.is_first else ()
        schedule.step(*args, target=target if self.is_last else None, losses=losses, return_outputs=False)
        self._sum_shared_grads()
        return self._shared_loss(losses)

    @torch.no_grad()
    def _sum_shared_grads(self) -> None:
        for name, p in canonical_parameters(self.stage):
            group = self.placement.shared.get(self.placement.holders[name])
            if group is not None and p.grad is not None:
                dist.all_reduce(local_tensor(p.grad), group=group)

    def _split(self, rows: int) -> int:
        """Microbatches for a forward-only pass: the most, up to the training's, that divide ``rows``."""
        return max(m for m in range(1, min(self.microbatches, rows) + 1) if rows % m == 0)

    @torch.no_grad()
    def evaluate(self, batch: Batch, loss_fn: LossFn) -> tuple[float, int]:
        """The batch's summed loss (mean x rows) and rows, on the last stage; (0, 0) elsewhere,
        so that a sum over the site's ranks counts each batch once."""
        *inputs, target = batch
        rows = target.shape[0]
        self._loss_fn = loss_fn
        schedule = self._schedule(tuple(inputs), self._split(rows), "eval")
        losses: list[torch.Tensor] = []
        args = tuple(inputs) if self.is_first else ()
        schedule.eval(*args, target=target if self.is_last else None, losses=losses)
        if not self.is_last:
            return 0.0, 0
        return float(torch.stack([t.float() for t in losses]).mean()) * rows, rows

    @torch.no_grad()
    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        schedule = self._schedule(inputs, self._split(inputs[0].shape[0]), "logits")
        out = schedule.eval(*(inputs if self.is_first else ()))
        meta = [(tuple(out.shape), out.dtype) if self.is_last else None]
        dist.broadcast_object_list(meta, src=self.last, group=self.group)
        assert meta[0] is not None
        shape, dtype = meta[0]
        logits = out if self.is_last else torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(logits, src=self.last, group=self.group)
        return logits

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float) -> float:
        """Scale the gradients of every stage to a total norm of at most ``max_norm``, counting a
        parameter several stages hold once; returns the norm before."""
        grads, counted = [], []
        for name, p in canonical_parameters(self.stage):
            if p.grad is None:
                continue
            grads.append(p.grad)
            if self.placement.holders[name][0] == self.index:
                counted.append(p.grad)
        squares = squared_grad_norm(counted, self.device)
        dist.all_reduce(squares, group=self.group)
        total = float(squares.sqrt())
        scale_grads(grads, total, max_norm)
        return total
