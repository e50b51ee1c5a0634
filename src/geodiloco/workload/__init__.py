"""The reference workload: a byte-level GPT on the standard library's sources."""

from geodiloco.workload.data import (
    Corpus,
    DataRange,
    DataShards,
    eval_slice,
    eval_windows,
    load_corpus,
    rank_batch,
)
from geodiloco.workload.model import ByteGPT, GPTConfig, build_model
from geodiloco.workload.steps import evaluate, inner_step, make_inner_optimizer

__all__ = [
    "ByteGPT",
    "Corpus",
    "DataRange",
    "DataShards",
    "GPTConfig",
    "build_model",
    "eval_slice",
    "eval_windows",
    "evaluate",
    "inner_step",
    "load_corpus",
    "make_inner_optimizer",
    "rank_batch",
]
