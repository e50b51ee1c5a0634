"""Data as people write it: a map-style dataset, an iterable, a sampler with replacement and a
token sequence each train through the site data path, every ledger item used exactly once per
pass, and the coordinator reads no item (its datasets raise if it tries)."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset, WeightedRandomSampler

from geodiloco.builders import (
    BuilderError,
    build_data,
    build_loss,
    build_model,
    check_site_step,
    check_workload,
)
from geodiloco.config import ConfigError, RunConfig, load_config
from geodiloco.coordinator.edge.server import data_shard_sizes
from geodiloco.coordinator.ledger import DataLedger
from geodiloco.workload.datasets import DataSource

MODULE = "test_datasets"
ITEMS, FEATURES, CLASSES = 96, 4, 3
SCALE = 1000.0  # feature 0 of sample i is i / SCALE


def on_a_site() -> None:
    """Items are read by a site's ranks (torchrun sets LOCAL_RANK), never by the coordinator."""
    if "LOCAL_RANK" not in os.environ:
        raise AssertionError("a dataset item was read outside a site's ranks (on the coordinator)")


def sample(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``i``: its features carry its index, so a test can tell which one it was."""
    x = torch.full((FEATURES,), i / SCALE)
    x[1:] = torch.sin(torch.arange(1, FEATURES) * (i + 1.0))
    return x, torch.tensor(i % CLASSES)


def index(x: torch.Tensor) -> list[int]:
    """The sample numbers of a batch's features."""
    return (x[:, 0] * SCALE).round().long().tolist()


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int = ITEMS, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        on_a_site()
        if not 0 <= i < self.n:
            raise IndexError(i)
        return sample(self.offset + i)


class Stream(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int = ITEMS, offset: int = 0) -> None:
        self.n, self.offset = n, offset

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        on_a_site()
        return (sample(self.offset + i) for i in range(self.n))


class Tokens:
    """A token sequence that refuses to be read off a site (a memmap would be read lazily too)."""

    def __init__(self, n: int) -> None:
        self.ids = np.arange(n, dtype=np.uint16)  # token i is i: a window shows where it starts

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, s: slice) -> np.ndarray:
        on_a_site()
        return self.ids[s]


def map_style(cfg: RunConfig) -> Samples:
    return Samples()  # bare: the last 5% are held out


def iterable(cfg: RunConfig) -> DataSource:
    return DataSource(Stream(), eval=Stream(16, offset=1000), items=ITEMS)


def sampler(cfg: RunConfig) -> DataSource:
    weights = torch.linspace(0.1, 1.0, ITEMS)  # later samples drawn more often, some twice
    draws = WeightedRandomSampler(weights, num_samples=2 * ITEMS, replacement=True)
    return DataSource(Samples(), eval=Samples(16, offset=1000), sampler=draws)


def windows(cfg: RunConfig) -> DataSource:
    return DataSource(Tokens(20_000), unit="windows", seq_len=16)


def not_data(cfg: RunConfig) -> object:
    return 42


def classifier(cfg: RunConfig) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))


def sgd(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05)


def config(data: str, *more: str) -> RunConfig:
    return load_config(
        None,
        [
            f"workload.model={MODULE}:classifier",
            f"workload.optimizer={MODULE}:sgd",
            f"workload.data={MODULE}:{data}",
            "data.shards=4",
            "data.batch_size=4",
            "inner.steps_per_round=2",
            *more,
        ],
    )


def train_through_ledger(cfg: RunConfig, rounds: int, ranks: dict[str, int]) -> list[torch.Tensor]:
    """What the sites' ranks read, round by round, from the ledger's reservations."""
    data = build_data(cfg)
    ledger = DataLedger.create(data_shard_sizes(cfg), list(ranks))
    seen: list[torch.Tensor] = []
    per_round = cfg.inner.steps_per_round * cfg.data.batch_size
    for r in range(rounds):
        for site, world in ranks.items():
            ranges = ledger.reserve(site, per_round * world)
            for step in range(cfg.inner.steps_per_round):
                for rank in range(world):
                    batch = data.batch(ranges, step, rank, world)
                    assert len(batch[0]) == cfg.data.batch_size
                    seen.append(batch[0])
        ledger.settle(r, set(ranks))
    return seen


