"""Your own corpus through your own tokenizer: a BPE tokenizer trained here on the test's text
(no download), saved as transformers saves one, cuts the text into windows of token ids that
decode back to the text, shard by shard, with a cache that a changed file invalidates."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from geodiloco.builders import build_data, build_loss, check_site_step
from geodiloco.config import ConfigError, RunConfig, load_config
from geodiloco.coordinator.edge.server import data_shard_sizes
from geodiloco.workload.data import DataRange, load_corpus
from geodiloco.workload.steps import inner_step

WORDS = [
    "the",
    "a",
    "river",
    "stone",
    "light",
    "slow",
    "quick",
    "north",
    "wind",
    "carries",
    "over",
    "under",
    "their",
    "small",
    "old",
    "boats",
]
EOS = "<|endoftext|>"


def write_corpus(root: Path, files: int = 6) -> list[str]:
    rng = random.Random(0)
    texts = []
    root.mkdir()
    for i in range(files):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))) + "." for _ in range(60)]
        texts.append("\n".join(lines) + "\n")
        (root / f"part-{i}.txt").write_text(texts[-1])
    return texts


def train_tokenizer(corpus: Path, out: Path) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train([str(p) for p in sorted(corpus.iterdir())], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS)
    fast.save_pretrained(out)
    return fast


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[list[str], PreTrainedTokenizerFast]:
    texts = write_corpus(tmp_path / "text")
    return texts, train_tokenizer(tmp_path / "text", tmp_path / "tok")


def config(tmp: Path, *more: str) -> RunConfig:
    return load_config(
        None,
        [
            "workload.data=geodiloco.workload.tokenized:build_data",
            f'workload.options.text=["{tmp / "text"}"]',
            f'workload.options.tokenizer="{tmp / "tok"}"',
            f'workload.options.cache="{tmp / "cache"}"',
            "workload.options.seq_len=16",
            "data.shards=4",
            "data.batch_size=4",
            *more,
        ],
    )


def test_windows_of_token_ids_decode_back_to_the_text(
    tmp_path: Path, corpus: tuple[list[str], PreTrainedTokenizerFast]
) -> None:
    texts, tokenizer = corpus
    cfg = config(tmp_path)
    data = build_data(cfg)
    ids = data.source.train  # type: ignore[attr-defined]
    assert int((ids == tokenizer.eos_token_id).sum()) == len(texts)  # one end-of-text per file
    assert sum(data_shard_sizes(cfg)) == (len(ids) - data.held - 1) // 16  # type: ignore[attr-defined]
    files = load_corpus([str(tmp_path / "text")], 0, 0.05).text.files  # the stream's order
    whole = "".join(f.path.read_text() + EOS for f in files)
    x, y = data.batch([DataRange(2, 0, 8)], 1, 0, 1)  # the second step's four windows of shard 2
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])
    for row in torch.cat([x, y[:, -1:]], dim=1):
        assert tokenizer.decode(row.tolist()) in whole
    held = next(iter(data.eval_batches(0, 1)))[0]
    last = files[-1].path.read_text() + EOS
    assert tokenizer.decode(held[0].tolist()) in last  # held out: the end of the stream


def test_the_cache_is_reused_and_a_changed_file_invalidates_it(
    tmp_path: Path, corpus: tuple[list[str], PreTrainedTokenizerFast]
) -> None:
    cfg = config(tmp_path)
    first = build_data(cfg).source.train  # type: ignore[attr-defined]
    (cached,) = (tmp_path / "cache").glob("tokens-*.npy")
    again = build_data(cfg).source.train  # type: ignore[attr-defined]
    assert list((tmp_path / "cache").glob("tokens-*.npy")) == [cached] and (again == first).all()
    with (tmp_path / "text" / "part-0.txt").open("a") as f:
        f.write("north wind.\n")
    changed = build_data(cfg).source.train  # type: ignore[attr-defined]
    assert len(list((tmp_path / "cache").glob("tokens-*.npy"))) == 2 and len(changed) > len(first)
    uncached = build_data(config(tmp_path, 'workload.options.cache=""')).source.train  # type: ignore[attr-defined]
    assert (uncached == changed).all()


def test_a_llama_of_the_tokenizers_vocabulary_learns_from_the_windows(
    tmp_path: Path, corpus: tuple[list[str], PreTrainedTokenizerFast]
) -> None:
    _, tokenizer = corpus
    cfg = config(tmp_path)
    torch.manual_seed(0)
    shape = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **shape))
    data, loss_fn = build_data(cfg), build_loss(cfg)
    check_site_step(cfg, model, data, loss_fn)  # the site's dry step on the first batches
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ranges = [DataRange(0, 0, 40)]  # 10 steps of 4 windows, twice
    losses = [
        inner_step(model, optimizer, cfg.inner, s, *data.batch(ranges, s % 10, 0, 1), loss_fn=loss_fn)
        for s in range(20)
    ]
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize(
    ("more", "message"),
    [
        (
            'workload.options.tokenizer="/nonexistent/tok"',
            r"^workload.options.tokenizer: cannot load a tokenizer",
        ),
        ("workload.options.seq_len=4000", r"^workload.options.text: \d+ tokens in 6 file\(s\) are too few"),
        ("workload.options.text=3", r"^workload.options.text: expected a list of paths, got 3"),
        ("workload.options.eval_fraction=0.7", r"^workload.options.eval_fraction: must be in \(0, 0.5\)"),
    ],
)
def test_bad_options_are_one_line_errors_naming_them(
    tmp_path: Path, corpus: tuple[list[str], PreTrainedTokenizerFast], more: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        build_data(config(tmp_path, more))
