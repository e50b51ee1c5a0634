"""Your own text corpus through your own Hugging Face tokenizer, cut into windows like the byte data.

    [workload]
    data = "geodiloco.workload.tokenized:build_data"
    [workload.options]
    text = ["/data/my-corpus"]           # files and folders, read as the byte data reads them
    tokenizer = "/models/my-tokenizer"   # a save_pretrained directory, or a tokenizer.json file
    seq_len = 256                        # tokens in a model input (a window is seq_len + 1)
    cache = "/var/cache/geodiloco"       # optional: keep the token ids, keyed by text and tokenizer

The files are taken in the byte data's machine-independent order (binary files skipped), each
tokenised on its own and followed by the tokenizer's end-of-text token when it has one; the
token ids form one sequence whose last ``eval_fraction`` (default 0.05) is held out. The ledger's
items are windows (:mod:`geodiloco.workload.datasets`). Counting windows needs the token count,
so the coordinator tokenises the corpus too: with ``cache`` set, each machine does so once.
"""

from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from geodiloco.config import ConfigError
from geodiloco.workload.data import TextFile, load_corpus
from geodiloco.workload.datasets import DataSource

if TYPE_CHECKING:
    from geodiloco.config import RunConfig


def _option(cfg: RunConfig, name: str, kind: type, default: Any = None) -> Any:
    value = cfg.workload.options.get(name, default)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if value is None or isinstance(value, bool) or not isinstance(value, kind):
        want = {list: "a list of paths", str: "a path", int: "an integer", float: "a number"}[kind]
        raise ConfigError(f"workload.options.{name}: expected {want}, got {value!r}")
    return value


def load_tokenizer(where: str) -> Any:
    """A fast tokenizer from a ``save_pretrained`` directory or a ``tokenizer.json`` file."""
    try:
        from transformers import AutoTokenizer, PreTrainedTokenizerFast
    except ImportError:
        raise ConfigError(
            "workload.options.tokenizer: needs transformers: pip install 'geodiloco[hf]'"
        ) from None
    try:
        if Path(where).is_file():
            return PreTrainedTokenizerFast(tokenizer_file=where)
        return AutoTokenizer.from_pretrained(where)
    except (OSError, ValueError) as exc:
        first = " ".join(str(exc).split())[:300]
        raise ConfigError(
            f"workload.options.tokenizer: cannot load a tokenizer from {where!r}: {first}"
        ) from None


def tokenize(files: list[TextFile], tokenizer: Any) -> np.ndarray:
    """Each file's ids, then end-of-text (if the tokenizer has one), as one sequence."""
    eos = tokenizer.eos_token_id
    parts: list[list[int]] = []
    for f in files:
        with open(f.path, "rb") as handle:
            text = handle.read(f.size).decode("utf-8", errors="replace")
        parts.append(
            tokenizer(text, add_special_tokens=False)["input_ids"] + ([eos] if eos is not None else [])
        )
    dtype = np.uint16 if len(tokenizer) <= 1 << 16 else np.uint32
    return np.fromiter((t for p in parts for t in p), dtype=dtype)


def _cache_key(files: list[TextFile], tokenizer: Any) -> str:
    key = hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode())
    for f in files:
        stat = f.path.stat()
        key.update(f"{f.path.resolve()}\0{f.size}\0{stat.st_mtime_ns}\0".encode())
    return key.hexdigest()[:32]


def token_ids(files: list[TextFile], tokenizer: Any, cache: str) -> np.ndarray:
    """The corpus's token ids; read from (or written once to) ``cache`` when it is set."""
    if not cache:
        return tokenize(files, tokenizer)
    path = Path(cache) / f"tokens-{_cache_key(files, tokenizer)}.npy"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.partial")
        with open(partial, "wb") as out:
            np.save(out, tokenize(files, tokenizer))
        os.replace(partial, path)  # whole or absent: a reader never sees half a file
    ids: np.ndarray = np.load(path, mmap_mode="r")
    return ids


def build_data(cfg: RunConfig) -> DataSource:
    """``workload.data``: the corpus in ``workload.options`` as windows of its token ids."""
    text = _option(cfg, "text", list)
    seq_len = _option(cfg, "seq_len", int, 128)
    eval_fraction = float(_option(cfg, "eval_fraction", float, 0.05))
    if seq_len < 1:
        raise ConfigError(f"workload.options.seq_len: must be >= 1, got {seq_len}")
    if not 0.0 < eval_fraction < 0.5:
        raise ConfigError(f"workload.options.eval_fraction: must be in (0, 0.5), got {eval_fraction}")
    corpus = load_corpus([str(p) for p in text], _option(cfg, "max_bytes", int, 0), eval_fraction)
    tokenizer = load_tokenizer(_option(cfg, "tokenizer", str))
    ids = token_ids(corpus.text.files, tokenizer, _option(cfg, "cache", str, ""))
    held = math.ceil(len(ids) * eval_fraction)
    if (len(ids) - held - 1) // seq_len < cfg.data.shards or (held - 1) // seq_len < 1:
        raise ConfigError(
            f"workload.options.text: {len(ids)} tokens in {corpus.files} file(s) are too few for "
            f"{cfg.data.shards} shards of at least one window of {seq_len + 1} tokens and one held-out "
            f"window in the last {eval_fraction:g} (data.shards, workload.options.seq_len, eval_fraction)"
        )
    return DataSource(ids, unit="windows", seq_len=seq_len, eval_fraction=eval_fraction)
