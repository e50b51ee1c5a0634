"""The site-side API against a real coordinator over loopback (no torchrun: one rank per site)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import torch

from geodiloco.app.wan import LinkConfig, ProxyThread
from geodiloco.compression.staging import Staging
from geodiloco.faults import FAULT_PLAN_ENV, fired
from geodiloco.params import flatten_parameters, state_hash
from geodiloco.site import connect
from geodiloco.site.edge.client import OuterSyncClient
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.local_runs import global_snapshot
from geodiloco.testing.servers import CoordinatorThread, free_port
from geodiloco.workload import build_model

pytestmark = pytest.mark.integration


def train_site(
    target: str,
    name: str,
    results: dict[str, list[str]],
    params: dict[str, list[str]],
    staging: Staging | None = None,
) -> None:
    sync = connect(target, name)
    cfg = sync.config
    model = sync.attach(build_model(cfg.model, cfg.seed), staging)
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


def test_a_push_sends_the_snapshot_minus_the_parameters_plus_the_kept_residual() -> None:
    cfg = tiny_config(rounds=1, compression__feedback_decay=0.5)
    with CoordinatorThread(cfg) as coordinator:
        sync = connect(coordinator.target, "site-a")
        model = sync.attach(build_model(cfg.model, cfg.seed))
        with torch.no_grad():
            for p in model.parameters():  # as inner steps would
                p.add_(torch.randn_like(p))
        fragment = sync.fragments[0]
        fragment.feedback.residual = torch.randn(fragment.shards.owned_numel)
        change = global_snapshot(sync) - flatten_parameters(model)
        expected = torch.add(change, fragment.feedback.residual, alpha=0.5)
        assert torch.equal(fragment.encode_delta().to_send, expected)
        sync.close()


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


def test_a_pull_broken_midway_is_applied_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A site of one rank applies its pull as the chunks arrive: when its link is reset after
    three chunks of round 1, the stream comes again from the start, and the chunks it brings
    again are not added a second time (the hashes would part). The link is slow (0.1 Mbit/s,
    an update's 16 chunks take about half a second), so the reset cuts the stream midway."""
    cfg = tiny_config(rounds=3, compression__chunk_elements=500)
    slow = LinkConfig(bandwidth_mbps=0.1)
    with (
        CoordinatorThread(cfg) as coordinator,
        ProxyThread(coordinator.target, slow, control_port=0) as proxy,
    ):
        plan = tmp_path / "plan.json"
        drop = {"action": "drop", "site": "site-a", "round": 1, "at": "pull", "chunk": 3}
        plan.write_text(json.dumps({"links": {"site-a": proxy.control_address}, "faults": [drop]}))
        monkeypatch.setenv(FAULT_PLAN_ENV, str(plan))
        results: dict[str, list[str]] = {}
        targets = {"site-a": proxy.address, "site-b": coordinator.target}
        threads = [
            threading.Thread(target=train_site, args=(target, name, results, {}))
            for name, target in targets.items()
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert fired(plan)[0]["fault"] == {**fired(plan)[0]["fault"], **drop}
        expected = [coordinator.controller.hashes[r] for r in (1, 2, 3)]
        assert results["site-a"] == results["site-b"] == expected


@pytest.mark.parametrize("overlap", [0, 1])
def test_a_site_that_decodes_on_its_device_holds_the_same_global_state(overlap: int) -> None:
    """site-a takes the device-resident path (updates decoded, added and hashed where its model
    is, through a staging whose copies are plain on the CPU), site-b the host path: the same
    state hash as the coordinator's after every round, and the same global state bit for bit.
    The full state a late site takes goes the device-resident way too."""
    cfg = tiny_config(rounds=3, outer__overlap_steps=overlap, min_sites=2)
    resident = Staging(torch.device("cpu"), resident=True)
    with CoordinatorThread(cfg) as coordinator:
        results: dict[str, list[str]] = {}
        threads = [
            threading.Thread(target=train_site, args=(coordinator.target, n, results, {}, s))
            for n, s in (("site-a", resident), ("site-b", None))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        expected = [coordinator.controller.hashes[r] for r in (1, 2, 3)]
        assert results["site-a"] == results["site-b"] == expected
        assert all(h.hashes_agree and len(h.hash_reports) == 2 for h in coordinator.controller.history)
        late = connect(coordinator.target, "site-b")
        model = late.attach(build_model(cfg.model, cfg.seed), Staging(torch.device("cpu"), resident=True))
        assert torch.equal(
            flatten_parameters(model).view(torch.int32), coordinator.controller.theta.view(torch.int32)
        )
        late.close()


def test_late_site_catches_up_from_full_state() -> None:
    # the first round waits for site-b until its deadline; later ones only for live sites
    cfg = tiny_config(rounds=3, min_sites=1, sites=["site-a", "site-b"], round_timeout_s=1.0)
    with CoordinatorThread(cfg) as coordinator:
        results: dict[str, list[str]] = {}
        train_site(coordinator.target, "site-a", results, {})  # runs the whole run alone
        late = connect(coordinator.target, "site-b")
        model = late.attach(build_model(cfg.model, cfg.seed))
        assert late.finished and late.round == 3
        assert state_hash(flatten_parameters(model)) == coordinator.controller.hashes[3]
        late.close()


def test_a_fragmented_run_is_refused_by_a_coordinator_that_keeps_one_fragment() -> None:
    refused = pytest.raises(RuntimeError, match=r"outer\.fragments is 3, but its coordinator keeps 1")
    with CoordinatorThread(tiny_config(outer__fragments=3)) as coordinator, refused:
        connect(coordinator.target, "site-a")


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


def test_a_site_on_several_streams_applies_the_same_updates() -> None:
    """site-a pushes and pulls on 3 TCP connections (through a proxy that counts them), site-b
    on one: every round commits both contributions and both sites hold the global hash."""
    cfg = tiny_config(rounds=3, compression__chunk_elements=500)
    with CoordinatorThread(cfg) as coordinator, ProxyThread(coordinator.target) as proxy:
        results: dict[str, list[str]] = {}
        connections: list[int] = []

        def site_a() -> None:
            sync = connect(proxy.address, "site-a", streams=3)
            connections.append(proxy.proxy.open_connections)
            model = sync.attach(build_model(cfg.model, cfg.seed))
            optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.inner.lr)
            hashes = []
            while not sync.finished:
                x = torch.randint(0, 256, (4, cfg.model.seq_len))
                model(x, x).backward()
                optimizer.step()
                optimizer.zero_grad()
                if sync.step(tokens=x.numel()):
                    assert sync.last_result is not None
                    hashes.append(sync.last_result.state_hash)
                    connections.append(proxy.proxy.open_connections)
            sync.close()
            results["site-a"] = hashes

        threads = [
            threading.Thread(target=site_a),
            threading.Thread(target=train_site, args=(coordinator.target, "site-b", results, {})),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        expected = [coordinator.controller.hashes[r] for r in (1, 2, 3)]
        assert results["site-a"] == results["site-b"] == expected
        assert all(len(h.contributors) == 2 for h in coordinator.controller.history)
        assert max(connections) == 3  # pushes and pulls went out on three connections
