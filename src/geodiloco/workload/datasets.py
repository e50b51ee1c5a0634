"""Data as people write it, adapted to the coordinator's data ledger.

A data builder may return, instead of a :class:`geodiloco.builders.SiteData`:

- a map-style dataset (``__len__`` and ``__getitem__``, e.g. a ``torch.utils.data.Dataset``);
- a :class:`DataSource` around a map-style dataset, an iterable (``IterableDataset``, a
  generator function's result, ...), a dataset with a sampler that draws with replacement, or a
  token sequence cut into windows (a 1-D tensor, a numpy array or ``np.memmap``).

The ledger counts *items* in the units the source declares: sample indices (map-style), stream
positions (iterable), draws (sampler) or windows of ``seq_len + 1`` tokens (token sequence). It
hands each site ranges of items per round and keeps every item used exactly once per pass,
whatever sites fail. The coordinator asks only for ``len()``; items are read on the sites, by
the ranks that train on them.

How items become shards (``data.shards`` of them) and batches:

- map-style, sampler and windows: contiguous runs of item numbers, each read in its own seeded
  order (a sampler's draws are redrawn for each pass over a shard, seeded by the run's seed and
  the pass);
- iterable: round robin by stream position (shard ``s`` holds positions ``s, s + S, ...``), in
  stream order, so that every site reads the stream once, front to back;
- a batch is ``collate`` (default: torch's ``default_collate``) of ``data.batch_size`` items,
  as a tuple ``(*inputs, targets)``; a window ``w`` gives ``(w[:-1], w[1:])``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.utils.data import default_collate

from geodiloco.workload.data import DataRange, _refuse

if TYPE_CHECKING:
    from geodiloco.config import RunConfig

Batch = tuple[torch.Tensor, ...]
UNITS = ("samples", "windows")
EVAL_BATCH = 32
SEED_STRIDE = 1_000_003  # keeps the seeds of (run seed, shard or pass) pairs apart


@dataclass(slots=True)
class DataSource:
    """A dataset and how the ledger counts it (what a data builder returns for data it does not
    read itself). ``eval`` is the held-out set of the same kind; without it, the last
    ``eval_fraction`` of a map-style dataset or token sequence is held out."""

    train: Any
    eval: Any = None
    sampler: Iterable[int] | None = None  # draws of indices into train, with replacement
    unit: str = "samples"  # or "windows" (train is a token sequence)
    seq_len: int = 0  # windows: tokens in a model input (a window is seq_len + 1)
    items: int = 0  # an iterable's length, when it has no __len__
    eval_fraction: float = 0.05
    eval_batch_size: int = EVAL_BATCH
    collate: Callable[[list[Any]], Any] | None = None
    tokens: Callable[[Batch], int] | None = None  # default: tokens in inputs (windows), else samples


def _is_map(obj: Any) -> bool:
    return hasattr(obj, "__len__") and hasattr(obj, "__getitem__")


def _length(obj: Any, what: str) -> int:
    try:
        n = len(obj)
    except TypeError:
        _refuse(f"workload.data: {what} ({type(obj).__name__}) has no length")
    return int(n)


class ShardOrder:
    """Items ``[0, n)`` cut into ``count`` contiguous shards, each read in its own seeded order,
    drawn when the shard is first read (the coordinator, asking for sizes only, draws none)."""

    def __init__(self, n: int, count: int, seed: int) -> None:
        self.starts = [n * i // count for i in range(count)]
        self.sizes = [n * (i + 1) // count - self.starts[i] for i in range(count)]
        self.seed = seed
        self._orders: dict[int, torch.Tensor] = {}

    def items(self, r: DataRange) -> list[int]:
        if r.shard not in self._orders:
            gen = torch.Generator().manual_seed(self.seed * SEED_STRIDE + r.shard)
            self._orders[r.shard] = torch.randperm(self.sizes[r.shard], generator=gen)
        return (self._orders[r.shard][r.start : r.end] + self.starts[r.shard]).tolist()


class RoundRobin:
    """Stream positions ``[0, n)`` dealt to ``count`` shards in turn, kept in stream order."""

    def __init__(self, n: int, count: int) -> None:
        self.count = count
        self.sizes = [len(range(s, n, count)) for s in range(count)]

    def items(self, r: DataRange) -> list[int]:
        return [k * self.count + r.shard for k in range(r.start, r.end)]


class Stream:
    """Reads an iterable by position, front to back; going back restarts it (the iterable must
    give the same items each time it is iterated)."""

    def __init__(self, source: Iterable[Any]) -> None:
        self.source = source
        self._it: Iterator[Any] | None = None
        self._next = 0  # position of the item the iterator gives next

    def read(self, positions: Sequence[int]) -> dict[int, Any]:
        found: dict[int, Any] = {}
        for p in sorted(set(positions)):
            if self._it is None or p < self._next:
                self._it, self._next = iter(self.source), 0
            item: Any = None
            while self._next <= p:
                item = next(self._it, _END)
                if item is _END:
                    _refuse(f"workload.data: the iterable ended at position {self._next}, before {p}")
                self._next += 1
            found[p] = item
        return found


_END = object()


class ItemData:
    """A :class:`DataSource` as :class:`geodiloco.builders.SiteData`: the ledger's items, cut into
    shards, read and collated on the sites only."""

    def __init__(self, source: DataSource, cfg: RunConfig) -> None:
        if source.unit not in UNITS:
            _refuse(f"workload.data: unit {source.unit!r} is not one of {', '.join(UNITS)}")
        self.source = source
        self.seed = cfg.seed
        self.batch_size = cfg.data.batch_size
        self.collate = source.collate or default_collate
        self._draws: dict[int, torch.Tensor] = {}
        self._eval_stream: Stream | None = None
        train, shards = source.train, cfg.data.shards
        self.held = 0  # items (windows: tokens) at the end of train held out for evaluation
        if source.eval is None:
            if source.sampler is not None or not _is_map(train):
                _refuse(
                    "workload.data: give DataSource(eval=...) a held-out set: only a map-style dataset or "
                    "a token sequence can hold out its own last eval_fraction"
                )
            if not 0.0 < source.eval_fraction < 0.5:
                _refuse(f"workload.data: eval_fraction must be in (0, 0.5), got {source.eval_fraction}")
            self.held = math.ceil(_length(train, "the dataset") * source.eval_fraction)
        self.stream: Stream | None = None
        self.plan: ShardOrder | RoundRobin
        if source.unit == "windows":
            if source.seq_len < 1 or source.sampler is not None:
                _refuse("workload.data: windows need seq_len >= 1 and no sampler")
            n = max(0, (_length(train, "the token sequence") - self.held - 1) // source.seq_len)
            self.plan = ShardOrder(n, shards, cfg.seed)
        elif source.sampler is not None:
            if not _is_map(train):
                _refuse("workload.data: a sampler draws indices into a map-style dataset (len and [])")
            self.plan = ShardOrder(_length(source.sampler, "the sampler"), shards, cfg.seed)
        elif _is_map(train):
            self.plan = ShardOrder(_length(train, "the dataset") - self.held, shards, cfg.seed)
        elif isinstance(train, Iterable):
            n = source.items or (len(train) if hasattr(train, "__len__") else 0)  # type: ignore[arg-type]
            if n < 1:
                _refuse("workload.data: an iterable needs its length: give it __len__ or DataSource(items=N)")
            self.stream = Stream(train)
            self.plan = RoundRobin(n, shards)
        else:
            _refuse(
                f"workload.data: {type(train).__name__} is neither a map-style dataset (len and []) nor "
                "an iterable"
            )

    @property
    def shard_sizes(self) -> list[int]:
        return self.plan.sizes

    def batch(self, ranges: Sequence[DataRange], step: int, rank: int, world: int) -> Batch:
        first = (step * world + rank) * self.batch_size
        picked: list[tuple[int, int]] = []  # (pass, item) of this rank's share, in ledger order
        for r in ranges:
            if first >= r.windows:
                first -= r.windows
                continue
            take = min(r.windows - first, self.batch_size - len(picked))
            part = DataRange(r.shard, r.start + first, r.start + first + take, r.epoch)
            picked += [(r.epoch, i) for i in self.plan.items(part)]
            first = 0
            if len(picked) == self.batch_size:
                break
        return self._collate(self._read(picked))

    def _read(self, picked: list[tuple[int, int]]) -> list[Any]:
        source = self.source
        if source.unit == "windows":
            length = source.seq_len + 1
            return [
                _tokens(source.train[i * source.seq_len : i * source.seq_len + length]) for _, i in picked
            ]
        if self.stream is not None:
            found = self.stream.read([i for _, i in picked])
            return [found[i] for _, i in picked]
        if source.sampler is not None:
            return [source.train[int(self._drawn(e)[i])] for e, i in picked]
        return [source.train[i] for _, i in picked]

    def _drawn(self, epoch: int) -> torch.Tensor:
        """The sampler's draws in pass ``epoch`` (the same on every machine: seeded here)."""
        if epoch not in self._draws:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed * SEED_STRIDE + epoch)
                draws = torch.tensor(list(self.source.sampler or ()), dtype=torch.long)
            n = _length(self.source.train, "the dataset")
            if draws.numel() and (int(draws.min()) < 0 or int(draws.max()) >= n):
                _refuse(f"workload.data: the sampler drew an index outside the dataset's {n} items")
            self._draws = {epoch: draws}  # one pass at a time is enough
        return self._draws[epoch]

    def _collate(self, items: list[Any]) -> Batch:
        if self.source.unit == "windows":
            w = torch.stack(items)
            return w[:, :-1], w[:, 1:]
        out = self.collate(items)
        if isinstance(out, torch.Tensor):
            return (out,)
        if isinstance(out, (tuple, list)):
            return tuple(out)
        _refuse(
            f"workload.data: a batch collated to {type(out).__name__}; samples must be tuples "
            "(*inputs, targets) of tensors, or give DataSource(collate=...) that makes one"
        )

    def tokens(self, batch: Batch) -> int:
        if self.source.tokens is not None:
            return self.source.tokens(batch)
        return batch[0].numel() if self.source.unit == "windows" else int(batch[0].shape[0])

    def eval_batches(self, part: int, parts: int) -> Iterator[Batch]:
        items = self._eval_items(part, parts)
        size = self.source.eval_batch_size
        chunk: list[Any] = []
        for item in items:
            chunk.append(item)
            if len(chunk) == size:
                yield self._collate(chunk)
                chunk = []
        if chunk:
            yield self._collate(chunk)

    def _eval_items(self, part: int, parts: int) -> Iterator[Any]:
        source = self.source
        held = source.eval
        offset = 0
        if held is None:  # the end of train
            held, offset = source.train, _length(source.train, "the dataset") - self.held
        if source.unit == "windows":
            n = (_length(held, "the held-out tokens") - offset - 1) // source.seq_len
            for k in range(part, n, parts):
                start = offset + k * source.seq_len
                yield _tokens(held[start : start + source.seq_len + 1])
        elif _is_map(held):
            for k in range(offset + part, _length(held, "the held-out set"), parts):
                yield held[k]
        else:
            for k, item in enumerate(held):
                if k % parts == part:
                    yield item


def _tokens(window: Any) -> torch.Tensor:
    if isinstance(window, torch.Tensor):
        return window.long()
    return torch.from_numpy(np.asarray(window).astype(np.int64))


def adapt(made: Any, cfg: RunConfig) -> ItemData:
    """What a data builder returned, if not SiteData: a DataSource, or a bare map-style dataset."""
    if isinstance(made, DataSource):
        return ItemData(made, cfg)
    if _is_map(made):
        return ItemData(DataSource(made), cfg)
    _refuse(
        f"workload.data: {cfg.workload.data} returned {type(made).__name__}: return SiteData "
        "(geodiloco.builders.SiteData), a map-style dataset (len and []), or a "
        "geodiloco.workload.datasets.DataSource (an iterable, a sampler, a token sequence)"
    )
