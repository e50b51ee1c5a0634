"""The site-side API against a real coordinator over loopback (no torchrun: one rank per site)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from geodiloco.params import flatten_parameters, state_hash
from geodiloco.site import OuterSync, OuterSyncClient
from geodiloco.workload import build_model
from helpers import CoordinatorThread, free_port, tiny_config

pytestmark = pytest.mark.integration


def train_site(target: str, name: str, results: dict[str, list[str]], params: dict[str, list[str]]) -> None:
    sync = OuterSync.connect(target, name)
    cfg = sync.config
    model = sync.attach(build_model(cfg.model, cfg.seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
    gen = torch.Generator().manual_seed(hash(name) % 1000)
    hashes, params[name] = [], []
    while not sync.finished:
        x = torch.randint(0, 256, (4, cfg.model.seq_len), generator=gen)
        loss = model(x, x)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if sync.step(tokens=x.numel()):
            assert sync.last_result is not None
            hashes.append(sync.last_result.state_hash)  # the site's copy of the global state
            params[name].append(state_hash(flatten_parameters(model)))
            sync.report(1.0, 1, float(loss), 0.1)
    sync.close()
    results[name] = hashes


@pytest.mark.parametrize("overlap", [0, 1])
def test_sites_apply_identical_updates_through_the_api(overlap: int) -> None:
    """Blocking, and overlapped (the push and pull of a round run beside one inner step)."""
    cfg = tiny_config(rounds=3, outer__overlap_steps=overlap)
    with CoordinatorThread(cfg) as coordinator:
        results: dict[str, list[str]] = {}
        params: dict[str, list[str]] = {}
        threads = [
            threading.Thread(target=train_site, args=(coordinator.target, n, results, params))
            for n in cfg.sites
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        expected = [coordinator.controller.hashes[r] for r in (1, 2, 3)]
        assert results["site-a"] == results["site-b"] == expected
        # blocking: the parameters are the global ones; overlapped: the global ones mixed in
        assert (params["site-a"] == expected) == (overlap == 0)
        assert state_hash(coordinator.controller.theta) == expected[-1]
        assert all(h.hashes_agree and len(h.hash_reports) == 2 for h in coordinator.controller.history)


def test_late_site_catches_up_from_full_state() -> None:
    # the first round waits for site-b until its deadline; later ones only for live sites
    cfg = tiny_config(rounds=3, min_sites=1, sites=["site-a", "site-b"], round_timeout_s=1.0)
    with CoordinatorThread(cfg) as coordinator:
        results: dict[str, list[str]] = {}
        train_site(coordinator.target, "site-a", results, {})  # runs the whole run alone
        late = OuterSync.connect(coordinator.target, "site-b")
        model = late.attach(build_model(cfg.model, cfg.seed))
        assert late.finished and late.round == 3
        assert state_hash(flatten_parameters(model)) == coordinator.controller.hashes[3]
        late.close()


def test_a_fragmented_run_is_refused_by_a_coordinator_that_keeps_one_fragment() -> None:
    refused = pytest.raises(RuntimeError, match=r"outer\.fragments is 3, but its coordinator keeps 1")
    with CoordinatorThread(tiny_config(outer__fragments=3)) as coordinator, refused:
        OuterSync.connect(coordinator.target, "site-a")


def test_site_started_before_the_coordinator_waits_for_it() -> None:
    port = free_port()
    joined: dict[str, int] = {}

    def join() -> None:
        joined["round"] = OuterSyncClient(f"127.0.0.1:{port}", "site-a").join().round

    thread = threading.Thread(target=join)
    thread.start()
    time.sleep(1.5)
    assert not joined
    with CoordinatorThread(tiny_config(), port=port):
        thread.join(30)
    assert joined == {"round": 0}
