"""Failover is on by default: with the default quorum, and with the shipped deploy/run.toml, a
site that is lost mid-round stops being waited for and the run goes on without it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from geodiloco.config import RunConfig, load_config
from geodiloco.coordinator.rounds import RoundController
from geodiloco.testing.configs import tiny_config

N = 1000
DEPLOY_RUN = Path(__file__).resolve().parents[2] / "deploy" / "run.toml"


@pytest.mark.parametrize(("sites", "quorum"), [(1, 1), (2, 1), (3, 2), (4, 2), (5, 3)])
def test_default_quorum_is_half_the_sites_rounded_up(sites: int, quorum: int) -> None:
    cfg = RunConfig(sites=[f"s{i}" for i in range(sites)])
    assert cfg.quorum == quorum
    assert RunConfig(sites=cfg.sites, min_sites=sites).quorum == sites  # every site, when asked


async def lose_one_site(cfg: RunConfig) -> RoundController:
    """Every site joins and contributes to the first round (which waits for every site); in the
    second, the first contributes and the second goes silent past its lease."""
    c = RoundController(cfg, torch.zeros(N), [1000] * cfg.data.shards, None)
    first, second = cfg.sites[:2]
    for name in cfg.sites:
        await c.join(name, "")
        await c.contribute(name, "", 0, 100, torch.ones(N))
    assert c.round == 1
    await c.contribute(first, "", 1, 100, torch.ones(N))
    assert c.round == 1  # the second site is live: it is waited for
    await asyncio.sleep(cfg.lease_s + 0.1)
    c.member(first, "")  # the first site heartbeats; the second does not
    await c.tick()
    assert c.sites[second].state == "lost"
    return c


async def test_a_lost_site_does_not_block_a_run_with_default_settings() -> None:
    cfg = tiny_config(
        lease_s=0.6, heartbeat_interval_s=0.1, round_timeout_s=600.0, limits__max_delta_norm_ratio=0.0
    )
    assert cfg.min_sites == 0  # the default
    c = await lose_one_site(cfg)
    assert c.round == 2 and c.history[1].contributors == [cfg.sites[0]]


async def test_a_lost_site_does_not_block_the_shipped_deploy_run() -> None:
    shipped = load_config(DEPLOY_RUN)
    assert shipped.quorum < len(shipped.sites)
    # the shipped run, with a lease short enough for a test (the closing rule is the same) and
    # the norm check off (θ is zeros here)
    overrides = ["lease_s=0.6", "heartbeat_interval_s=0.1", "limits.max_delta_norm_ratio=0"]
    cfg = load_config(DEPLOY_RUN, overrides)
    c = await lose_one_site(cfg)
    assert c.round == 2 and c.history[1].contributors == [cfg.sites[0]]


async def test_the_first_round_waits_for_every_named_site_until_its_deadline() -> None:
    cfg = tiny_config(round_timeout_s=0.5, lease_s=60.0, limits__max_delta_norm_ratio=0.0)
    assert cfg.quorum == 1  # the default for two sites: site-a alone could commit
    c = RoundController(cfg, torch.zeros(N), [1000] * cfg.data.shards, None)
    await c.join("site-a", "")
    await c.contribute("site-a", "", 0, 100, torch.ones(N))
    await c.tick()
    assert c.round == 0 and c.phase == "waiting_for_sites"  # site-b has not joined yet
    await asyncio.sleep(0.6)
    await c.tick()  # the deadline passed: close on quorum as usual
    assert c.round == 1 and c.history[0].contributors == ["site-a"]
    await c.contribute("site-a", "", 1, 100, torch.ones(N))
    assert c.round == 2  # later rounds wait only for live sites, and site-b never joined


async def test_the_first_round_closes_as_soon_as_every_site_is_in() -> None:
    cfg = tiny_config(round_timeout_s=600.0, limits__max_delta_norm_ratio=0.0)
    c = RoundController(cfg, torch.zeros(N), [1000] * cfg.data.shards, None)
    await c.join("site-a", "")
    await c.contribute("site-a", "", 0, 100, torch.ones(N))
    assert c.round == 0
    await c.join("site-b", "")  # a late joiner still trains round 0
    await c.contribute("site-b", "", 0, 100, torch.ones(N))
    assert c.round == 1 and c.history[0].contributors == ["site-a", "site-b"]
