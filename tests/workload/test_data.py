from __future__ import annotations

from pathlib import Path

import torch

from geodiloco.workload import DataRange, DataShards, eval_slice, eval_windows, load_corpus, rank_batch


def test_stdlib_corpus_is_deterministic_and_split() -> None:
    a = load_corpus([], 300_000, 0.05)
    b = load_corpus([], 300_000, 0.05)
    assert torch.equal(a.train, b.train) and torch.equal(a.eval, b.eval)
    assert a.train.numel() > 200_000 and a.eval.numel() > 0
    # held-out text is whole files that do not appear in the training part
    probe = bytes(a.eval[:200].tolist())
    assert probe not in bytes(a.train.tolist())


def test_data_shards_tile_the_training_text_and_name_the_same_windows_everywhere() -> None:
    corpus = load_corpus([], 200_000, 0.05)
    a = DataShards(corpus, count=6, seq_len=16, seed=1)
    b = DataShards(corpus, count=6, seq_len=16, seed=1)
    assert len(a.sizes) == 6 and sum(a.sizes) * 16 <= corpus.train.numel()
    ranges = [DataRange(2, 5, 9), DataRange(4, 0, 3)]
    assert torch.equal(a.windows(ranges), b.windows(ranges))
    w = a.windows(ranges)
    assert w.shape == (7, 17)
    # every window of a shard comes from inside that shard's bytes
    lo, hi = a.starts[2], a.starts[3]
    whole = bytes(corpus.train[lo:hi].tolist())
    assert all(bytes(row.tolist()) in whole for row in w[:4])
    assert sorted(a.orders[0].tolist()) == list(range(a.sizes[0]))  # each window once per pass


def test_ranks_read_different_batches_and_targets_are_shifted() -> None:
    corpus = load_corpus([], 200_000, 0.05)
    windows = DataShards(corpus, count=2, seq_len=16, seed=1).windows([DataRange(0, 0, 16)])
    x0, y0 = rank_batch(windows, 0, 0, 2, 4)
    x1, _ = rank_batch(windows, 0, 1, 2, 4)
    x2, _ = rank_batch(windows, 1, 0, 2, 4)
    assert not torch.equal(x0, x1) and not torch.equal(x0, x2)
    assert torch.equal(x0[:, 1:], y0[:, :-1])
    assert torch.equal(torch.cat([x0, x1, x2]), windows[:12, :-1])


def test_user_text_files(tmp_path: Path) -> None:
    for i in range(10):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i} " * 200)
    corpus = load_corpus([str(tmp_path)], 1_000_000, 0.1)
    assert corpus.eval.numel() > 0 and corpus.train.numel() > corpus.eval.numel()


def test_eval_slices_partition_the_eval_windows() -> None:
    corpus = load_corpus([], 200_000, 0.05)
    windows = eval_windows(corpus, 30, 16)
    parts = [eval_slice(windows, p, 4) for p in range(4)]
    assert sum(p.shape[0] for p in parts) == 30
