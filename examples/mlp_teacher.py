"""A user's own workload for geodiloco: an MLP classifier on a synthetic teacher task.

Inputs are Gaussian vectors and labels the argmax of a fixed random "teacher" network, so
every machine generates the same dataset from the run's seed (nothing to download) and the
student has something real to learn. The three functions at the bottom are the builders a run
config names (``workload.model = "mlp_teacher:build_model"`` ...); ``train_mlp_teacher.py``
uses them in a training loop of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from geodiloco.config import ConfigError, RunConfig
from geodiloco.workload import DataRange

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True, slots=True)
class Options:
    """The example's own settings, read from the run config's ``[workload.options]`` table."""

    features: int = 32
    classes: int = 8
    hidden: int = 128
    depth: int = 2
    items_per_shard: int = 2048
    eval_items: int = 1024
    lr: float = 2e-3

    @classmethod
    def of(cls, cfg: RunConfig) -> Options:
        names = {f.name for f in dataclasses.fields(cls)}
        for key, value in cfg.workload.options.items():
            if key not in names:
                raise ConfigError(f"workload.options.{key}: unknown; accepted: {', '.join(sorted(names))}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"workload.options.{key}: expected a positive number, got {value!r}")
        return cls(**cfg.workload.options)


class MLPClassifier(nn.Module):
    """``depth`` hidden layers of width ``hidden``; ``model(x)`` gives the class logits, which
    geodiloco's default loss (``workload.loss``) scores by cross-entropy against the labels."""

    def __init__(self, o: Options) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = o.features
        for _ in range(o.depth):
            layers += [nn.Linear(width, o.hidden), nn.GELU()]
            width = o.hidden
        layers.append(nn.Linear(width, o.classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class TeacherData:
    """``shards`` x ``items_per_shard`` training examples and a held-out set, from the seed.

    The coordinator's ledger hands out ranges of item positions per shard; item ``i`` of shard
    ``s`` is row ``s * items_per_shard + i`` on every machine.
    """

    def __init__(self, cfg: RunConfig) -> None:
        o = Options.of(cfg)
        gen = torch.Generator().manual_seed(cfg.seed + 1)  # not the model's stream
        teacher = [
            torch.randn(o.features, 4 * o.classes, generator=gen),
            torch.randn(4 * o.classes, o.classes, generator=gen),
        ]
        total = cfg.data.shards * o.items_per_shard + o.eval_items
        x = torch.randn(total, o.features, generator=gen)
        labels = (torch.tanh(x @ teacher[0]) @ teacher[1]).argmax(dim=1)
        self.items_per_shard = o.items_per_shard
        self.shards = cfg.data.shards
        self.batch_size = cfg.data.batch_size
        self.train = (x[: -o.eval_items], labels[: -o.eval_items])
        self.eval = (x[-o.eval_items :], labels[-o.eval_items :])
        self._ranges: tuple[DataRange, ...] | None = None
        self._rows = torch.empty(0, dtype=torch.long)

    @property
    def shard_sizes(self) -> list[int]:
        return [self.items_per_shard] * self.shards

    def batch(self, ranges: Sequence[DataRange], step: int, rank: int, world: int) -> Batch:
        key = tuple(ranges)
        if key != self._ranges:  # a new round: the rows its ranges name, in order
            parts = [r.shard * self.items_per_shard + torch.arange(r.start, r.end) for r in key]
            self._ranges, self._rows = key, torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
        first = (step * world + rank) * self.batch_size
        rows = self._rows[first : first + self.batch_size]
        return self.train[0][rows], self.train[1][rows]

    def tokens(self, batch: Batch) -> int:
        return int(batch[0].shape[0])  # examples

    def eval_batches(self, part: int, parts: int) -> Iterator[Batch]:
        x, labels = self.eval[0][part::parts], self.eval[1][part::parts]
        for i in range(0, x.shape[0], 256):
            yield x[i : i + 256], labels[i : i + 256]


def build_model(cfg: RunConfig) -> MLPClassifier:
    """Seeded, so the coordinator's θ_0 and every site's initial model are the same."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return MLPClassifier(Options.of(cfg))


def build_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=Options.of(cfg).lr, weight_decay=0.0)


def build_data(cfg: RunConfig) -> TeacherData:
    return TeacherData(cfg)
