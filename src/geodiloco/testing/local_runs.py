"""Sites that run the whole outer loop in threads against an in-process coordinator (no gRPC):
a small model of plain tensors, a stand-in inner step, and the record of every merge."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from geodiloco.config import RunConfig
from geodiloco.params import canonical_parameters, flatten_parameters
from geodiloco.site.fragment_schedule import FragmentPlan
from geodiloco.site.outer_sync import OuterSync
from geodiloco.testing.local_link import LocalCoordinator


def global_snapshot(sync: Any) -> torch.Tensor:
    """A site's copy of the global parameters (its OuterSync's snapshot), as one flat vector."""
    return torch.cat([t.reshape(-1) for t in sync.snapshot])


class Blocks(nn.Module):
    """Four numbered blocks and a head, the same values in every instance (θ_0): a model whose
    fragment plan has several layers to stride over."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 2)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))


TOKENS = 64  # a step of tiny_config's data (4 x 16): what the ledger weighs; a larger claim is capped


def coordinator_for(cfg: RunConfig) -> LocalCoordinator:
    model = Blocks()
    plan = FragmentPlan.of_model(model, cfg.outer.fragments)
    return LocalCoordinator(cfg, flatten_parameters(model), [10_000] * cfg.data.shards, plan)


@torch.no_grad()
def inner_step(model: nn.Module, gen: torch.Generator) -> None:
    """A stand-in for an optimizer step: a small seeded move of every parameter."""
    for _, p in canonical_parameters(model):
        p.add_(torch.randn(p.shape, generator=gen) * 1e-2)


Hook = Callable[[OuterSync, int], None]  # called before each inner step: (sync, global step)


def train(coordinator: LocalCoordinator, name: str, out: dict[str, object], hook: Hook | None = None) -> None:
    sync = OuterSync.over(coordinator.link(name))
    model = sync.attach(Blocks())
    reloaded = sync.bytes_received  # nothing pulled at attach: the site starts from θ_0
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    step, merges = 0, []
    try:
        while not sync.finished:
            if hook is not None:
                hook(sync, step)
            inner_step(model, gen)
            before = flatten_parameters(model)
            if sync.step(tokens=TOKENS):
                sync.report(1.0, 1, 0.5, 0.01)
            merges.append((before, flatten_parameters(model), global_snapshot(sync)))
            step += 1
    finally:
        sync.close()
    out[name] = {"sync": sync, "model": model, "merges": merges, "reloaded": reloaded}


def run_sites(coordinator: LocalCoordinator, hooks: dict[str, Hook] | None = None) -> dict[str, dict]:
    out: dict[str, dict] = {}
    threads = [
        threading.Thread(target=train, args=(coordinator, n, out, (hooks or {}).get(n)))
        for n in coordinator.cfg.sites
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(out) == set(coordinator.cfg.sites), "a site did not finish"
    return out
