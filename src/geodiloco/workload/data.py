"""The reference corpus: the running interpreter's own standard-library sources, as bytes.

Present wherever Python is, so nothing is downloaded. Files are split into a training part
and a held-out evaluation part (whole files, so no text leaks across), the training bytes are
cut into disjoint contiguous shards, one per site, and each shard is read as a seeded
permutation of fixed-length windows.
"""

from __future__ import annotations

import hashlib
import sysconfig
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


class ShardReader:
    """Batches for one rank from one site's shard: a seeded permutation of windows.

    The reader's position is a count of windows consumed, so it can be saved and resumed.
    """

    def __init__(
        self,
        corpus: Corpus,
        *,
        shard_index: int,
        shard_count: int,
        seq_len: int,
        seed: int,
    ) -> None:
        n = corpus.train.numel()
        lo, hi = n * shard_index // shard_count, n * (shard_index + 1) // shard_count
        self.tokens = corpus.train[lo:hi]
        self.seq_len = seq_len
        n_windows = (self.tokens.numel() - 1) // seq_len
        if n_windows < 1:
            raise ValueError(f"data: shard {shard_index} is too small for seq_len {seq_len}")
        gen = torch.Generator().manual_seed(seed * 1_000_003 + shard_index)
        self.order = torch.randperm(n_windows, generator=gen)
        self.position = 0

    def batch(self, rank: int, world: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next batch for ``rank`` of ``world`` ranks; all ranks advance together."""
        base = self.position + rank * batch_size
        idx = self.order[torch.arange(base, base + batch_size) % self.order.numel()]
        self.position += world * batch_size
        offsets = idx[:, None] * self.seq_len + torch.arange(self.seq_len + 1)
        window = self.tokens[offsets].long()
        return window[:, :-1], window[:, 1:]


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
