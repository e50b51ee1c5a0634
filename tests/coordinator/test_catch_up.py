"""A site that missed rounds catches up from the coordinator's kept updates when it missed only
one or two (bit-identical, fewer bytes than the full state), else from the full state.

Real coordinator over loopback, the real site API in-process (one rank)."""

from __future__ import annotations

import time

import pytest
import torch

from geodiloco.params import flatten_parameters, load_flat_parameters, state_hash
from geodiloco.site import connect
from geodiloco.site.outer_sync import CATCH_UP_ROUNDS
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.servers import CoordinatorThread
from geodiloco.workload import build_model

pytestmark = pytest.mark.integration


def commit_without(coordinator: CoordinatorThread, rounds: int) -> None:
    """site-a alone commits ``rounds`` rounds (each closes at the deadline: site-b is live)."""
    c = coordinator.controller
    coordinator.call(c.join("site-a", ""))
    gen = torch.Generator().manual_seed(0)
    for _ in range(rounds):
        r = c.round
        delta = torch.randn(c.num_params, generator=gen) * 1e-3
        coordinator.call(c.contribute("site-a", "", r, 100, delta))
        deadline = time.monotonic() + 30
        while c.round == r:
            assert time.monotonic() < deadline, "round did not close at its deadline"
            time.sleep(0.05)


@pytest.mark.parametrize("missed", [CATCH_UP_ROUNDS, CATCH_UP_ROUNDS + 1])
def test_site_behind_by_rounds_catches_up_bit_identically(missed: int) -> None:
    # missed rounds beyond outer.max_staleness: the push is refused, not merged
    cfg = tiny_config(rounds=10, min_sites=1, round_timeout_s=0.3, lease_s=30.0, outer__max_staleness=1)
    with CoordinatorThread(cfg) as coordinator:
        c = coordinator.controller
        sync = connect(coordinator.target, "site-b")
        try:
            model = sync.attach(build_model(cfg.model, cfg.seed))
            with torch.no_grad():  # as if site-b had trained round 0, slowly
                load_flat_parameters(model, flatten_parameters(model) * 0.999)
            commit_without(coordinator, missed)
            received = sync.bytes_received
            result = sync.sync()  # round 0 closed without it: refused, rejoin, catch up
            received = sync.bytes_received - received
        finally:
            sync.close()
        assert sync.round == missed and result.round == missed - 1
        assert state_hash(flatten_parameters(model)) == c.hashes[missed] == result.state_hash
        assert c.sites["site-b"].late == 1
        updates = sum(c.updates[r].payload_bytes for r in range(missed))
        state = sum(len(chunk.payload) for chunk in c.full_state().chunks)
        if missed <= CATCH_UP_ROUNDS:
            assert updates <= received < min(state, updates + 4096)  # the updates, not the state
        else:
            assert received >= state
