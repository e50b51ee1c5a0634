"""The site's whole outer loop against in-process round controllers (no gRPC server): sites
train a small model of plain tensors in threads, and every fragment round, hash, late push,
catch-up and resync is checked against the controllers' own state."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from geodiloco.exchange import PushPart
from geodiloco.params import flatten_parameters, state_hash
from geodiloco.site.fragment_schedule import FragmentPlan
from geodiloco.site.outer_sync import CATCH_UP_ROUNDS, OuterSync
from geodiloco.testing.configs import streaming_config
from geodiloco.testing.local_runs import TOKENS, Blocks, coordinator_for, global_snapshot, run_sites


def test_blocking_rounds_keep_every_replica_bit_identical() -> None:
    cfg = streaming_config()
    with coordinator_for(cfg) as coordinator:
        out = run_sites(coordinator)
        c = coordinator.fragment(0)
        assert c.round == cfg.rounds and len(c.history) == cfg.rounds
        assert all(h.contributors == ["site-a", "site-b"] and h.tokens == 2 * 4 * TOKENS for h in c.history)
        assert all(h.hashes_agree and len(h.hash_reports) == 2 for h in c.history)
        for site in out.values():
            assert site["reloaded"] == 0
            # blocking: the parameters are the global ones after every round
            assert state_hash(flatten_parameters(site["model"])) == c.hashes[cfg.rounds]
            assert site["sync"].last_result.state_hash == c.hashes[cfg.rounds]


@pytest.mark.parametrize(("fragments", "overlap"), [(2, 0), (2, 1), (1, 2), (4, 0)])
def test_streaming_fragments_commit_and_agree(fragments: int, overlap: int) -> None:
    cfg = streaming_config(fragments, overlap)
    with coordinator_for(cfg) as coordinator:
        out = run_sites(coordinator)
        assert coordinator.controller.finished
        for c in coordinator.controller.fragments:
            assert len(c.history) == cfg.rounds
            assert all(h.contributors == ["site-a", "site-b"] and h.hashes_agree for h in c.history)
            assert all(len(h.hash_reports) == 2 for h in c.history)
        theta = coordinator.controller.theta()
        for site in out.values():
            assert torch.equal(global_snapshot(site["sync"]), theta)  # one rank: pieces in canonical order
            assert site["sync"].bytes_sent > 0 and site["sync"].bytes_received > 0


def test_overlap_mixes_the_global_fragment_tau_steps_after_its_push() -> None:
    cfg = streaming_config(fragments=2, overlap=1, rounds=2)
    with coordinator_for(cfg) as coordinator:
        out = run_sites(coordinator)
    sync, merges = out["site-a"]["sync"], out["site-a"]["merges"]
    plan = FragmentPlan.of_model(Blocks(), 2)
    alpha = cfg.outer.mix_alpha
    for step, (before, after, snapshot) in enumerate(merges):
        at = step % cfg.inner.steps_per_round + 1
        merged = [p for p in range(2) if sync.schedule.merge_step(p) == at]
        for p in range(2):
            b, a, g = (plan.gather(p, t) for t in (before, after, snapshot))
            if p in merged:  # local <- α·local + (1-α)·global, exactly
                assert torch.equal(a, torch.lerp(b, g, 1 - alpha))
            else:
                assert torch.equal(a, b)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("behind", [1, CATCH_UP_ROUNDS + 1])
@pytest.mark.parametrize(("fragments", "overlap"), [(1, 0), (2, 1)])
def test_late_fragment_is_dropped_counted_and_caught_up(
    fragments: int, overlap: int, behind: int, caplog: pytest.LogCaptureFixture
) -> None:
    """site-b stalls before its push of fragment 0 in round 1 until that fragment's controller
    has committed ``behind`` rounds without it: its push is late (dropped, counted), and it
    rejoins and catches up (kept updates, or the full state when too far behind)."""
    caplog.set_level("INFO", logger="geodiloco.site")
    cfg = streaming_config(  # late merging off: dropped (a merge: tests/coordinator/test_late_merge.py)
        fragments, overlap, rounds=5, min_sites=1, round_timeout_s=0.2, outer__max_staleness=0
    )
    with coordinator_for(cfg) as coordinator:
        c0 = coordinator.fragment(0)
        push_at = cfg.inner.steps_per_round + (cfg.inner.steps_per_round // fragments - overlap) - 1
        stalled = []

        def stall(sync: OuterSync, step: int) -> None:
            if step == push_at:
                stalled.append(sync.bytes_received)
                wait_until(lambda: c0.round >= 1 + behind, "fragment 0 did not close without site-b")

        out = run_sites(coordinator, {"site-b": stall})
        assert stalled and c0.sites["site-b"].late == 1
        caught_up = f"{'fragment 0 ' if fragments > 1 else ''}round 1: caught up" in caplog.text
        assert caught_up == (behind <= CATCH_UP_ROUNDS)  # else the fragment's full state
        assert c0.history[1].contributors == ["site-a"]
        theta = coordinator.controller.theta()
        assert torch.equal(global_snapshot(out["site-b"]["sync"]), theta)
        assert torch.equal(global_snapshot(out["site-a"]["sync"]), theta)
        assert all(h.hashes_agree for c in coordinator.controller.fragments for h in c.history)


class LosesOnePush:
    """A link whose push of one fragment round never reaches the coordinator (as when the
    coordinator restarts before it commits): a fault placed at (site, fragment, round)."""

    def __init__(self, link: Any, fragment: int, round_: int) -> None:
        self.link, self.at, self.lost = link, (fragment, round_), 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.link, name)

    def push(self, part: PushPart, *, timeout_s: float) -> None:
        if (part.fragment, part.round) == self.at and not self.lost:
            self.lost += 1
            return
        self.link.push(part, timeout_s=timeout_s)


@pytest.mark.parametrize(("fragments", "overlap"), [(1, 0), (2, 1)])
def test_a_lost_push_is_pushed_again(fragments: int, overlap: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="geodiloco.site")
    cfg = streaming_config(fragments, overlap)
    with coordinator_for(cfg) as coordinator:
        lossy = LosesOnePush(coordinator.link("site-b"), 0, 1)
        real_link = coordinator.link
        coordinator.link = lambda name: lossy if name == "site-b" else real_link(name)  # type: ignore[method-assign]
        out = run_sites(coordinator)
        assert lossy.lost == 1 and "the coordinator lost this contribution; pushing again" in caplog.text
        for c in coordinator.controller.fragments:
            assert all(h.contributors == ["site-a", "site-b"] and h.hashes_agree for h in c.history)
        theta = coordinator.controller.theta()
        assert all(torch.equal(global_snapshot(site["sync"]), theta) for site in out.values())
