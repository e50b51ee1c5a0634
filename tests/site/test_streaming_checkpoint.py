"""A site checkpoint of a streaming run (P > 1 fragments, τ > 0): the fragment in flight is
landed first, and every fragment's snapshot, error-feedback residual and token count come back
from the checkpoint exactly (in-process coordinator, plain tensors, one process)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

import geodiloco.site.parallel.checkpoint as checkpoint
from geodiloco.params import flatten_parameters
from geodiloco.site.outer_sync import OuterSync
from geodiloco.testing.configs import streaming_config
from geodiloco.testing.local_runs import TOKENS, Blocks, coordinator_for, inner_step


def test_a_checkpoint_mid_round_lands_the_fragment_in_flight_and_restores_every_fragment(
    tmp_path: Path,
) -> None:
    cfg = streaming_config(fragments=2, overlap=1, rounds=3)
    seen: dict[str, Any] = {}

    def train(coordinator: Any, name: str, out: dict[str, OuterSync]) -> None:
        sync = OuterSync.over(coordinator.link(name))
        model = sync.attach(Blocks())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        gen = torch.Generator().manual_seed(sum(map(ord, name)))
        step = 0
        try:
            while not sync.finished:
                if name == "site-a" and step == cfg.inner.steps_per_round + 1:
                    checkpoint_and_reload(sync, model, optimizer)
                inner_step(model, gen)
                if sync.step(tokens=TOKENS):
                    sync.report(1.0, 1, 0.5, 0.01)
                step += 1
        finally:
            sync.close()
        out[name] = sync

    def checkpoint_and_reload(sync: OuterSync, model: torch.nn.Module, optimizer: Any) -> None:
        first = sync.fragments[0]
        assert first.in_flight is not None  # pushed at step H/P - τ, merged τ steps later
        seen["round_before"] = first.round
        path = checkpoint.save(tmp_path, model, optimizer, sync, "ddp")
        assert all(f.in_flight is None for f in sync.fragments)  # drained before saving
        assert first.round == seen["round_before"] + 1  # it landed
        residuals = [f.feedback.residual.clone() for f in sync.fragments]
        snapshot = [t.clone() for t in sync.snapshot]
        tokens = [f.tokens for f in sync.fragments]
        params, steps_trained = flatten_parameters(model), sync.steps_trained
        assert any(r.abs().sum() > 0 for r in residuals)
        for f in sync.fragments:  # forget it all; the checkpoint must bring every fragment back
            f.feedback.residual.zero_()
            f.tokens = 0
        sync.steps_trained = 0
        for t in sync.snapshot:
            t.zero_()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        checkpoint.load(path, model, optimizer, sync)
        for f, r, n in zip(sync.fragments, residuals, tokens, strict=True):
            assert torch.equal(f.feedback.residual, r) and f.tokens == n
        assert all(torch.equal(a, b) for a, b in zip(sync.snapshot, snapshot, strict=True))
        assert torch.equal(flatten_parameters(model), params)
        assert sync.steps_trained == steps_trained == cfg.inner.steps_per_round + 1  # the lr schedule's
        meta = checkpoint.read_meta(path)
        assert meta.state_hash == sync.digest(sync.snapshot)
        assert meta.residual_hash == checkpoint.residual_digest(sync)
        seen["saved"] = path

    with coordinator_for(cfg) as coordinator:
        out: dict[str, OuterSync] = {}
        threads = [threading.Thread(target=train, args=(coordinator, n, out)) for n in cfg.sites]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert set(out) == set(cfg.sites) and "saved" in seen
        # the early landing changed nothing the coordinator checks: every hash agrees
        for c in coordinator.controller.fragments:
            assert len(c.history) == cfg.rounds and all(h.hashes_agree for h in c.history)
        theta = coordinator.controller.theta()
        for sync in out.values():
            assert torch.equal(torch.cat([t.reshape(-1) for t in sync.snapshot]), theta)
