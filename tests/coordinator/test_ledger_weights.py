"""A site's weight is what the ledger gave it and it trained, never its claim: on plain tensors
in the round controller (on time, late, and in a round by time)."""

from __future__ import annotations

import torch

from geodiloco.config import RunConfig
from geodiloco.coordinator.rounds import RoundController
from geodiloco.testing.configs import tiny_config
from geodiloco.workload.data import split_windows

N = 64
SHARDS = [1000] * 24
INFLATE = 10**6


def controller(**overrides: object) -> RoundController:
    cfg = tiny_config(
        **{"min_sites": 1, "limits__max_delta_norm_ratio": 0.0, "aggregation__rule": "mean", **overrides}
    )
    return RoundController(cfg, torch.zeros(N), SHARDS)


def deltas() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(N, generator=gen) * 0.01, torch.randn(N, generator=gen) * 0.01


def given(c: RoundController, name: str) -> int:
    """The tokens of the windows the ledger reserved ``name`` this round."""
    return sum(d.windows for d in c.data_for(name)) * c.cfg.item_tokens


async def test_a_claim_a_million_times_the_ledger_changes_nothing_bit_for_bit() -> None:
    a, b = deltas()
    sums, thetas = [], []
    for claim in (1, INFLATE):
        c = controller(sites=["site-a", "site-b", "site-c"])  # site-c keeps the round open
        for name in c.cfg.sites:
            await c.join(name, "")
        honest = given(c, "site-b")
        assert honest == 3 * 4 * 16  # steps_per_round x batch_size x seq_len
        await c.contribute("site-a", "", 0, given(c, "site-a"), a)
        await c.contribute("site-b", "", 0, honest * claim, b)
        assert c.mean.tokens["site-b"] == honest
        sums.append(c.mean.total.clone())
        c.firsts[c.round] -= c.grace.window_s  # the window passes without site-c
        await c.tick()
        assert c.round == 1 and c.history[0].tokens == 2 * honest
        thetas.append(c.theta.clone())
    assert torch.equal(sums[0], sums[1]) and torch.equal(thetas[0], thetas[1])


async def test_a_smaller_claim_is_believed_it_only_lowers_the_sites_own_weight() -> None:
    a, _ = deltas()
    c = controller()
    for name in c.cfg.sites:
        await c.join(name, "")
    await c.contribute("site-a", "", 0, 50, a)
    assert c.mean.tokens["site-a"] == 50


async def test_a_late_push_weighs_its_held_windows_not_its_claim() -> None:
    a, b = deltas()
    c = controller(outer__max_staleness=2)
    for name in c.cfg.sites:
        await c.join(name, "")
    honest = given(c, "site-b")
    await c.contribute("site-a", "", 0, given(c, "site-a"), a)
    c.firsts[c.round] -= c.grace.window_s  # the window passes without site-b
    await c.tick()
    assert c.round == 1
    await c.contribute("site-b", "", 0, honest * INFLATE, b)  # one round late
    assert c.late_keys["site-b@0"] == ["site-b", 0, honest, honest // 2]


async def test_a_round_by_time_weighs_the_steps_trained() -> None:
    a, _ = deltas()
    c = controller(inner__round_seconds=1.0)
    for name in c.cfg.sites:
        await c.join(name, "")
    per_step = c.cfg.data.batch_size  # one rank
    one_step, _ = split_windows(c.data_for("site-a"), per_step)
    await c.contribute("site-a", "", 0, INFLATE, a, data=one_step)
    assert c.mean.tokens["site-a"] == per_step * c.cfg.model.seq_len


def test_tokens_per_item_is_seq_len_for_the_reference_data_else_stated_or_one() -> None:
    assert tiny_config().item_tokens == 16
    assert tiny_config(data__tokens_per_item=7).item_tokens == 7
    own = RunConfig.from_dict({"workload": {"data": "mine.data:build"}})
    assert own.item_tokens == 1
    assert (
        RunConfig.from_dict(
            {"workload": {"data": "mine.data:build"}, "data": {"tokens_per_item": 512}}
        ).item_tokens
        == 512
    )
