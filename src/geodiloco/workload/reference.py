"""The reference workload behind the config's default builders (``workload.*``).

Its model is the byte-level GPT (with mixture-of-experts MLPs when ``model.experts`` > 0), its
optimizer AdamW with the ``inner`` settings, and its data the byte corpus, whose ledger items are
windows of ``model.seq_len + 1`` bytes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from geodiloco.workload.data import (
    DataRange,
    DataShards,
    eval_slice,
    eval_windows,
    load_corpus,
    rank_batch,
    require_text,
)
from geodiloco.workload.model import build_model as build_gpt
from geodiloco.workload.moe import build_moe, hold_unreached
from geodiloco.workload.steps import make_inner_optimizer

if TYPE_CHECKING:
    from geodiloco.builders import Batch
    from geodiloco.config import RunConfig

EVAL_BATCH = 32


class ReferenceData:
    """The corpus's training shards and held-out windows, as :class:`geodiloco.builders.SiteData`."""

    def __init__(self, cfg: RunConfig) -> None:
        corpus = load_corpus(cfg.data.paths, cfg.data.max_bytes, cfg.data.eval_fraction)
        require_text(
            corpus, shards=cfg.data.shards, seq_len=cfg.model.seq_len, eval_sequences=cfg.data.eval_sequences
        )
        self.shards = DataShards(corpus, count=cfg.data.shards, seq_len=cfg.model.seq_len, seed=cfg.seed)
        self.eval = eval_windows(corpus, cfg.data.eval_sequences, cfg.model.seq_len)
        self.batch_size = cfg.data.batch_size
        self._ranges: tuple[DataRange, ...] | None = None
        self._windows = torch.empty(0, dtype=torch.long)

    @property
    def shard_sizes(self) -> list[int]:
        return self.shards.sizes

    def batch(self, ranges: Sequence[DataRange], step: int, rank: int, world: int) -> Batch:
        key = tuple(ranges)
        if key != self._ranges:  # a new round: gather its windows once
            self._ranges, self._windows = key, self.shards.windows(key)
        return rank_batch(self._windows, step, rank, world, self.batch_size)

    def tokens(self, batch: Batch) -> int:
        return batch[0].numel()

    def eval_batches(self, part: int, parts: int) -> Iterator[Batch]:
        mine = eval_slice(self.eval, part, parts)
        for i in range(0, mine.shape[0], EVAL_BATCH):
            w = mine[i : i + EVAL_BATCH]
            yield w[:, :-1], w[:, 1:]


def build_model(cfg: RunConfig) -> nn.Module:
    """The byte-level GPT; with ``model.experts`` > 0, its mixture-of-experts variant."""
    if cfg.model.experts:
        return build_moe(cfg.model, cfg.seed)
    return build_gpt(cfg.model, cfg.seed)


def build_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """AdamW; experts that no token reached in a step keep their values (see
    :func:`geodiloco.workload.moe.hold_unreached`)."""
    optimizer = make_inner_optimizer(model, cfg.inner)
    hold_unreached(model, optimizer)
    return optimizer


def build_data(cfg: RunConfig) -> ReferenceData:
    return ReferenceData(cfg)
