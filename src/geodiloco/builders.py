"""Users' own model, optimizer and data, named in the run config as ``package.module:function``.

The coordinator builds θ_0 with the model builder and sizes its data ledger with the data
builder; every site builds all three. What each builder takes and returns:

- model: ``(cfg) -> nn.Module``, the same parameters wherever it runs with the same
  ``cfg.seed`` (seed torch's generator inside), so θ_0 needs no download. ``model(*batch)``
  returns the mean loss of a batch from the data builder.
- optimizer: ``(model, cfg) -> torch.optim.Optimizer`` over the model's (possibly sharded)
  parameters; the sites keep its state across rounds.
- data: ``(cfg) -> SiteData``, the same items in the same order on every machine.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from geodiloco.config import ConfigError

if TYPE_CHECKING:
    from geodiloco.config import RunConfig
    from geodiloco.workload.data import DataRange

Batch = tuple[torch.Tensor, ...]


class BuilderError(ConfigError):
    """A configured builder that cannot be imported or gives the wrong thing; names the key."""


class SiteData(Protocol):
    """A dataset cut into ``cfg.data.shards`` shards of items, as the coordinator's ledger sees it.

    The ledger hands each site ranges of items per round: ``H x cfg.data.batch_size x`` its
    data-parallel ranks, so that each rank takes ``cfg.data.batch_size`` items per inner step.
    """

    @property
    def shard_sizes(self) -> list[int]:
        """Items per shard (every shard at least one); the ledger's units."""
        ...

    def batch(self, ranges: Sequence[DataRange], step: int, rank: int, world: int) -> Batch:
        """The batch of data-parallel ``rank`` of ``world`` at inner ``step`` of a round whose
        data is ``ranges`` (``OuterSync.data``); ``model(*batch)`` is its mean loss."""
        ...

    def tokens(self, batch: Batch) -> int:
        """How much a batch counts when the coordinator weights the sites' pseudo-gradients."""
        ...

    def eval_batches(self, part: int, parts: int) -> Iterable[Batch]:
        """Evaluator ``part`` of ``parts``'s share of a fixed held-out set (disjoint shares)."""
        ...


class ModelBuilder(Protocol):
    def __call__(self, cfg: RunConfig) -> nn.Module: ...


class OptimizerBuilder(Protocol):
    def __call__(self, model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer: ...


class DataBuilder(Protocol):
    def __call__(self, cfg: RunConfig) -> SiteData: ...


def load_builder(cfg: RunConfig, key: str) -> Any:
    """Import the function that ``workload.<key>`` names."""
    ref = getattr(cfg.workload, key)
    module_name, _, attr = ref.partition(":")
    field_name = f"workload.{key}"
    try:
        found: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise BuilderError(
            f"{field_name}: cannot import module {module_name!r} ({exc}); install it or put it on PYTHONPATH"
        ) from exc
    for part in attr.split("."):
        if not hasattr(found, part):
            raise BuilderError(f"{field_name}: module {module_name!r} has no attribute {attr!r}")
        found = getattr(found, part)
    if not callable(found):
        raise BuilderError(f"{field_name}: {ref} is not callable")
    return found


def build_model(cfg: RunConfig) -> nn.Module:
    model = load_builder(cfg, "model")(cfg)
    if not isinstance(model, nn.Module):
        raise BuilderError(
            f"workload.model: {cfg.workload.model} returned {type(model).__name__}, not an nn.Module"
        )
    if cfg.workload.init_weights:
        load_init_weights(model, cfg.workload.init_weights)
    return model


def load_init_weights(model: nn.Module, path: str) -> None:
    """Load a warm start's weights (a state dict, or a dict holding one under ``"model"``)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a missing, unreadable or foreign file: one clear message
        raise BuilderError(f"workload.init_weights: cannot load {path!r}: {exc}") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise BuilderError(f"workload.init_weights: {path!r} holds {type(state).__name__}, not a state dict")
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[:3]
        raise BuilderError(
            f"workload.init_weights: {path!r} does not fit the model: {' '.join(first)}"
        ) from None


def build_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    optimizer = load_builder(cfg, "optimizer")(model, cfg)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise BuilderError(
            f"workload.optimizer: {cfg.workload.optimizer} returned {type(optimizer).__name__}, "
            "not a torch.optim.Optimizer"
        )
    return optimizer


def build_data(cfg: RunConfig) -> SiteData:
    data = load_builder(cfg, "data")(cfg)
    missing = [name for name in ("shard_sizes", "batch", "tokens", "eval_batches") if not hasattr(data, name)]
    if missing:
        raise BuilderError(
            f"workload.data: {cfg.workload.data} returned {type(data).__name__}, "
            f"which lacks {', '.join(missing)} (see geodiloco.builders.SiteData)"
        )
    sizes = list(data.shard_sizes)
    if len(sizes) != cfg.data.shards or min(sizes) < 1:
        raise BuilderError(
            f"workload.data: {cfg.workload.data} gave {len(sizes)} shards (smallest {min(sizes, default=0)} "
            f"items); data.shards is {cfg.data.shards} and every shard needs at least one item"
        )
    return data
