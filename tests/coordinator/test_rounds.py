"""The round state machine on plain tensors: every transition, no gRPC."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from geodiloco.coordinator.durable import STATE_FILE, CorruptStateError, load_state
from geodiloco.coordinator.edge.server import data_shard_sizes
from geodiloco.coordinator.refusals import ContributionMissing, FailedPrecondition, LateContribution
from geodiloco.coordinator.reports import REPORT_LOG
from geodiloco.coordinator.rounds import RoundController
from geodiloco.coordinator.updatelog import UpdateLogWriter
from geodiloco.params import state_hash
from geodiloco.testing.audits import ledger_problems, round_log
from geodiloco.testing.configs import tiny_config

N = 1000


def controller(tmp_path: Path | None = None, **overrides: object) -> RoundController:
    # the ledger's 12 windows a round weigh 1200 tokens: the claims below (<= 1200) are the weights
    settings = {"round_timeout_s": 0.2, "limits__max_delta_norm_ratio": 0.0, "data__tokens_per_item": 100}
    cfg = tiny_config(**{**settings, **overrides})
    return RoundController(cfg, torch.zeros(N), [1000] * cfg.data.shards, tmp_path)


async def join_all(c: RoundController) -> None:
    for name in c.cfg.sites:
        await c.join(name, "")


async def test_quorum_of_all_live_sites_closes_the_round() -> None:
    c = controller()
    await join_all(c)
    await c.contribute("site-a", "", 0, 100, torch.ones(N))
    assert c.round == 0
    await c.contribute("site-b", "", 0, 300, torch.full((N,), 3.0))
    assert c.round == 1 and c.history[0].contributors == ["site-a", "site-b"]
    assert c.history[0].tokens == 400


async def test_deadline_with_quorum_closes_without_the_straggler() -> None:
    c = controller(min_sites=1)
    await join_all(c)
    await c.contribute("site-a", "", 0, 100, torch.ones(N))
    assert c.round == 0  # site-b is live: wait for it until the deadline
    await asyncio.sleep(0.25)
    await c.tick()
    assert c.round == 1 and c.history[0].contributors == ["site-a"]


async def test_deadline_without_quorum_waits_and_says_so() -> None:
    c = controller(min_sites=2)
    await join_all(c)
    await c.contribute("site-a", "", 0, 100, torch.ones(N))
    await asyncio.sleep(0.25)
    await c.tick()
    assert c.round == 0 and c.phase == "waiting_for_quorum"
    await c.contribute("site-b", "", 0, 100, torch.ones(N))
    assert c.round == 1 and c.phase == "training"


async def test_late_contribution_is_dropped_and_counted() -> None:
    c = controller(min_sites=1, outer__max_staleness=0)  # late merging off
    await join_all(c)
    await c.contribute("site-a", "", 0, 100, torch.ones(N))
    await asyncio.sleep(0.25)
    await c.tick()
    theta = c.theta.clone()
    with pytest.raises(LateContribution) as err:
        await c.contribute("site-b", "", 0, 100, torch.ones(N))
    c.record_rejection("site-b", err.value)
    assert c.sites["site-b"].late == 1 and c.sites["site-b"].rejected == 0
    assert torch.equal(c.theta, theta) and not c.mean.contributors


async def test_duplicate_push_changes_nothing() -> None:
    c = controller()
    await join_all(c)
    assert await c.contribute("site-a", "", 0, 100, torch.ones(N))
    assert not await c.contribute("site-a", "", 0, 100, torch.full((N,), 9.0))
    assert c.mean.weight == 100 and c.sites["site-a"].accepted == 1
    await c.contribute("site-b", "", 0, 100, torch.ones(N))
    assert not await c.contribute("site-b", "", 0, 100, torch.ones(N))  # after the commit too
    assert c.round == 1


async def test_lost_site_stops_being_waited_for() -> None:
    c = controller(min_sites=1, round_timeout_s=60.0, lease_s=0.6, heartbeat_interval_s=0.1)
    await join_all(c)
    for name in ("site-a", "site-b"):  # the first round waits for every site
        await c.contribute(name, "", 0, 100, torch.ones(N))
    await c.contribute("site-a", "", 1, 100, torch.ones(N))
    await asyncio.sleep(0.7)
    c.member("site-a", "")  # site-a is alive; site-b went silent mid-round
    await c.tick()
    assert c.sites["site-b"].state == "lost"
    assert c.round == 2 and c.history[1].contributors == ["site-a"]
    with pytest.raises(FailedPrecondition, match="has not joined"):
        c.member("site-b", "")


async def test_pull_without_a_contribution_is_refused_instead_of_waiting_forever() -> None:
    c = controller()
    await join_all(c)
    with pytest.raises(ContributionMissing):
        await c.wait_for_update(0, "site-a")


async def test_fedavg_commit_matches_hand_computation_and_every_receiver_view() -> None:
    c = controller(outer__optimizer="fedavg", outer__lr=1.0, outer__momentum=0.0)
    await join_all(c)
    await c.contribute("site-a", "", 0, 100, torch.full((N,), 0.5))
    await c.contribute("site-b", "", 0, 300, torch.full((N,), -0.5))
    # Δ = (100 * 0.5 + 300 * -0.5) / 400 = -0.25; θ = 0 - Δ = 0.25 (int8 is exact for a constant)
    assert torch.allclose(c.theta, torch.full((N,), 0.25))
    update = await c.wait_for_update(0, "site-a")
    assert update is not None and update.state_hash == state_hash(c.theta) == c.hashes[1]


async def test_the_coordinator_decays_its_residual_by_its_own_rate() -> None:
    # top-k keeps the 10 largest of the change; the rest waits in the coordinator's residual,
    # which the next round decays by compression.downlink_feedback_decay (the sites keep theirs)
    cfg = {
        "outer__optimizer": "fedavg",
        "outer__lr": 1.0,
        "compression__uplink": "fp32",
        "compression__downlink": "topk:0.01|fp32",
        "compression__feedback_decay": 1.0,
        "compression__downlink_feedback_decay": 0.5,
    }
    c = controller(**cfg)
    await join_all(c)
    delta = -torch.arange(N, dtype=torch.float32) / N  # θ moves by +i/N: top 1% are the last 10
    for name in c.cfg.sites:
        await c.contribute(name, "", 0, 100, delta.clone())
    kept = c.theta != 0
    assert int(kept.sum()) == 10 and bool(kept[-10:].all())
    assert torch.allclose(c.downlink_feedback.residual[:-10], -delta[:-10], rtol=1e-6, atol=0)
    for name in c.cfg.sites:
        await c.contribute(name, "", 1, 100, torch.zeros(N))
    # round 1 sends 0 + 0.5 · the residual: its top 10 are the next largest, halved
    assert torch.allclose(c.theta[-20:-10], -delta[-20:-10] * 0.5, rtol=1e-6, atol=0)


async def test_an_update_is_served_only_once_it_is_durable(tmp_path: Path) -> None:
    c = controller(tmp_path)
    await join_all(c)
    release, persisted = asyncio.Event(), asyncio.Event()
    persist = c._persist

    async def slow_persist(log_file: UpdateLogWriter | None) -> None:
        await release.wait()
        await persist(log_file)
        persisted.set()

    c._persist = slow_persist  # type: ignore[method-assign]
    await c.contribute("site-a", "", 0, 100, torch.ones(N))
    commit = asyncio.create_task(c.contribute("site-b", "", 0, 100, torch.ones(N)))
    while c.round == 0:  # the commit has moved the round on, and waits to be written
        await asyncio.sleep(0.01)
    pull = asyncio.create_task(c.wait_for_update(0, "site-a"))
    await asyncio.sleep(0.2)
    assert not pull.done()
    release.set()
    update = await pull
    assert persisted.is_set() and update is not None and update.round == 0
    await commit


async def test_state_survives_a_restart_bit_for_bit(tmp_path: Path) -> None:
    c = controller(tmp_path)
    await join_all(c)
    for r in range(2):
        for site in c.cfg.sites:
            await c.contribute(site, "", r, 100, torch.randn(N) * 0.01)
    await c.checkpoint()  # a graceful stop: the snapshot holds everything, momentum included
    restarted = controller(tmp_path)
    assert restarted.round == 2 and torch.equal(restarted.theta, c.theta)
    assert restarted.hashes == c.hashes
    assert restarted.optimizer.state_dict()["steps"] == 2  # type: ignore[index]
    assert torch.equal(restarted.downlink_feedback.residual, c.downlink_feedback.residual)
    assert [h.state_hash for h in restarted.history] == [h.state_hash for h in c.history]
    assert len((tmp_path / "rounds.jsonl").read_text().splitlines()) == 2
    # the same next contributions give the same next state in both
    for ctl in (c, restarted):
        for site in ctl.cfg.sites:
            await ctl.join(site, "")
            await ctl.contribute(site, "", 2, 100, torch.full((N,), 0.01))
    assert torch.equal(restarted.theta, c.theta)


def test_corrupt_state_is_refused(tmp_path: Path) -> None:
    c = controller(tmp_path, snapshot_every=1)
    asyncio.run(_one_round(c))
    path = tmp_path / STATE_FILE
    data = bytearray(path.read_bytes())
    data[-10] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptStateError, match="checksum"):
        load_state(path)


async def _one_round(c: RoundController) -> None:
    await join_all(c)
    for site in c.cfg.sites:
        await c.contribute(site, "", 0, 100, torch.ones(N))


def test_state_of_another_run_is_refused(tmp_path: Path) -> None:
    asyncio.run(_one_round(controller(tmp_path)))
    with pytest.raises(ValueError, match="belongs to run 'test-run'"):
        controller(tmp_path, run_id="other")


async def test_reports_after_the_last_commit_survive_a_restart(tmp_path: Path) -> None:
    c = controller(tmp_path)
    await join_all(c)
    await c.contribute("site-a", "", 0, 100, torch.ones(N))
    await c.contribute("site-b", "", 0, 100, torch.ones(N))
    await c.report("site-a", "", 0, c.hashes[1], 6.0, 3, 2.5)
    for site in c.cfg.sites:  # round 1 commits: its snapshot holds site-a's report of round 0
        await c.contribute(site, "", 1, 100, torch.ones(N))
    await c.report("site-a", "", 0, c.hashes[1], 6.0, 3, 2.5)  # a retried report: no change
    await c.report("site-b", "", 1, "not-the-hash", 4.0, 2, 2.0)  # after the last commit
    await c.report("site-a", "", 1, c.hashes[2], 2.0, 2, 1.5)
    restarted = controller(tmp_path)
    assert restarted.history[0].hash_reports == {"site-a": True}
    assert restarted.history[0].eval_count == 3  # applied once, though logged and snapshotted
    assert restarted.history[1].hash_reports == {"site-b": False, "site-a": True}
    assert restarted.history[1].eval_loss == pytest.approx(6.0 / 4)
    assert not restarted.sites["site-b"].hash_ok and restarted.sites["site-b"].last_report_round == 1
    assert restarted.sites["site-a"].eval_loss == pytest.approx(1.0)


async def test_a_torn_last_report_line_is_skipped(tmp_path: Path) -> None:
    c = controller(tmp_path)
    await _one_round(c)
    await c.report("site-a", "", 0, c.hashes[1], 1.0, 1, 1.0)
    with open(tmp_path / REPORT_LOG, "a") as f:
        f.write('{"round": 0, "site": "site-b", "hash_')  # the crash hit mid-append
    restarted = controller(tmp_path)
    assert restarted.history[0].hash_reports == {"site-a": True}


async def test_a_torn_round_log_line_is_rewritten_on_restart(tmp_path: Path) -> None:
    c = controller(tmp_path)
    await _one_round(c)
    for site in c.cfg.sites:
        await c.contribute(site, "", 1, 100, torch.ones(N))
    path = tmp_path / "rounds.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + lines[1][:25])  # killed while writing round 1's line
    controller(tmp_path)
    log = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["round"] for r in log] == [0, 1]
    assert [(r["base_hash"], r["state_hash"]) for r in log] == [
        (c.hashes[0], c.hashes[1]),
        (c.hashes[1], c.hashes[2]),
    ]


async def test_a_torn_report_line_then_two_restarts(tmp_path: Path) -> None:
    """The torn tail is cut on the first restart, so the next report does not glue onto it and
    the restart after that still opens the run directory (issue 16 item 3)."""
    c = controller(tmp_path)
    await _one_round(c)
    await c.report("site-a", "", 0, c.hashes[1], 1.0, 1, 1.0)
    with open(tmp_path / REPORT_LOG, "a") as f:
        f.write('{"round": 0, "site": "site-b", "hash_')  # the crash hit mid-append
    first = controller(tmp_path)
    await join_all(first)
    await first.report("site-b", "", 0, c.hashes[1], 3.0, 1, 1.0)
    second = controller(tmp_path)
    assert second.history[0].hash_reports == {"site-a": True, "site-b": True}
    assert second.history[0].eval_loss_sum == 4.0
    assert (tmp_path / REPORT_LOG).read_text().count("\n") == 2


async def test_as_many_shards_as_sites_commits_until_the_run_ends(tmp_path: Path) -> None:
    """The issue's config at small scale (3 sites, `data.shards=3`, `data.max_bytes=100000`):
    rounds go on while the shards run dry twice over, never an exception inside a commit, and
    the ledger audit stays clean (issue 16 item 2)."""
    cfg = tiny_config(
        sites=["site-a", "site-b", "site-c"],
        rounds=30,
        data__shards=3,
        data__max_bytes=100_000,
        inner__steps_per_round=40,  # 160 windows a round: a shard of ~1979 runs dry every ~12
        limits__max_delta_norm_ratio=0.0,
    )
    c = RoundController(cfg, torch.zeros(N), data_shard_sizes(cfg), tmp_path)
    await join_all(c)
    while not c.finished:
        for site in cfg.sites:
            assert c.data_for(site), f"round {c.round}: no data for {site}"
            await c.contribute(site, "", c.round, 100, torch.full((N,), 1e-3))
    assert [h.round for h in c.history] == list(range(30))
    assert all(len(h.contributors) == 3 for h in c.history)
    assert min(s.epoch for s in c.ledger.shards) >= 2
    assert ledger_problems(round_log(tmp_path), cfg) == []


async def test_a_push_for_a_round_older_than_the_kept_digests_is_refused_not_acknowledged() -> None:
    """protocol.md §3.1: within the kept rounds a repeat is checked against its digest; past
    them an acknowledgement could not tell "ignored" from "accepted", so the push is refused."""
    from geodiloco.coordinator.rounds import KEEP_DIGESTS

    c = controller(rounds=KEEP_DIGESTS + 4)
    await join_all(c)
    for r in range(KEEP_DIGESTS + 2):
        for name in c.cfg.sites:
            await c.contribute(name, "", r, 100, torch.full((N,), 1e-3))
    assert c.round == KEEP_DIGESTS + 2
    assert c.check_push("site-a", "", c.round - KEEP_DIGESTS) is True  # still kept: a duplicate
    with pytest.raises(FailedPrecondition, match="no longer kept") as refused:
        c.check_push("site-a", "", 0)
    assert not isinstance(refused.value, LateContribution)  # not counted as a straggler
    assert c.round == KEEP_DIGESTS + 2  # nothing changed


async def test_a_push_for_a_closed_round_the_site_skipped_is_late_even_after_a_later_contribution() -> None:
    """protocol.md §3.1 rule 3: a repeat is a push to a round the site contributed to; a round
    that closed without it stays late, whatever the site did after."""
    c = controller(min_sites=1, rounds=5, outer__max_staleness=0)  # late merging off
    await join_all(c)
    await c.contribute("site-a", "", 0, 100, torch.ones(N))
    await asyncio.sleep(0.25)
    await c.tick()  # round 0 closes on quorum without site-b
    assert c.round == 1 and c.history[0].contributors == ["site-a"]
    for name in c.cfg.sites:
        await c.contribute(name, "", 1, 100, torch.ones(N))
    assert c.round == 2
    assert c.check_push("site-b", "", 1) is True  # its own round 1: a repeat
    with pytest.raises(LateContribution, match="round 0 is closed"):
        c.check_push("site-b", "", 0)
