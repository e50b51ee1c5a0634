"""Robust aggregation rules on plain tensors, then in the round controller (NaN still refused,
replay after a restart) and over the in-process link (every replica's hash agrees)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from geodiloco.config import AggregationConfig, ConfigError
from geodiloco.coordinator.aggregator import WeightedMean
from geodiloco.coordinator.refusals import InvalidArgument
from geodiloco.coordinator.robust import (
    HeldContributions,
    clip_scales,
    combine,
    effective_rule,
    kept_by_distance,
)
from geodiloco.coordinator.rounds import RoundController
from geodiloco.testing.configs import streaming_config, tiny_config
from geodiloco.testing.local_runs import coordinator_for, global_snapshot, run_sites

N = 64
SITES = ["site-a", "site-b", "site-c", "site-d"]


def honest(k: int, n: int = N, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=gen) * 0.01 + torch.randn(k, n, generator=gen) * 0.002


def held(values: torch.Tensor, weights: list[int], **cfg: object) -> torch.Tensor:
    agg = HeldContributions(values.shape[1], AggregationConfig(**cfg))  # type: ignore[arg-type]
    for i, (v, w) in enumerate(zip(values, weights, strict=True)):
        agg.add(f"s{i}", v.clone(), w)
    return agg.mean().clone()


def test_mean_and_clip_without_an_outlier_are_the_weighted_mean() -> None:
    x, w = honest(4), [100, 200, 300, 400]
    expected = (x * torch.tensor(w, dtype=torch.float32)[:, None]).sum(0) / sum(w)
    assert torch.allclose(combine(x, w, "mean"), expected, atol=1e-9)
    assert torch.allclose(held(x, w, rule="clip"), expected, atol=1e-9)  # no norm beyond 2x the median


def test_clip_bounds_each_norm_to_a_multiple_of_the_median() -> None:
    x = honest(4)
    x[3] *= 50
    norms = x.norm(dim=1)
    scales = clip_scales([float(n) ** 2 for n in norms], 2.0)
    assert scales[:3] == [1.0, 1.0, 1.0]
    assert (norms[3] * scales[3]).item() == pytest.approx(2.0 * norms.median().item() * 1, rel=0.3)
    bound = 2.0 * float(torch.tensor([float(n) for n in norms]).sort().values[1:3].mean())
    assert (norms[3] * scales[3]).item() == pytest.approx(bound, rel=1e-6)
    out = held(x, [1, 1, 1, 1], rule="clip", clip_multiple=2.0)
    expected = (x[:3].sum(0) + x[3] * scales[3]) / 4
    assert torch.allclose(out, expected, atol=1e-7)


def test_trimmed_mean_drops_each_coordinates_ends_and_weighs_the_rest() -> None:
    x, w = honest(5), [1, 2, 3, 4, 5]
    out = held(x, w, rule="trimmed_mean", trim=1)
    for j in range(N):
        order = sorted(range(5), key=lambda i: (float(x[i, j]), i))[1:4]
        expected = sum(float(x[i, j]) * w[i] for i in order) / sum(w[i] for i in order)
        assert out[j].item() == pytest.approx(expected, rel=1e-5, abs=1e-9)


def test_weighted_median_is_the_middle_by_weight() -> None:
    x = honest(4)
    equal = held(x, [7, 7, 7, 7], rule="median")  # an even count: the mean of the middle two
    assert torch.allclose(equal, x.sort(dim=0).values[1:3].mean(0), atol=1e-9)
    heavy = held(x[:3], [1, 1, 5], rule="median")  # one weighs more than the others together
    assert torch.equal(heavy, x[2])
    odd = held(x[:3], [2, 2, 2], rule="median")
    assert torch.equal(odd, x[:3].median(dim=0).values)


def test_filtered_mean_drops_a_far_contribution_and_weighs_the_rest() -> None:
    x, w = honest(4), [100, 200, 300, 400]
    x[1] = -4 * x[1]  # far from the others: dropped
    expected = combine(x[[0, 2, 3]], [100, 300, 400], "mean")
    assert torch.allclose(held(x, w, rule="filtered_mean"), expected, atol=1e-9)
    x = honest(4)  # nobody stands out: the mean of all
    assert torch.allclose(held(x, w, rule="filtered_mean"), combine(x, w, "mean"), atol=1e-9)


@pytest.mark.parametrize("rule", ["filtered_mean", "clip"])
def test_a_round_that_drops_and_clips_nothing_commits_the_means_bits(rule: str) -> None:
    x, w = honest(4), [100, 200, 300, 400]
    mean = WeightedMean(N)
    for i, (v, weight) in enumerate(zip(x, w, strict=True)):
        mean.add(f"s{i}", v, weight)
    assert torch.equal(held(x, w, rule=rule), mean.mean())


def test_the_filter_keeps_a_majority_and_drops_only_beyond_the_multiple() -> None:
    assert kept_by_distance([1.0, 1.0, 1.0, 100.0], 2.0) == [1.0, 1.0, 1.0, 0.0]
    assert kept_by_distance([1.0, 1.0, 3.9, 1.0], 2.0) == [1.0, 1.0, 1.0, 1.0]  # 1.97 < 2 x 1
    assert kept_by_distance([1, 1, 1, 900, 400], 2.0) == [1.0, 1.0, 1.0, 0.0, 0.0]  # two far of five
    # squared distances in, distances compared: 20 is not beyond 2 x the median 10
    assert kept_by_distance([1, 1, 100, 900, 400], 2.0) == [1.0, 1.0, 1.0, 0.0, 1.0]


def test_filtered_mean_samples_its_distances_on_a_large_model() -> None:
    assert HeldContributions(1000, AggregationConfig()).stride == 1
    assert HeldContributions(3 << 18, AggregationConfig()).stride == 2
    assert HeldContributions(100_000_000, AggregationConfig()).stride == 256
    assert HeldContributions(10**12, AggregationConfig()).stride == 1 << 16  # at most a block


def test_fewer_sites_than_a_rule_needs_fall_back_to_clip() -> None:
    assert effective_rule("trimmed_mean", 2, 1) == "clip"
    assert effective_rule("trimmed_mean", 4, 2) == "clip"
    assert effective_rule("trimmed_mean", 3, 1) == "trimmed_mean"
    assert effective_rule("median", 2, 1) == "clip" and effective_rule("median", 3, 1) == "median"
    assert effective_rule("filtered_mean", 2, 1) == "clip"
    # two sites: 2x the median of two norms is their sum, so clip at 2 leaves the mean
    x = honest(2)
    x[1] *= 100
    assert torch.allclose(held(x, [1, 3]), combine(x, [1, 3], "mean"), atol=1e-7)


@pytest.mark.parametrize("rule", ["filtered_mean", "trimmed_mean", "median", "clip"])
@pytest.mark.parametrize("attack", ["sign_flip", "constant", "noise"])
def test_one_poisoning_site_of_four_is_outvoted(rule: str, attack: str) -> None:
    x = honest(4)
    good = combine(x[:3], [1, 1, 1], "mean")
    gen = torch.Generator().manual_seed(9)
    x[3] = {
        "sign_flip": -10 * x[3],
        "constant": torch.full((N,), 1.0),
        "noise": torch.randn(N, generator=gen) * 1.0,
    }[attack]
    robust, mean = held(x, [1, 1, 1, 1], rule=rule), combine(x, [1, 1, 1, 1], "mean")
    assert (mean - good).norm() > 2 * good.norm()
    if rule == "clip":  # bounded, not outvoted: the poison weighs 1/4 at 2x the median norm at most
        median = x.norm(dim=1).sort().values[1:3].mean()
        assert (robust - good).norm() <= 1.001 * (2 * median + good.norm()) / 4
    else:
        assert (robust - good).norm() < 0.5 * good.norm()


@pytest.mark.parametrize("rule", ["filtered_mean", "trimmed_mean"])
def test_a_held_round_is_processed_span_by_span_with_the_same_result(rule: str) -> None:
    x, w = honest(4, n=3 * 70_000 + 5), [3, 1, 4, 1]
    x[2] *= -5
    whole = held(x, w, rule=rule)
    agg = HeldContributions(x.shape[1], AggregationConfig(rule=rule))
    for i, v in enumerate(x):
        agg.add(f"s{i}", v.clone(), w[i])
    agg.ready()
    for start in range(0, x.shape[1], 50_000):
        agg.prepare(start, min(50_000, x.shape[1] - start))
    assert torch.equal(agg.total, whole)


def test_config_names_the_bad_field() -> None:
    with pytest.raises(ConfigError, match=r"aggregation\.rule"):
        tiny_config(aggregation__rule="krum")
    with pytest.raises(ConfigError, match=r"aggregation\.trim"):
        tiny_config(aggregation__trim=0)
    with pytest.raises(ConfigError, match=r"aggregation\.clip_multiple"):
        tiny_config(aggregation__clip_multiple=0.5)
    with pytest.raises(ConfigError, match=r"aggregation\.filter_multiple"):
        tiny_config(aggregation__filter_multiple=0.9)
    assert tiny_config().aggregation.rule == "filtered_mean"  # the default


def controller(run_dir: Path | None = None) -> RoundController:
    cfg = tiny_config(sites=SITES, limits__max_delta_norm_ratio=0.0, rounds=4, snapshot_every=100)
    return RoundController(cfg, torch.zeros(N), [1000] * 24, run_dir)


async def test_nan_is_refused_and_a_restart_replays_the_robust_rounds(tmp_path: Path) -> None:
    c = controller(tmp_path)
    for name in SITES:
        await c.join(name, "")
    with pytest.raises(InvalidArgument, match="NaN or Inf"):
        await c.contribute("site-a", "", 0, 192, torch.full((N,), float("nan")))
    assert not c.mean.contributors
    for r in range(2):
        x = honest(4, seed=r)
        x[3] = -20 * x[3]  # site-d poisons
        for name, delta in zip(SITES, x, strict=True):
            await c.contribute(name, "", r, 192, delta)
    assert c.round == 2 and [h.set_aside for h in c.history] == [{"site-d": 0.0}] * 2  # dropped
    resumed = controller(tmp_path)  # replays the logged updates: the same θ, the same chain
    assert resumed.round == 2 and torch.equal(resumed.theta, c.theta) and resumed.hashes == c.hashes
    assert [h.set_aside for h in resumed.history] == [{"site-d": 0.0}] * 2
    for name in SITES:
        await resumed.join(name, "")
    for name, delta in zip(SITES, honest(4, seed=5), strict=True):  # an honest round: nothing aside
        await resumed.contribute(name, "", 2, 192, delta)
    assert resumed.round == 3 and resumed.history[2].set_aside == {}


def test_every_replica_agrees_with_the_default_rule_over_fragments() -> None:
    cfg = streaming_config(2, 1, sites=SITES, rounds=3, min_sites=4)
    assert cfg.aggregation.rule == "filtered_mean"
    with coordinator_for(cfg) as coordinator:
        out = run_sites(coordinator)
        theta = coordinator.controller.theta()
        for site in out.values():
            assert torch.equal(global_snapshot(site["sync"]), theta)
        for c in coordinator.controller.fragments:
            assert c.round == 3 and all(h.hashes_agree and len(h.hash_reports) == 4 for h in c.history)
