"""Site checkpoints with ``torch.distributed.checkpoint``: every rank writes its own shards.

A checkpoint holds the model, the inner optimizer, the snapshot θ_r the round started from and
the error-feedback residual, all in the model's own layout (DTensors stay sharded), plus a
small ``site.json`` with the round, the data the round trains on and the steps already taken.
DCP reshards on load, so a site may come back with another number of ranks or another layout;
every entry is keyed by canonical parameter names, so a checkpoint of pipeline stages (each rank
writing its stage's parameters) loads into a site without stages, and back.

The residual lives on the rank that owns each element; it is saved shaped like the parameters
(replicas add their disjoint parts together), so any new owner finds its part. A run of
P > 1 fragments keeps one residual per fragment, each over its own parameters: saved the same
way, side by side. Fragments in flight are landed (:meth:`OuterSync.drain`) before a checkpoint,
so no fragment is saved half way through its exchange.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from geodiloco.params import canonical_parameters
from geodiloco.site.outer_sync import OuterSync
from geodiloco.site.shards import ShardMap, local_tensor, replica_groups, stage_placement
from geodiloco.workload.data import DataRange

log = logging.getLogger("geodiloco.site")

META = "site.json"
KEEP = 2


@dataclass(frozen=True, slots=True)
class CheckpointMeta:
    round: int
    steps_in_round: int
    tokens_in_round: int
    data: list[list[int]]  # [shard, start, end, epoch] of the round's data
    state_hash: str  # canonical hash of θ_r (the snapshot)
    params_hash: str  # canonical hash of the model as saved
    residual_hash: str  # canonical hash of the error-feedback residual
    ranks: int
    layout: str
    fragment_tokens: list[int] = field(default_factory=list)  # per fragment, trained since its push
    steps_trained: int = -1  # the site's inner steps so far (the lr schedule's in rounds by time)


def _like_params(model: nn.Module, locals_: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors laid out like the parameters, from local pieces (DTensors where they are)."""
    out = {}
    for (name, p), local in zip(canonical_parameters(model), locals_, strict=True):
        value = local.reshape(local_tensor(p).shape)
        if isinstance(p, DTensor):
            value = DTensor.from_local(value, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        out[name] = value
    return out


def _residual_pieces(sync: OuterSync) -> list[torch.Tensor]:
    """The rank's residual (every fragment's) laid out like its local pieces (zero where another
    rank owns)."""
    assert sync.shards is not None
    pieces = [torch.zeros_like(p.local, dtype=torch.float32) for p in sync.shards.pieces]
    for f in sync.fragments:
        at = 0
        for owned, view in f.shards.owned_views([pieces[i] for i in f.members]):
            n = owned.segment.numel
            view.copy_(f.feedback.residual[at : at + n].view(view.shape))
            at += n
    return pieces


def _residual_like_params(sync: OuterSync) -> list[torch.Tensor]:
    """The residual spread over local pieces, replicas' disjoint parts added together."""
    assert sync.model is not None
    pieces = _residual_pieces(sync)
    placement = stage_placement(sync.model)  # a pipeline stage's replicas: its ranks, tied copies
    for (name, p), piece in zip(canonical_parameters(sync.model), pieces, strict=True):
        for group in replica_groups(name, p, placement):
            dist.all_reduce(piece, group=group)
    return pieces


def _state(model: nn.Module, optimizer: torch.optim.Optimizer, sync: OuterSync) -> dict[str, Any]:
    model_state, optim_state = get_state_dict(model, optimizer)
    return {
        "model": model_state,
        "optim": optim_state,
        "snapshot": _like_params(model, sync.snapshot),
        "residual": _like_params(model, _residual_like_params(sync)),
    }


def save(
    directory: Path, model: nn.Module, optimizer: torch.optim.Optimizer, sync: OuterSync, layout: str
) -> Path:
    """Write a checkpoint of the site's state now (all ranks call it); keeps the last two."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    sync.drain()  # no fragment half way through its exchange: its snapshot and residual are whole
    path = directory / f"round-{sync.round:06d}-step-{sync.steps_in_round:04d}"
    state = _state(model, optimizer, sync)
    dcp.save(state, checkpoint_id=str(path))
    meta = CheckpointMeta(
        round=sync.round,
        steps_in_round=sync.steps_in_round,
        tokens_in_round=sync.tokens_in_round,
        data=[[d.shard, d.start, d.end, d.epoch] for d in sync.data],
        state_hash=sync.digest(sync.snapshot),
        params_hash=sync.digest(),
        residual_hash=residual_digest(sync),
        ranks=dist.get_world_size() if dist.is_initialized() else 1,
        layout=layout,
        fragment_tokens=[f.tokens for f in sync.fragments],
        steps_trained=sync.steps_trained,
    )
    if rank == 0:
        tmp = path / (META + ".tmp")
        tmp.write_text(json.dumps(asdict(meta), indent=2))
        tmp.rename(path / META)  # a checkpoint without site.json is incomplete and never loaded
        for old in sorted(p for p in directory.glob("round-*") if (p / META).exists())[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
        log.info("checkpoint of round %d step %d written to %s", sync.round, sync.steps_in_round, path)
    if dist.is_initialized():
        dist.barrier()
    return path


def latest(directory: Path) -> Path | None:
    done = sorted(p for p in directory.glob("round-*") if (p / META).exists())
    return done[-1] if done else None


def read_meta(path: Path) -> CheckpointMeta:
    return CheckpointMeta(**json.loads((path / META).read_text()))


def load(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, sync: OuterSync) -> CheckpointMeta:
    """Restore a checkpoint into an attached ``sync`` with this site's (possibly new) layout."""
    assert sync.shards is not None
    state = _state(model, optimizer, sync)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    shards = ShardMap(model, sync.group.rank, sync.group.world)
    sync.snapshot = [
        local_tensor(t).detach().to(torch.float32).reshape(p.local.shape).clone()
        for t, p in zip(state["snapshot"].values(), shards.pieces, strict=True)
    ]
    residual = [
        local_tensor(t).detach().to(torch.float32).reshape(p.local.shape)
        for t, p in zip(state["residual"].values(), shards.pieces, strict=True)
    ]
    for f in sync.fragments:
        owned = shards if len(sync.fragments) == 1 else f.shards
        f.feedback.residual.copy_(owned.gather_owned([residual[i] for i in f.members]))
    meta = read_meta(path)
    sync.steps_in_round, sync.tokens_in_round = meta.steps_in_round, meta.tokens_in_round
    if meta.steps_trained >= 0:  # a checkpoint written before it was kept: counted from the round
        sync.steps_trained = meta.steps_trained
    for f, tokens in zip(sync.fragments, meta.fragment_tokens, strict=False):
        f.tokens = tokens
    sync.data = [DataRange(*d) for d in meta.data]
    return meta


def residual_digest(sync: OuterSync) -> str:
    """Canonical hash of the error-feedback residual, whatever the layout (with fragments, whose
    owners may differ from the whole model's, every rank's replicas summed first)."""
    if len(sync.fragments) == 1:
        return sync.digest(_residual_pieces(sync))
    return sync.digest(_residual_like_params(sync))
