"""Rounds by time (inner.round_seconds): on plain values (the clock, the trained prefix, the
ledger giving back what was not trained), then one site of two real gloo ranks whose rounds
end on the clock and whose ranks agree on every round's step count."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path

import pytest
import torch

from geodiloco.coordinator.ledger import DataLedger, check_exactly_once
from geodiloco.coordinator.refusals import FailedPrecondition
from geodiloco.coordinator.rounds import RoundController
from geodiloco.site.fragment_schedule import Schedule
from geodiloco.site.outer_sync import OuterSync, RoundClock
from geodiloco.testing import local_runs
from geodiloco.testing.configs import tiny_config
from geodiloco.testing.rank_pool import RankPool, run_sites
from geodiloco.testing.servers import CoordinatorThread
from geodiloco.workload.data import DataRange, split_windows

N = 64


def test_split_windows_takes_the_first_steps_windows_in_order() -> None:
    ranges = [DataRange(3, 10, 14), DataRange(5, 0, 8, 1)]
    assert split_windows(ranges, 6) == (
        [DataRange(3, 10, 14), DataRange(5, 0, 2, 1)],
        [DataRange(5, 2, 8, 1)],
    )
    assert split_windows(ranges, 12) == (ranges, [])


def clock_after(cap: Schedule, seconds: float, waited: float = 0.0) -> RoundClock:
    """A clock whose round's first step ended ``seconds`` ago (``waited`` of it the outer sync's)."""
    clock = RoundClock(1.0, cap)
    clock.tick()
    assert clock.started is not None
    clock.started -= seconds
    clock.waited = waited
    return clock


def test_the_clock_scales_a_streaming_round_and_its_overlap_with_the_measured_step_time() -> None:
    clock = clock_after(Schedule(40, 2, 8), 0.45)  # 10 steps, 9 after the first in 0.45 s
    schedule = clock.next_schedule(10)  # 20 steps fit in the window, τ 8 of 40 → 4 of 20
    assert schedule == Schedule(20, 2, 4) and (schedule.push_step(0), schedule.merge_step(1)) == (6, 20)
    assert clock.started is None  # the next window starts at the next round's first step
    clock.tick()
    assert clock.started is not None
    clock.started -= 100.0  # very slow steps: at least P x (τ' + 1) steps, the offsets with them
    assert clock.next_schedule(2) == Schedule(4, 2, 1)
    assert clock_after(Schedule(40, 2, 8), 0.0).scaled(1) == Schedule(40, 2, 8)  # nothing measured


def test_the_clock_leaves_out_the_time_the_outer_sync_held_the_training() -> None:
    """A fast site that waited for a slow one at the end of its round: its next round follows
    its own step time, not the slow site's (which its wall time would give, and keep it waiting);
    a first round takes its H at its second step, every fragment's push after it."""
    clock = clock_after(Schedule(64, 2, 2), 0.95, waited=0.5)  # 10 steps; 0.5 s of it waiting
    assert clock.next_schedule(10).steps == 20 and clock.waited == 0.0
    first = clock_after(Schedule(64, 2, 2), 100.0)
    assert first.scaled(2, later=1) == Schedule(6, 2, 1)  # P x (τ' + 2): fragment 0 pushed at step 2


def test_one_fragment_pushes_when_its_window_s_overlapped_share_begins() -> None:
    """τ/H of the window overlaps the exchange, in time, whatever the site's speed: a site pushes
    at (1 − τ/H) of its window and trains the rest of it while the push, commit and pull run."""
    cap = Schedule(64, 1, 16)  # a quarter of the window overlapped
    assert not clock_after(cap, 0.6).push_due(7)  # 7 steps of 0.1 s: 0.7 of the window
    fast = clock_after(cap, 0.7)  # 8 steps of 0.1 s: 0.8, past 0.75
    assert fast.push_due(8) and fast.steps_left(8) == 2  # 0.2 s to the window's end at 0.1 s a step
    slow = clock_after(cap, 0.6)  # 4 steps of 0.2 s: the same share of the window, fewer steps
    assert slow.push_due(4) and slow.steps_left(4) == 1
    assert not clock_after(cap, 0.6, waited=0.3).push_due(4)  # 0.3 s of it was the outer sync's
    blocking = clock_after(Schedule(40, 1, 0), 0.9)  # 10 steps of 0.1 s: the window has closed
    assert blocking.push_due(10) and blocking.steps_left(10) == 0
    assert not clock_after(Schedule(40, 1, 0), 0.7).push_due(8)
    assert blocking.next_schedule(10) == Schedule(40, 1, 0)  # decided step by step


