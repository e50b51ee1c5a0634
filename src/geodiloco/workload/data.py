"""The reference corpus: the running interpreter's own standard-library sources, as bytes.

Present wherever Python is, so nothing is downloaded. Files are split into a training part
and a held-out evaluation part (whole files, so no text leaks across), the training bytes are
cut into many disjoint contiguous shards, and each shard is read as a seeded
permutation of fixed-length windows; the coordinator's data ledger says which windows each
site trains on in each round.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch


def stdlib_sources() -> list[Path]:
    """The interpreter's standard-library ``.py`` files, excluding installed packages."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file()]


def _text_files(paths: list[str]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            files.extend(q for q in p.rglob("*") if q.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"data.paths: {raw} does not exist")
    return files


def _stable_key(path: Path, root: Path | None) -> str:
    rel = str(path.relative_to(root)) if root and path.is_relative_to(root) else str(path)
    return hashlib.sha1(rel.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class DataRange:
    """Windows ``[start, end)`` of shard ``shard`` in pass ``epoch`` over that shard."""

    shard: int
    start: int
    end: int
    epoch: int = 0

    @property
    def windows(self) -> int:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Corpus:
    train: torch.Tensor  # uint8
    eval: torch.Tensor  # uint8


def load_corpus(paths: list[str], max_bytes: int, eval_fraction: float) -> Corpus:
    """Read files in a machine-independent order until ``max_bytes``; hold out every k-th file."""
    root = Path(sysconfig.get_paths()["stdlib"]) if not paths else None
    files = stdlib_sources() if not paths else _text_files(paths)
    files.sort(key=lambda p: _stable_key(p, root))
    every = max(2, round(1 / eval_fraction))
    train: list[bytes] = []
    held_out: list[bytes] = []
    total = 0
    for i, path in enumerate(files):
        data = path.read_bytes()
        (held_out if i % every == every - 1 else train).append(data)
        total += len(data)
        if total >= max_bytes and held_out:
            break
    if not train or not held_out:
        raise ValueError("data: too little text to split into training and evaluation parts")
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)  # noqa: E731
    return Corpus(train=as_tensor(train), eval=as_tensor(held_out))


class DataShards:
    """The training text cut into ``count`` contiguous shards of fixed-length windows.

    Each shard is read in its own seeded order; the data ledger hands out ranges of positions
    in that order, so "windows 40-80 of shard 3" names the same text on every machine.
    """

    def __init__(self, corpus: Corpus, *, count: int, seq_len: int, seed: int) -> None:
        n = corpus.train.numel()
        self.tokens = corpus.train
        self.seq_len = seq_len
        self.starts = [n * i // count for i in range(count)]
        self.sizes = [(n * (i + 1) // count - self.starts[i] - 1) // seq_len for i in range(count)]
        if min(self.sizes) < 1:
            raise ValueError(f"data: {count} shards leave some shard shorter than one sequence")
        self.orders = [
            torch.randperm(size, generator=torch.Generator().manual_seed(seed * 1_000_003 + i))
            for i, size in enumerate(self.sizes)
        ]

    def windows(self, ranges: Iterable[DataRange]) -> torch.Tensor:
        """The windows (seq_len + 1 bytes each) that ``ranges`` name, in order."""
        offsets = [
            self.starts[r.shard] + self.orders[r.shard][r.start : r.end] * self.seq_len for r in ranges
        ]
        starts = torch.cat(offsets) if offsets else torch.empty(0, dtype=torch.long)
        return self.tokens[starts[:, None] + torch.arange(self.seq_len + 1)].long()


def rank_batch(
    windows: torch.Tensor, step: int, rank: int, world: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for ``rank`` at ``step`` of a round whose windows are ``windows``."""
    first = (step * world + rank) * batch_size
    batch = windows[first : first + batch_size]
    return batch[:, :-1], batch[:, 1:]


def eval_windows(corpus: Corpus, count: int, seq_len: int) -> torch.Tensor:
    """A fixed set of evaluation windows spread evenly over the held-out text."""
    n = corpus.eval.numel() - seq_len - 1
    if n <= 0:
        raise ValueError("data: the evaluation split is shorter than one sequence")
    starts = torch.linspace(0, n, count).long()
    return corpus.eval[starts[:, None] + torch.arange(seq_len + 1)].long()


def eval_slice(windows: torch.Tensor, part: int, parts: int) -> torch.Tensor:
    """The share of evaluation windows for ``part`` of ``parts`` evaluators."""
    return windows[part::parts]
