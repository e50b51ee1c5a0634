"""Late pushes merged into the next open round with a staleness weight (outer.max_staleness):
on plain tensors in the round controller, then a site's whole outer loop over the in-process link."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest
import torch

from geodiloco.coordinator.edge.service import status_message
from geodiloco.coordinator.ledger import ConsumedRecord, check_exactly_once
from geodiloco.coordinator.refusals import LateContribution
from geodiloco.coordinator.rounds import RoundController
from geodiloco.site.outer_sync import OuterSync
from geodiloco.testing.configs import streaming_config, tiny_config
from geodiloco.testing.local_runs import coordinator_for, global_snapshot, run_sites
from geodiloco.workload.data import DataRange

N = 64
SHARDS = [1000] * 24


def controller(max_staleness: int, run_dir: Path | None = None) -> RoundController:
    cfg = tiny_config(
        min_sites=1,
        limits__max_delta_norm_ratio=0.0,
        data__tokens_per_item=100,  # the ledger's 12 windows weigh 1200 tokens: the claims are the weights
        outer__max_staleness=max_staleness,
        rounds=6,
        snapshot_every=100,  # with a run directory: a restart replays every round
    )
    return RoundController(cfg, torch.zeros(N), SHARDS, run_dir)


async def close_without_the_others(c: RoundController, name: str, delta: torch.Tensor, tokens: int) -> None:
    """``name`` contributes and the round's window passes (no sleeping) without the others."""
    await c.contribute(name, "", c.round, tokens, delta)
    c.firsts[c.round] -= c.grace.window_s
    await c.tick()


def consumed(c: RoundController) -> list[ConsumedRecord]:
    return [
        ConsumedRecord(h.round, site, DataRange(shard, start, end, epoch))
        for h in c.history
        for site, shard, start, end, epoch in h.data
    ]


async def test_a_late_push_is_merged_with_its_staleness_weight_bit_identically() -> None:
    gen = torch.Generator().manual_seed(0)
    a0, a1, b0 = (torch.randn(N, generator=gen) * 0.01 for _ in range(3))
    c = controller(max_staleness=2)
    for name in c.cfg.sites:
        await c.join(name, "")
    b_windows = c.data_for("site-b")
    await close_without_the_others(c, "site-a", a0, 100)
    assert c.round == 1 and c.history[0].contributors == ["site-a"]
    assert c.ledger.held_for("site-b", 0) == b_windows  # held, not handed out again
    assert not set(c.data_for("site-b")) & set(b_windows)
    await c.contribute("site-b", "", 0, 300, b0)  # one round late: weight 300 // 2
    assert await c.contribute("site-b", "", 0, 300, b0) is False  # a retry is a duplicate
    await close_without_the_others(c, "site-a", a1, 100)
    record = c.history[1]
    assert record.contributors == ["site-a"] and record.late == [["site-b", 0, 300, 150]]
    assert record.tokens == 400  # every token trained went into the update
    assert [d for d in record.data if d[0] == "site-b"] == [
        ["site-b", d.shard, d.start, d.end, d.epoch] for d in b_windows
    ]
    assert check_exactly_once(consumed(c), SHARDS) == []

    # the same round 1 with site-b's Δ folded on time at weight 150: the same θ, bit for bit
    ref = controller(max_staleness=0)
    for name in ref.cfg.sites:
        await ref.join(name, "")
    await close_without_the_others(ref, "site-a", a0, 100)
    await ref.contribute("site-b", "", 1, 150, b0)
    await ref.contribute("site-a", "", 1, 100, a1)
    assert ref.round == 2 and torch.equal(ref.theta, c.theta) and ref.hashes[2] == c.hashes[2]
    site = next(s for s in status_message(c).sites if s.site == "site-b")
    assert (site.late_merged, site.late) == (1, 0)


async def test_a_push_beyond_the_staleness_bound_is_refused_and_its_windows_go_back() -> None:
    c = controller(max_staleness=1)
    for name in c.cfg.sites:
        await c.join(name, "")
    b_windows = c.data_for("site-b")
    for _ in range(2):
        await close_without_the_others(c, "site-a", torch.full((N,), 0.01), 100)
    assert c.round == 2 and c.ledger.held_for("site-b", 0) is None  # expired: two rounds behind
    with pytest.raises(LateContribution) as err:
        await c.contribute("site-b", "", 0, 300, torch.full((N,), 0.01))
    assert "round 0 is closed; the current round is 2" in str(err.value)
    assert "more than outer.max_staleness (1) rounds behind" in str(err.value)
    c.record_rejection("site-b", err.value)
    assert c.sites["site-b"].late == 1 and c.sites["site-b"].late_merged == 0
    # the windows site-b never delivered are handed out again, first
    assert set(b_windows) <= set(c.data_for("site-a") + c.data_for("site-b"))
    await c.contribute("site-b", "", 2, 100, torch.full((N,), 0.01))
    await c.contribute("site-a", "", 2, 100, torch.full((N,), 0.01))
    assert c.round == 3 and set(b_windows) <= {DataRange(*d[1:]) for d in c.history[2].data}
    assert check_exactly_once(consumed(c), SHARDS) != []  # site-b's round-1 windows: not trained yet
    assert check_exactly_once(consumed(c), SHARDS, c.ledger.pending()) == []  # but returned