def test_a_window_starts_when_the_last_round_s_update_came_in() -> None:
    """Every site sees a commit at about the same time: a window counted from there makes every
    site push at about the same time, and a site that was still training the steps its last
    push named (it fell behind) pushes earlier in its next round, catching up at once."""
    cap = Schedule(64, 1, 16)
    on_time = clock_after(cap, 0.1)  # 3 steps of 0.05 s since its round started...
    on_time.anchor = time.monotonic() - 0.5  # ...but the update came in 0.5 s ago
    assert not on_time.push_due(3)
    on_time.anchor -= 0.3  # 0.8 s ago: past (1 - 1/4) of the window
    assert on_time.push_due(3) and on_time.steps_left(3) == 4  # 0.2 s left, 0.05 s a step
    behind = clock_after(cap, 0.0)
    behind.step_s, behind.anchor = 0.05, time.monotonic() - 0.95  # 0.95 s of it gone in old steps
    assert behind.push_due(1) and behind.steps_left(1) == 1  # pushes after one step
    behind.arrived = 123.0
    behind.restart()
    assert (behind.anchor, behind.arrived, behind.started) == (123.0, None, None)


def test_the_ledger_consumes_the_trained_part_and_gives_back_the_rest() -> None:
    ledger = DataLedger.create([100] * 4, ["a", "b"])
    a, b = ledger.reserve("a", 20), ledger.reserve("b", 20)
    ledger.settle(0, {"a", "b"}, trained={"a": split_windows(a, 8)[0]})
    assert [c.range for c in ledger.consumed if c.site == "a"] == split_windows(a, 8)[0]
    assert (
        ledger.returned == split_windows(a, 8)[1] and [c.range for c in ledger.consumed if c.site == "b"] == b
    )
    assert check_exactly_once(ledger.consumed, [100] * 4, ledger.pending()) == []
    again = ledger.reserve("b", 20)  # the returned windows are handed out first
    assert again[0] == split_windows(a, 8)[1][0]


async def test_the_coordinator_takes_whole_steps_of_the_reservation_and_weighs_the_tokens() -> None:
    cfg = tiny_config(min_sites=1, limits__max_delta_norm_ratio=0.0, inner__round_seconds=0.5)
    c = RoundController(cfg, torch.zeros(N), [1000] * cfg.data.shards)
    for name in cfg.sites:
        await c.join(name, "")
    per_step = cfg.data.batch_size  # one rank
    a, b = c.data_for("site-a"), c.data_for("site-b")
    with pytest.raises(FailedPrecondition, match="trained on"):  # not whole steps
        await c.contribute("site-a", "", 0, 10, torch.ones(N), data=split_windows(a, per_step + 1)[0])
    await c.contribute("site-a", "", 0, 10, torch.ones(N), data=split_windows(a, per_step)[0])
    await c.contribute("site-b", "", 0, 30, torch.full((N,), 3.0), data=b)
    record = c.history[0]
    assert record.tokens == 40 and sorted(record.contributors) == ["site-a", "site-b"]
    assert sum(d[3] - d[2] for d in record.data if d[0] == "site-a") == per_step
    assert record.pending is not None and record.pending["returned"]  # a's untrained windows
    assert check_exactly_once(c.ledger.consumed, [1000] * cfg.data.shards, c.ledger.pending()) == []


async def test_a_restart_that_replays_a_round_by_time_hands_its_untrained_windows_out_once(
    tmp_path: Path,
) -> None:
    """The chaos plan's coordinator restart in benchmarks/hetero.py (mode c): the windows a round
    by time gave back are behind the cursor; a restart replaying that round from the log (the
    snapshot predates it) hands them out once, not again from a cursor left before them."""
    cfg = tiny_config(
        min_sites=1, limits__max_delta_norm_ratio=0.0, inner__round_seconds=0.5, snapshot_every=100
    )
    shards = [1000] * cfg.data.shards
    c = RoundController(cfg, torch.zeros(N), shards, tmp_path)
    for name in cfg.sites:
        await c.join(name, "")
    a, b = c.data_for("site-a"), c.data_for("site-b")
    trained, rest = split_windows(a, cfg.data.batch_size)  # one step of one rank
    await c.contribute("site-a", "", 0, 10, torch.ones(N), data=trained)
    await c.contribute("site-b", "", 0, 30, torch.ones(N), data=b)
    assert c.round == 1 and c.snapshot_round is None
    assert c.history[0].pending == {"held": [], "returned": [astuple(r) for r in rest]}
    resumed = RoundController(cfg, torch.zeros(N), shards, tmp_path)  # round 0 replayed
    assert [(s.consumed, s.epoch) for s in resumed.ledger.shards] == [
        (s.consumed, s.epoch) for s in c.ledger.shards
    ]
    for name in cfg.sites:
        await resumed.join(name, "")
    for name in cfg.sites:
        await resumed.contribute(name, "", 1, 10, torch.ones(N), data=resumed.data_for(name))
    assert resumed.round == 2
    assert check_exactly_once(resumed.ledger.consumed, shards, resumed.ledger.pending()) == []


