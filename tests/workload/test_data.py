from __future__ import annotations

from pathlib import Path

import torch

from geodiloco.workload import ShardReader, eval_slice, eval_windows, load_corpus


def test_stdlib_corpus_is_deterministic_and_split() -> None:
    a = load_corpus([], 300_000, 0.05)
    b = load_corpus([], 300_000, 0.05)
    assert torch.equal(a.train, b.train) and torch.equal(a.eval, b.eval)
    assert a.train.numel() > 200_000 and a.eval.numel() > 0
    # held-out text is whole files that do not appear in the training part
    probe = bytes(a.eval[:200].tolist())
    assert probe not in bytes(a.train.tolist())


def test_site_shards_are_disjoint_and_cover_the_training_text() -> None:
    corpus = load_corpus([], 200_000, 0.05)
    readers = [ShardReader(corpus, shard_index=i, shard_count=3, seq_len=16, seed=1) for i in range(3)]
    assert sum(r.tokens.numel() for r in readers) == corpus.train.numel()
    assert torch.equal(torch.cat([r.tokens for r in readers]), corpus.train)


def test_ranks_read_different_windows_and_targets_are_shifted() -> None:
    corpus = load_corpus([], 200_000, 0.05)
    reader = ShardReader(corpus, shard_index=0, shard_count=1, seq_len=16, seed=1)
    x0, y0 = reader.batch(0, 2, 4)
    reader.position = 0
    x1, _ = reader.batch(1, 2, 4)
    assert not torch.equal(x0, x1)
    assert torch.equal(x0[:, 1:], y0[:, :-1])
    assert reader.position == 8


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
