"""The adaptive grace window: on plain values, then in the round controller and its status."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from geodiloco.app.status import format_status
from geodiloco.config import ConfigError, GraceConfig, RunConfig
from geodiloco.coordinator.edge.service import status_message
from geodiloco.coordinator.grace import Arrival, GraceWindow, quantile
from geodiloco.coordinator.refusals import LateContribution
from geodiloco.coordinator.rounds import RoundController
from geodiloco.testing.configs import tiny_config

N = 100
ADAPTIVE = GraceConfig(adaptive=True, quantile=0.5, margin=1.0, floor_s=0.25, rounds=2)


def arrivals(*lags: float) -> list[Arrival]:
    return [Arrival(f"site-{i}", lag) for i, lag in enumerate(lags)]


def test_quantile_interpolates_between_order_statistics() -> None:
    assert quantile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert quantile([0.0, 10.0], 0.9) == pytest.approx(9.0)
    assert quantile([4.0], 0.9) == 4.0


def test_a_fixed_window_is_round_timeout_s() -> None:
    grace = GraceWindow(GraceConfig(adaptive=False), timeout_s=30.0)
    grace.closed(arrivals(0.0, 0.1), quorum=1)
    assert grace.window_s == 30.0


def test_the_window_adapts_up_to_late_arrivals_and_down_when_they_stop() -> None:
    grace = GraceWindow(ADAPTIVE, timeout_s=10.0)
    assert grace.window_s == 10.0  # nothing measured yet: the bound
    grace.closed(arrivals(0.0, 0.5, 1.0), quorum=2)
    assert grace.window_s == pytest.approx(0.75 * 2 + 0.25)  # median lag x (1 + margin) + floor
    assert grace.waited_for == [Arrival("site-2", 1.0)]  # came after the round had its quorum
    grace.late("site-3", 3.0)  # a push that found its round closed: the window was too short for it
    grace.late("site-3", 3.0)
    grace.closed(arrivals(0.0, 0.5), quorum=2)
    up = grace.window_s
    assert up == pytest.approx(1.0 * 2 + 0.25) and grace.waited_for == []  # median of 0.5 0.5 1 3 3
    grace.late("site-3", 30.0)
    grace.closed(arrivals(0.0, 40.0, 40.0), quorum=1)
    assert grace.window_s == 10.0  # never past round_timeout_s
    for _ in range(ADAPTIVE.rounds):  # the slow site is back in step: the old lags age out
        grace.closed(arrivals(0.0, 0.1), quorum=1)
    assert grace.window_s == pytest.approx(0.1 * 2 + 0.25) and grace.window_s < up


def test_the_bound_is_on_by_default_in_rounds_by_time_only() -> None:
    """Step rounds: a slower site is a whole training time late by design, and waiting for it
    keeps its contribution in its round; rounds by time: a late site is a hiccup or a slow link."""
    by_steps = GraceWindow(GraceConfig(), timeout_s=60.0)
    by_time = GraceWindow(GraceConfig(), timeout_s=60.0, by_time=True)
    for grace in (by_steps, by_time):
        for _ in range(2):
            grace.closed(arrivals(0.0, 0.1, 5.0), quorum=2, trained_s=4.0)
    assert not by_steps.bounded and by_steps.stragglers == set()
    assert by_time.bound_s == 2.0 and by_time.stragglers == {"site-2"}
    assert GraceConfig(max_share=0.5).share(False) == 0.5 and GraceConfig(max_share=0.0).share(True) == 0.0


def test_a_site_beyond_the_bound_is_not_waited_for_until_it_comes_within_it_again() -> None:
    """The bound: max_share of the sites' training time per round (median of recent rounds),
    at least floor_s. A chronically late site (a slow link) neither widens the window nor holds
    the round open; a push of it within the bound makes it waited for again."""
    grace = GraceWindow(dataclasses.replace(ADAPTIVE, max_share=0.5), timeout_s=10.0)
    grace.closed(arrivals(0.0, 0.2, 3.0), quorum=2, trained_s=None)  # the first round: start-up
    assert not grace.bounded and grace.stragglers == set()  # not measured: every site waited for
    grace.late("site-2", 2.0)  # a late push of the round: its worst lag counts once
    grace.closed(arrivals(0.0, 0.2, 3.0), quorum=2, trained_s=2.0)
    assert grace.bound_s == pytest.approx(1.0) and grace.rounds[-1] == [0.2]  # 3 s did not widen it
    assert grace.stragglers == set()  # one round is a hiccup
    grace.closed(arrivals(0.0, 0.2, 3.0), quorum=2, trained_s=2.0)
    assert grace.stragglers == {"site-2"}  # two in a row: not waited for
    assert grace.rounds[-1] == [0.2] and grace.window_s == pytest.approx(0.2 * 2 + 0.25)
    grace.late("site-2", 2.5)  # merged late, still beyond: still not waited for
    grace.closed(arrivals(0.0, 0.1), quorum=2, trained_s=2.0)
    assert grace.stragglers == {"site-2"} and grace.rounds[-1] == [0.1]
    grace.late("site-2", 0.4)  # its link recovered: within the bound, waited for at once
    assert grace.stragglers == set()
    grace.closed(arrivals(0.0, 0.1), quorum=2, trained_s=2.0)
    assert grace.rounds[-1] == [0.1, 0.4]
    grace.closed(arrivals(0.0, 0.1), quorum=1, trained_s=2.0, missing={"site-3"}, open_s=0.5)
    assert "site-3" not in grace.beyond  # gone 0.5 s, within the bound: it may yet come
    grace.closed(arrivals(0.0, 0.1), quorum=1, trained_s=2.0, missing={"site-3"}, open_s=1.5)
    grace.late("site-3", 4.0)  # the push it missed that round with: counted once
    assert grace.beyond["site-3"] == 1 and grace.stragglers == set()
    grace.closed(arrivals(0.0, 0.1), quorum=1, trained_s=2.0, missing={"site-3"}, open_s=1.5)
    assert grace.stragglers == {"site-3"}  # a site whose pushes never come (a slow link, a stall)
    grace.closed(arrivals(0.0, 0.1), quorum=1, trained_s=0.01)  # short rounds: floor_s at least
    grace.closed(arrivals(0.0, 0.1), quorum=1, trained_s=0.01)
    assert grace.bound_s == ADAPTIVE.floor_s and grace.window_s <= ADAPTIVE.floor_s


async def test_the_controller_closes_without_a_straggler_and_merges_its_push_late() -> None:
    """In the round controller: a site whose push came beyond the bound is not waited for (the
    round commits as soon as the others are in, status no longer lists it); its next push is
    merged late, and coming within the bound it is waited for again."""
    cfg = tiny_config(
        sites=["site-a", "site-b", "site-c"],
        round_timeout_s=60.0,
        min_sites=2,
        limits__max_delta_norm_ratio=0.0,
        grace__floor_s=0.5,
        grace__max_share=0.5,
        rounds=8,
    )
    c = RoundController(cfg, torch.zeros(N), [1000] * cfg.data.shards)
    for name in cfg.sites:
        await c.join(name, "")
    for r in range(2):  # measured: every site in time, rounds trained for 4 s
        c.round_opened -= 4.0
        for name in cfg.sites:
            await c.contribute(name, "", r, 10, torch.ones(N))
    assert c.round == 2 and c.grace.bound_s == pytest.approx(2.0, abs=0.1)
    await c.contribute("site-a", "", 2, 10, torch.ones(N))
    await c.contribute("site-b", "", 2, 10, torch.ones(N))
    c.firsts[2] -= c.grace.window_s  # site-c's slow link: the window passes without it
    await c.tick()
    assert c.round == 3 and c.history[2].contributors == ["site-a", "site-b"]
    c.firsts[2] -= 5.0  # its push comes 5 s after the round's first: merged late, beyond the bound
    await c.contribute("site-c", "", 2, 10, torch.ones(N))
    assert c.grace.stragglers == set() and c.waiting_for == ["site-a", "site-b", "site-c"]
    c.round_opened -= 4.0
    await c.contribute("site-a", "", 3, 10, torch.ones(N))
    await c.contribute("site-b", "", 3, 10, torch.ones(N))
    c.firsts[3] -= c.grace.window_s  # and again the window passes without it
    await c.tick()
    assert c.round == 4 and c.history[3].late[0][:2] == ["site-c", 2]
    c.firsts[3] -= 5.0  # beyond the bound in a second round in a row: a straggler
    await c.contribute("site-c", "", 3, 10, torch.ones(N))
    c.round_opened -= 4.0
    await c.contribute("site-a", "", 4, 10, torch.ones(N))
    await c.contribute("site-b", "", 4, 10, torch.ones(N))
    assert c.round == 5 and c.history[4].contributors == ["site-a", "site-b"]  # closed at once
    assert c.grace.stragglers == {"site-c"} and c.waiting_for == ["site-a", "site-b"]
    await c.contribute("site-c", "", 4, 10, torch.ones(N))  # within the bound: waited for again
    assert c.grace.stragglers == set()
    c.round_opened -= 4.0
    await c.contribute("site-a", "", 5, 10, torch.ones(N))
    await c.contribute("site-b", "", 5, 10, torch.ones(N))
    assert c.round == 5 and c.waiting_for == ["site-c"]  # held open for it again
    await c.contribute("site-c", "", 5, 10, torch.ones(N))
    assert c.round == 6 and c.history[5].contributors == ["site-a", "site-b", "site-c"]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("quantile", 0.0, "grace.quantile: must be in (0, 1]"),
        ("margin", -1.0, "grace.margin: must be >= 0"),
        ("floor_s", -0.5, "grace.floor_s: must be >= 0"),
        ("rounds", 0, "grace.rounds: must be >= 1"),
        ("max_share", -0.5, "grace.max_share: must be >= 0 or null"),
        ("adaptive", "yes", "grace.adaptive: expected true or false"),
    ],
)
def test_bad_grace_settings_name_the_field(key: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict({"grace": {key: value}})
    assert message in str(err.value)


async def test_the_controller_closes_on_the_measured_window_and_status_shows_it() -> None:
    cfg = tiny_config(
        round_timeout_s=60.0,
        min_sites=1,
        limits__max_delta_norm_ratio=0.0,
        grace__adaptive=True,
        grace__floor_s=0.5,
        grace__margin=0.0,
        grace__max_share=0.0,  # the quantile alone (the bound: the tests below)
        outer__max_staleness=0,  # a late push is dropped, and measured
    )
    c = RoundController(cfg, torch.zeros(N), [1000] * cfg.data.shards)
    for name in cfg.sites:
        await c.join(name, "")
    await c.contribute("site-a", "", 0, 10, torch.ones(N))
    first = c.first_contribution
    assert first is not None and not c.overdue(first + 59.0)  # round 0: round_timeout_s
    assert c.waiting_for == ["site-b"]
    await c.contribute("site-b", "", 0, 10, torch.ones(N))
    assert c.round == 1 and [a.site for a in c.grace.waited_for] == ["site-b"]  # after the quorum of 1
    (lag,) = c.grace.rounds[-1]
    assert 0 <= lag < 60
    window = c.grace.window_s
    assert window == pytest.approx(lag + 0.5)  # measured: site-b's lag plus the floor
    await c.contribute("site-a", "", 1, 10, torch.ones(N))
    first = c.first_contribution
    assert first is not None and not c.overdue(first + window - 0.01) and c.overdue(first + window)
    c.firsts[1] = first - window  # the window passed without site-b (no sleeping)
    await c.tick()
    assert c.round == 2 and c.history[1].contributors == ["site-a"]
    with pytest.raises(LateContribution) as err:
        await c.contribute("site-b", "", 1, 10, torch.ones(N))
    assert err.value.after_s is not None and err.value.after_s >= window
    c.record_rejection("site-b", err.value)
    status = status_message(c)
    assert status.grace_window_s == pytest.approx(window) and list(status.waiting_for) == ["site-a", "site-b"]
    await c.contribute("site-a", "", 2, 10, torch.ones(N))
    c.firsts[2] -= window
    await c.tick()  # round 2 closes on site-a alone; the late lag of round 1 widens the window
    assert c.grace.window_s > window
    text = format_status(status_message(c))
    assert f"grace window: {c.grace.window_s:.1f}s after a round's first contribution" in text


@pytest.mark.parametrize("snapshot_every", [1, 100])  # restored from the snapshot, or replayed
async def test_a_restarted_coordinator_keeps_the_measured_window(tmp_path: Path, snapshot_every: int) -> None:
    """Each round's record keeps the lags it measured: a restarted coordinator waits the window
    it had, not round_timeout_s until it has measured a round again (the chaos plan's restarts
    in benchmarks/hetero.py left its fast sites waiting for a site that was gone)."""
    cfg = tiny_config(
        round_timeout_s=60.0,
        min_sites=1,
        limits__max_delta_norm_ratio=0.0,
        grace__floor_s=0.5,
        snapshot_every=snapshot_every,
    )
    c = RoundController(cfg, torch.zeros(N), [1000] * cfg.data.shards, tmp_path)
    for name in cfg.sites:
        await c.join(name, "")
    for r in range(2):
        for name in cfg.sites:
            await c.contribute(name, "", r, 10, torch.ones(N))
    assert c.round == 2 and c.grace.window_s < 60.0 and c.history[1].lags == [round(c.grace.rounds[-1][0], 4)]
    resumed = RoundController(cfg, torch.zeros(N), [1000] * cfg.data.shards, tmp_path)
    assert resumed.round == 2 and (resumed.snapshot_round == 2) == (snapshot_every == 1)
    assert resumed.grace.window_s == pytest.approx(c.grace.window_s, abs=1e-3)
