"""The reference workload (a byte-level GPT on the standard library's sources) and the adapter
that brings users' datasets to the data ledger (:class:`DataSource`)."""

from geodiloco.workload.data import (
    Corpus,
    DataRange,
    DataShards,
    eval_slice,
    eval_windows,
    load_corpus,
    rank_batch,
)
from geodiloco.workload.datasets import DataSource
from geodiloco.workload.model import ByteGPT, GPTConfig, build_model
from geodiloco.workload.steps import evaluate, inner_step, make_inner_optimizer

__all__ = [
    "ByteGPT",
    "Corpus",
    "DataRange",
    "DataShards",
    "DataSource",
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
