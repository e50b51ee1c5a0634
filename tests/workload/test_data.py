from __future__ import annotations

import gzip
import logging
import os
import random
import re
from pathlib import Path

import pytest
import torch

from geodiloco.builders import build_data
from geodiloco.config import ConfigError, DataConfig, RunConfig
from geodiloco.workload import DataRange, DataShards, eval_slice, eval_windows, load_corpus, rank_batch
from geodiloco.workload.data import require_text


def prose(n: int, seed: int) -> str:
    """``n`` bytes of word-like text that does not repeat (so a probe finds one place)."""
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
        for _ in range(4000)
    ]
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(words) + rng.choice("  \n.")
        out.append(w)
        size += len(w)
    return "".join(out)[:n]


def stream_bytes(corpus: object) -> bytes:
    """The whole stream, read the plain way: the files in the corpus's order, cut to their sizes."""
    return b"".join(f.path.read_bytes()[: f.size] for f in corpus.text.files)  # type: ignore[attr-defined]


def user_config(paths: list[Path], **data: object) -> RunConfig:
    return RunConfig.from_dict({"data": {"paths": [str(p) for p in paths], **data}})


def test_stdlib_corpus_is_deterministic_and_split_by_one_cut() -> None:
    a = load_corpus([], 300_000, 0.05)
    b = load_corpus([], 300_000, 0.05)
    assert [f.path for f in a.text.files] == [f.path for f in b.text.files]
    assert a.text.size == 300_000 and a.capped_at == 300_000  # the cap cuts the last file
    assert a.eval_bytes == 15_000 and a.train_bytes == 285_000
    whole = stream_bytes(a)
    assert len(whole) == 300_000
    held_out = whole[a.train_bytes :]
    assert all(held_out[i : i + 200] not in whole[: a.train_bytes] for i in (0, 7000, 14_000))


def test_windows_are_the_streams_bytes_across_file_boundaries(tmp_path: Path) -> None:
    for i, n in enumerate([5, 700, 3, 1200, 64]):
        (tmp_path / f"f{i}.txt").write_text(prose(n, i))
    corpus = load_corpus([str(tmp_path)], 0, 0.1)
    whole = stream_bytes(corpus)
    assert corpus.files == 5 and len(whole) == corpus.text.size == 1972
    starts = [0, 1900, 3, 700, 4, 1100, 0]  # unsorted, repeated, spanning files
    got = corpus.text.windows(starts, 72)
    assert [bytes(row.tolist()) for row in got] == [whole[s : s + 72] for s in starts]


def test_data_shards_tile_the_training_text_and_name_the_same_windows_everywhere() -> None:
    corpus = load_corpus([], 200_000, 0.05)
    a = DataShards(corpus, count=6, seq_len=16, seed=1)
    b = DataShards(corpus, count=6, seq_len=16, seed=1)
    assert len(a.sizes) == 6 and sum(a.sizes) * 16 <= corpus.train_bytes
    ranges = [DataRange(2, 5, 9), DataRange(4, 0, 3)]
    assert torch.equal(a.windows(ranges), b.windows(ranges))
    w = a.windows(ranges)
    assert w.shape == (7, 17)
    # every window of a shard comes from inside that shard's bytes
    whole = stream_bytes(corpus)[a.starts[2] : a.starts[3]]
    assert all(bytes(row.tolist()) in whole for row in w[:4])
    assert sorted(a.order(0).tolist()) == list(range(a.sizes[0]))  # each window once per pass


