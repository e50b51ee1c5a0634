"""The canonical flat view of a model's parameters, shared by every site and the coordinator.

Parameters are ordered by canonical name (wrapper prefixes such as DDP's ``module.`` removed),
so the layout does not depend on how a site wraps or shards its model.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.")


def canonical_name(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix) :], True
    return name.replace("._orig_mod.", ".").replace(".module.", ".")


def canonical_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    named = [(canonical_name(n), p) for n, p in model.named_parameters()]
    return sorted(named, key=lambda item: item[0])


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for _, p in canonical_parameters(model))


@torch.no_grad()
def flatten_parameters(model: nn.Module) -> torch.Tensor:
    """A new fp32 vector holding every parameter in canonical order."""
    return torch.cat([p.detach().reshape(-1).to(torch.float32) for _, p in canonical_parameters(model)])


@torch.no_grad()
def load_flat_parameters(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a canonical flat vector into the model's parameters, in place."""
    offset = 0
    for name, p in canonical_parameters(model):
        n = p.numel()
        if offset + n > flat.numel():
            raise ValueError(f"flat vector too short at parameter {name}")
        p.copy_(flat[offset : offset + n].view_as(p))
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} elements, model has {offset}")


def state_hash(flat: torch.Tensor) -> str:
    """SHA-256 of the fp32 bytes: equal hashes mean bit-identical replicas."""
    data = flat.detach().to(torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()