@pytest.mark.integration
@pytest.mark.parametrize("overlap", [0, 1])
def test_a_two_rank_site_ends_its_rounds_on_the_clock_with_its_ranks_agreed(
    rank_pool: RankPool, tmp_path: Path, overlap: int
) -> None:
    """A site of two real gloo ranks trains until the round's window closes (far fewer steps
    than the cap of steps_per_round): a rank that stopped a step earlier or later than the other
    would push other windows and tokens than its peer, which the coordinator refuses (or the
    ranks' collectives would hang); every round takes the site's push, in whole steps of both
    ranks. Blocking, the ranks agree at every step; overlapped, on rank 0's H (the first round's
    at its second step)."""
    cfg = tiny_config(
        rounds=2,
        sites=["site-a"],
        min_sites=1,
        inner__steps_per_round=400,
        inner__round_seconds=0.3,
        outer__overlap_steps=overlap,
        data__batch_size=2,
        limits__max_delta_norm_ratio=0.0,  # hundreds of steps of a tiny model move it far
    )
    with CoordinatorThread(cfg) as coordinator:
        run_sites(rank_pool, coordinator.target, {"site-a": (2, [])}, tmp_path)
        c = coordinator.controller
        assert c.finished and [h.round for h in c.history] == [0, 1]
        for h in c.history:
            assert h.contributors == ["site-a"] and h.hashes_agree
            windows = sum(d[3] - d[2] for d in h.data)
            steps, rest = divmod(windows, 2 * cfg.data.batch_size)
            assert rest == 0 and 1 <= steps < cfg.inner.steps_per_round  # on the clock, whole steps
            # both ranks' tokens, summed once; overlapped, those since the last push (τ steps of
            # each round are pushed with the next, so the first round's push has τ steps fewer)
            shift = overlap * 2 * cfg.data.batch_size if h.round == 0 else 0
            assert h.tokens == (windows - shift) * cfg.model.seq_len
        assert c.sites["site-a"].rejected == 0 and c.sites["site-a"].late == 0
        consumed = list(c.ledger.consumed)
        assert check_exactly_once(consumed, [s.size for s in c.ledger.shards], c.ledger.pending()) == []


@pytest.mark.parametrize(("fragments", "overlap"), [(1, 2), (2, 1)])
def test_overlapped_rounds_by_time_fit_each_site_s_speed_with_every_replica_identical(
    fragments: int, overlap: int
) -> None:
    """Rounds by time with the exchange overlapping τ steps (what benchmarks/hetero.py's mode
    b runs): each site's H follows its own step time, a site 3x slower trains fewer steps a
    round while the fast ones train on (the step time leaves out their waits), the first round
    too; every replica holds the coordinator's θ and every window is trained once."""
    cfg = tiny_config(
        rounds=4,
        min_sites=3,
        sites=["site-a", "site-b", "site-c"],
        inner__steps_per_round=60,
        inner__round_seconds=0.12,
        outer__fragments=fragments,
        outer__overlap_steps=overlap,
        limits__max_delta_norm_ratio=0.0,
    )
    steps: dict[str, list[int]] = {name: [] for name in cfg.sites}

    def hook(name: str) -> Callable[[OuterSync, int], None]:
        def at(sync: OuterSync, step: int) -> None:
            if sync.steps_in_round == 0 and step:
                steps[name].append(step)  # the steps trained before each round after the first
            time.sleep(0.012 if name == "site-c" else 0.004)

        return at

    with local_runs.coordinator_for(cfg) as coordinator:
        out = local_runs.run_sites(coordinator, {name: hook(name) for name in cfg.sites})
        theta = coordinator.controller.theta()
        for site in out.values():
            assert torch.equal(local_runs.global_snapshot(site["sync"]), theta)
        for c in coordinator.controller.fragments:
            assert [h.round for h in c.history] == list(range(cfg.rounds))
            assert all(h.hashes_agree for h in c.history)
        ledger = coordinator.controller.primary.ledger
        assert check_exactly_once(ledger.consumed, [10_000] * cfg.data.shards, ledger.pending()) == []
    fast, slow = steps["site-a"][0], steps["site-c"][0]  # the first round: on the clock, not the cap
    assert slow < fast < cfg.inner.steps_per_round
    assert steps["site-a"][-1] > 1.5 * steps["site-c"][-1]  # the fast sites' rounds did not shrink


def test_the_lr_schedule_counts_the_steps_a_site_really_trained() -> None:
    """In rounds by time a slow site trains fewer steps per round than a fast one, and both far
    fewer than the cap: the inner lr's warm-up and decay count the steps each really trained, not
    round × steps_per_round."""
    cfg = tiny_config(rounds=3, min_sites=2, inner__steps_per_round=200, inner__round_seconds=0.1)
    seen: dict[str, list[int]] = {"site-a": [], "site-b": []}

    def hook(name: str) -> Callable[[OuterSync, int], None]:
        def at(sync: OuterSync, step: int) -> None:
            seen[name].append(sync.lr_step)
            time.sleep(0.01 if name == "site-b" else 0.002)  # at most 50 steps a round: below the cap

        return at

    with local_runs.coordinator_for(cfg) as coordinator:
        local_runs.run_sites(coordinator, {name: hook(name) for name in cfg.sites})
    for steps in seen.values():  # before each step, the steps trained before it
        assert steps == list(range(len(steps))) and len(steps) < cfg.rounds * cfg.inner.steps_per_round
    assert len(seen["site-b"]) < len(seen["site-a"])