def test_shard_sizes_draw_no_order_and_read_no_text(tmp_path: Path) -> None:
    (tmp_path / "corpus.txt").write_text(prose(300_000, 3))
    data = build_data(user_config([tmp_path / "corpus.txt"]))  # what the coordinator does
    assert data.shard_sizes == [(300_000 - 15_000) // 24 // 64] * 24  # 64: model.seq_len
    assert data.shards._orders == {}  # type: ignore[attr-defined]
    data.batch([DataRange(3, 0, 16)], 0, 0, 2)
    assert list(data.shards._orders) == [3]  # type: ignore[attr-defined]


def test_ranks_read_different_batches_and_targets_are_shifted() -> None:
    corpus = load_corpus([], 200_000, 0.05)
    windows = DataShards(corpus, count=2, seq_len=16, seed=1).windows([DataRange(0, 0, 16)])
    x0, y0 = rank_batch(windows, 0, 0, 2, 4)
    x1, _ = rank_batch(windows, 0, 1, 2, 4)
    x2, _ = rank_batch(windows, 1, 0, 2, 4)
    assert not torch.equal(x0, x1) and not torch.equal(x0, x2)
    assert torch.equal(x0[:, 1:], y0[:, :-1])
    assert torch.equal(torch.cat([x0, x1, x2]), windows[:12, :-1])


def test_one_file_trains_and_holds_out_its_end(tmp_path: Path) -> None:
    text = prose(900_000, 1).encode()
    (tmp_path / "corpus.txt").write_bytes(text)
    cfg = user_config([tmp_path / "corpus.txt"])
    data = build_data(cfg)
    assert len(data.shard_sizes) == 24 and min(data.shard_sizes) > 500
    cut = 900_000 - 45_000
    evals = [bytes(row.tolist()) for row in data.eval]  # type: ignore[attr-defined]
    assert len(evals) == 192 and all(w in text[cut:] for w in evals)
    x, _ = data.batch([DataRange(23, 0, 16)], 0, 0, 1)
    assert all(bytes(row.tolist()) in text[:cut] for row in x)


def test_two_files_of_very_different_sizes(tmp_path: Path) -> None:
    big, small = tmp_path / "big.txt", tmp_path / "small.txt"
    big.write_text(prose(2_000_000, 4))
    small.write_text(prose(300, 5))
    corpus = load_corpus([str(big), str(small)], 0, 0.05)
    assert corpus.files == 2 and corpus.text.size == 2_000_300 and corpus.eval_bytes == 100_015
    assert small.read_bytes() in stream_bytes(corpus)  # whole, wherever its hash puts it
    data = build_data(user_config([big, small]))
    train = 2_000_300 - 100_015
    assert train // 64 - 2 * 24 <= sum(data.shard_sizes) <= train // 64  # a shard wastes < 1 window
    # the order does not depend on the order in data.paths or on where the files are
    again = load_corpus([str(small), str(big)], 0, 0.05)
    assert [f.path.name for f in again.text.files] == [f.path.name for f in corpus.text.files]


def test_fifteen_small_files(tmp_path: Path) -> None:
    for i in range(15):
        (tmp_path / f"LICENSE-{i}").write_text(prose(17_600, 10 + i))
    (tmp_path / ".git").mkdir()
    (tmp_path / ".git" / "HEAD").write_text("ref: refs/heads/main\n")  # hidden: not read
    cfg = user_config([tmp_path])
    data = build_data(cfg)
    corpus = load_corpus(cfg.data.paths, cfg.data.max_bytes, cfg.data.eval_fraction)
    assert corpus.files == 15 and corpus.text.size == 264_000
    assert min(data.shard_sizes) > 150 and data.eval.shape == (192, 65)  # type: ignore[attr-defined]


def test_max_bytes_zero_is_all_and_a_cap_cuts(tmp_path: Path) -> None:
    for i in range(3):
        (tmp_path / f"{i}.txt").write_text(prose(10_000, i))
    assert load_corpus([str(tmp_path)], 0, 0.05).text.size == 30_000
    capped = load_corpus([str(tmp_path)], 25_000, 0.05)
    assert capped.text.size == 25_000 and capped.capped_at == 25_000
    assert DataConfig(max_bytes=0).max_bytes == 0
    with pytest.raises(ConfigError, match=r"data.max_bytes: must be >= 0"):
        DataConfig(max_bytes=-1)


def test_too_little_text_is_refused_with_the_numbers_and_the_fields(tmp_path: Path) -> None:
    f = tmp_path / "short.txt"
    f.write_text(prose(1200, 6))
    with pytest.raises(ConfigError) as info:
        build_data(user_config([f]))
    message = str(info.value)
    assert message.startswith(
        "data: 1200 bytes of text in 1 file; need at least 5101 bytes for 24 shards of 1 window plus "
        "192 evaluation windows (data.shards, data.eval_sequences, model.seq_len)"
    ), message
    assert "65 bytes" in message and "5% of the text is held out (data.eval_fraction)" in message
    # the least it asks for is enough, and one byte less is not
    need = int(re.search(r"need at least (\d+) bytes", message).group(1))  # type: ignore[union-attr]
    for n, ok in ((need, True), (need - 1, False)):
        f.write_text(prose(n, 6))
        corpus = load_corpus([str(f)], 0, 0.05)
        if ok:
            require_text(corpus, shards=24, seq_len=64, eval_sequences=192)
            DataShards(corpus, count=24, seq_len=64, seed=1)
            assert torch.unique(eval_windows(corpus, 192, 64), dim=0).shape[0] == 192
        else:
            with pytest.raises(ConfigError, match="need at least"):
                require_text(corpus, shards=24, seq_len=64, eval_sequences=192)
    f.write_text(prose(20_000, 6))
    with pytest.raises(
        ConfigError, match=r"data: 3000 bytes of text in 1 file; .*data.max_bytes=3000 cut it"
    ):
        build_data(user_config([f], max_bytes=3000))
    # the API's own refusals, for callers that skip require_text
    corpus = load_corpus([str(f)], 0, 0.05)
    shard_refusal = r"data: 19000 training bytes cut into 400 shards leave a shard shorter than one window"
    with pytest.raises(ConfigError, match=shard_refusal):
        DataShards(corpus, count=400, seq_len=64, seed=1)
    eval_refusal = r"held-out part \(1000 bytes, data.eval_fraction\) is shorter than one window of 1001"
    with pytest.raises(ConfigError, match=eval_refusal):
        eval_windows(corpus, 8, 1000)


def test_paths_that_cannot_be_read_are_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data.paths: .*nowhere.txt does not exist"):
        load_corpus([str(tmp_path / "nowhere.txt")], 0, 0.05)
    packed = tmp_path / "corpus.txt.gz"
    packed.write_bytes(gzip.compress(prose(5000, 7).encode()))
    with pytest.raises(
        ConfigError, match=r"data.paths: .*corpus.txt.gz is gzip-compressed, which is not supported"
    ):
        load_corpus([str(tmp_path)], 0, 0.05)
    packed.unlink()
    if os.geteuid() == 0:  # root reads any file: take one that fails to read instead
        unreadable = Path("/proc/self/mem")
    else:
        unreadable = tmp_path / "secret.txt"
        unreadable.write_text("no")
        unreadable.chmod(0)
    with pytest.raises(ConfigError, match=rf"data.paths: cannot read {re.escape(str(unreadable))}: "):
        load_corpus([str(unreadable)], 0, 0.05)


def test_binary_files_are_skipped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "notes.txt").write_text(prose(8000, 8))
    (tmp_path / "model.bin").write_bytes(bytes(range(256)) * 10)
    (tmp_path / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR")
    with caplog.at_level(logging.WARNING, logger="geodiloco.workload.data"):
        corpus = load_corpus([str(tmp_path)], 0, 0.05)
    assert corpus.files == 1 and corpus.skipped_binary == 2 and corpus.text.size == 8000
    assert "skipped 2 binary file(s)" in caplog.text
    (tmp_path / "notes.txt").unlink()
    with pytest.raises(ConfigError, match=r"data.paths: no text in .* \(2 binary file\(s\) skipped\)"):
        load_corpus([str(tmp_path)], 0, 0.05)


def test_a_file_that_shrinks_or_goes_under_a_run_is_named(tmp_path: Path) -> None:
    f = tmp_path / "corpus.txt"
    f.write_text(prose(50_000, 9))
    corpus = load_corpus([str(f)], 0, 0.05)
    f.write_text(prose(100, 9))
    with pytest.raises(ConfigError, match=r"data.paths: .*corpus.txt changed while the run was reading it"):
        corpus.text.windows([40_000], 65)
    f.unlink()
    with pytest.raises(ConfigError, match=r"data.paths: cannot read .*corpus.txt any more: No such file"):
        corpus.text.windows([10], 65)


def test_eval_slices_partition_the_eval_windows() -> None:
    corpus = load_corpus([], 200_000, 0.05)
    windows = eval_windows(corpus, 30, 16)
    parts = [eval_slice(windows, p, 4) for p in range(4)]
    assert sum(p.shape[0] for p in parts) == 30