async def test_held_windows_survive_a_restart_that_replays_the_rounds(tmp_path: Path) -> None:
    """The rounds after the snapshot are replayed from the log: the windows held for site-b at
    the crash are held again, so its late push still merges, and none shows as skipped."""
    c = controller(max_staleness=2, run_dir=tmp_path)
    for name in c.cfg.sites:
        await c.join(name, "")
    b_windows = c.data_for("site-b")
    await close_without_the_others(c, "site-a", torch.full((N,), 0.01), 100)
    await close_without_the_others(c, "site-a", torch.full((N,), 0.01), 100)
    assert c.round == 2 and c.snapshot_round is None and c.ledger.held_for("site-b", 0) == b_windows
    held_at_crash = dict(c.ledger.held)

    resumed = RoundController(c.cfg, torch.zeros(N), SHARDS, tmp_path)  # a restart: 0 and 1 replayed
    assert resumed.round == 2 and resumed.ledger.held == held_at_crash
    assert check_exactly_once(consumed(resumed), SHARDS, resumed.ledger.pending()) == []
    for name in resumed.cfg.sites:
        await resumed.join(name, "")
    assert not set(resumed.data_for("site-a")) & set(b_windows)  # nobody else gets them
    await resumed.contribute("site-b", "", 0, 300, torch.full((N,), 0.01), data=b_windows)
    await close_without_the_others(resumed, "site-a", torch.full((N,), 0.01), 100)
    assert resumed.history[2].late == [["site-b", 0, 300, 100]]
    assert resumed.sites["site-b"].late_merged == 1
    assert check_exactly_once(consumed(resumed), SHARDS, resumed.ledger.pending()) == []
    again = RoundController(c.cfg, torch.zeros(N), SHARDS, tmp_path)
    assert again.sites["site-b"].late_merged == 1
    await again.join("site-b", "")
    assert await again.contribute("site-b", "", 0, 300, torch.full((N,), 0.01)) is False  # a retry


@pytest.mark.parametrize(("fragments", "overlap"), [(1, 0), (2, 1)])
def test_a_late_site_is_merged_and_goes_on_without_a_resync(
    fragments: int, overlap: int, caplog: pytest.LogCaptureFixture
) -> None:
    """site-b stalls before its push of round 1 until round 1 has closed without it: its push
    is merged into round 2, it applies the update it missed and trains on, with no rejoin, no
    catch-up and no full state, and every window is trained once."""
    caplog.set_level("INFO")
    cfg = streaming_config(fragments, overlap, rounds=4, min_sites=1, round_timeout_s=0.2)
    cfg = dataclasses.replace(cfg, outer=dataclasses.replace(cfg.outer, max_staleness=2))
    with coordinator_for(cfg) as coordinator:
        c0 = coordinator.fragment(0)
        push_at = cfg.inner.steps_per_round + (cfg.inner.steps_per_round // fragments - overlap) - 1

        def stall(sync: OuterSync, step: int) -> None:
            if step == push_at:
                end = time.monotonic() + 30
                while c0.round < 2:
                    assert time.monotonic() < end, "round 1 did not close without site-b"
                    time.sleep(0.01)

        out = run_sites(coordinator, {"site-b": stall})
        assert c0.sites["site-b"].late_merged == 1 and c0.sites["site-b"].late == 0
        assert c0.history[1].contributors == ["site-a"] and c0.history[2].late[0][:2] == ["site-b", 1]
        for text in ("rejoining", "resyncing", "caught up", "full state"):
            assert text not in caplog.text
        theta = coordinator.controller.theta()
        for site in out.values():
            assert torch.equal(global_snapshot(site["sync"]), theta)
        primary = coordinator.controller.primary
        assert check_exactly_once(consumed(primary), [10_000] * cfg.data.shards) == []
        assert all(h.hashes_agree for c in coordinator.controller.fragments for h in c.history)


def test_a_site_two_rounds_late_is_merged_then_refused_once_and_resyncs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """site-b's push of round 1 comes after rounds 1 and 2 closed without it: merged into round 3
    (staleness 2). Its next push, of round 2, was trained on the data of round 3 while the
    windows of round 2 went back: refused once, and site-b resyncs; every window once, every
    replica the same."""
    caplog.set_level("INFO")
    cfg = streaming_config(1, 0, rounds=6, min_sites=1, round_timeout_s=0.2)
    assert cfg.outer.max_staleness == 2  # the default
    with coordinator_for(cfg) as coordinator:
        c0 = coordinator.fragment(0)
        push_at = 2 * cfg.inner.steps_per_round - 1

        def stall(sync: OuterSync, step: int) -> None:
            if step == push_at:
                end = time.monotonic() + 30
                while c0.round < 3:
                    assert time.monotonic() < end, "rounds 1 and 2 did not close without site-b"
                    time.sleep(0.01)

        out = run_sites(coordinator, {"site-b": stall})
        b = c0.sites["site-b"]
        assert c0.history[3].late[0][:2] == ["site-b", 1] and b.late_merged == 1
        assert b.late == 1 and "no windows are held for it" in caplog.text
        assert "round 2: caught up to round 3 with 1 kept updates" in caplog.text  # no full state
        theta = coordinator.controller.theta()
        for site in out.values():
            assert torch.equal(global_snapshot(site["sync"]), theta)
        assert check_exactly_once(consumed(c0), [10_000] * cfg.data.shards, c0.ledger.pending()) == []
        assert all(h.hashes_agree for h in c0.history)