@pytest.fixture
def site(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")


@pytest.mark.parametrize("kind", ["map_style", "iterable", "sampler", "windows"])
def test_the_coordinator_sizes_each_kind_and_its_dry_step_reads_no_item(kind: str) -> None:
    cfg = config(kind)
    sizes = data_shard_sizes(cfg)  # would raise if an item were read
    want = {"map_style": ITEMS - 5, "iterable": ITEMS, "sampler": 2 * ITEMS, "windows": (19_000 - 1) // 16}
    assert len(sizes) == 4 and sum(sizes) == want[kind]
    check_workload(cfg)


def test_a_map_style_dataset_is_read_exactly_once_per_pass_in_a_seeded_order(site: None) -> None:
    cfg = config("map_style")
    # two rounds stay within each site's own shards (a site whose shards run dry goes on into
    # their next pass, the ledger's design, so a third round would repeat some of site-1's)
    seen = torch.cat(train_through_ledger(cfg, rounds=2, ranks={"site-1": 2, "site-2": 1}))
    indices = index(seen)
    assert len(indices) == 48 and len(set(indices)) == 48  # 48 of the 91 training samples, none twice
    assert max(indices) < ITEMS - 5  # the held-out tail is never trained on
    assert indices != sorted(indices)  # shuffled within shards
    again = torch.cat(train_through_ledger(cfg, rounds=2, ranks={"site-1": 2, "site-2": 1}))
    assert torch.equal(seen, again)  # the same on every machine
    # a second pass over the data: every sample exactly twice after two epochs' worth
    two = torch.cat(train_through_ledger(config("map_style", "inner.steps_per_round=13"), 2, {"a": 1}))
    counts = Counter(index(two))
    assert sum(counts.values()) == 104 and max(counts.values()) == 2


def test_an_iterable_is_dealt_round_robin_and_read_in_stream_order(site: None) -> None:
    cfg = config("iterable")  # sites site-1 and site-2
    seen = torch.cat(train_through_ledger(cfg, rounds=2, ranks={"site-1": 1, "site-2": 1}))
    indices = index(seen)
    assert len(set(indices)) == len(indices) == 32
    # site-1 owns shards 0 and 2: positions 0, 4, 8, ... then 2, 6, ...
    assert indices[:8] == [0, 4, 8, 12, 16, 20, 24, 28]
    data = build_data(cfg)
    evaluated = index(torch.cat([x for x, _ in data.eval_batches(1, 2)]))
    assert evaluated == list(range(1001, 1016, 2))


def test_a_sampler_draws_with_replacement_and_the_ledger_counts_draws(site: None) -> None:
    cfg = config("sampler", "inner.steps_per_round=12")
    seen = torch.cat(train_through_ledger(cfg, rounds=4, ranks={"site-1": 1, "site-2": 1}))
    indices = index(seen)
    assert len(indices) == 4 * 2 * 48  # every draw of two passes, once each
    assert len(set(indices)) < ITEMS < len(indices) // 2  # drawn with replacement
    assert sum(i >= ITEMS // 2 for i in indices) > 0.6 * len(indices)  # by the sampler's weights
    first, second = Counter(indices[: len(indices) // 2]), Counter(indices[len(indices) // 2 :])
    assert first != second  # each pass over a shard draws afresh


def test_a_token_sequence_is_cut_into_windows_for_next_token_prediction(site: None) -> None:
    cfg = config("windows")
    data = build_data(cfg)
    ranges = DataLedger.create(data.shard_sizes, ["site-1"]).reserve("site-1", 8)
    x, y = data.batch(ranges, 0, 0, 1)
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1]) and all(int(r[0]) % 16 == 0 for r in x)
    assert data.tokens((x, y)) == 64
    held = torch.cat([b[0] for b in data.eval_batches(0, 1)])
    assert held.shape == ((1000 - 1) // 16, 16) and int(held[0, 0]) == 19_000


def test_the_site_dry_step_reads_the_first_batches_of_a_dataset(site: None) -> None:
    cfg = config("map_style")
    check_site_step(cfg, build_model(cfg), build_data(cfg), build_loss(cfg))
    bad = config("map_style", f"workload.model={MODULE}:three_features")
    with pytest.raises(BuilderError, match=r"^workload.model: .*mat1 and mat2 shapes cannot be multiplied"):
        check_site_step(bad, build_model(bad), build_data(bad), build_loss(bad))


def three_features(cfg: RunConfig) -> nn.Module:
    return nn.Linear(3, CLASSES)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("not_data", r"^workload.data: test_datasets:not_data returned int, which is neither a map-style"),
        ("no_length", r"^workload.data: an iterable needs its length"),
        ("no_eval", r"^workload.data: give DataSource\(eval=...\) a held-out set"),
        ("bad_draws", r"^workload.data: the sampler drew an index outside the dataset's 96 items"),
    ],
)
def test_data_that_cannot_be_adapted_is_one_config_error(site: None, data: str, message: str) -> None:
    cfg = config(data)
    with pytest.raises(ConfigError, match=message) as err:
        check_site_step(cfg, build_model(cfg), build_data(cfg), build_loss(cfg))
    assert "\n" not in str(err.value)


def no_length(cfg: RunConfig) -> DataSource:
    return DataSource(iter(range(5)), eval=Samples(4))


def no_eval(cfg: RunConfig) -> DataSource:
    return DataSource(Stream(), items=ITEMS)


def bad_draws(cfg: RunConfig) -> DataSource:
    return DataSource(Samples(), eval=Samples(4), sampler=_Draws())


class _Draws:
    def __len__(self) -> int:
        return 8

    def __iter__(self) -> Iterator[Any]:
        return iter(range(90, 98))
