"""Users' own model, optimizer and data, named in the run config as ``package.module:function``.

The coordinator builds θ_0 with the model builder and sizes its data ledger with the data
builder; every site builds all three. What each builder takes and returns:

- model: ``(cfg) -> nn.Module``, the same parameters wherever it runs with the same
  ``cfg.seed`` (seed torch's generator inside), so θ_0 needs no download.
- optimizer: ``(model, cfg) -> torch.optim.Optimizer`` over the model's (possibly sharded)
  parameters; the sites keep its state across rounds.
- data: ``(cfg) -> SiteData``, the same items in the same order on every machine; a batch is
  ``(*inputs, targets)`` by convention.
- loss: ``(cfg) -> LossFn``, ``loss_fn(model, batch)`` the batch's mean loss
  (:mod:`geodiloco.workload.loss`: by default the model gives logits, scored by cross-entropy).

Mismatches between them are found before training by one dry step (:func:`check_workload` at
coordinator start, in a child process for large models; :func:`check_site_step` on each site)
and reported as a one-line config error naming the builder (:func:`exit_config_error` on a
site's ranks), never as a traceback.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar

import torch
from torch import nn

from geodiloco.config import ConfigError
from geodiloco.workload.data import DataRange
from geodiloco.workload.datasets import DataSource, ItemData, adapt
from geodiloco.workload.loss import Batch, LossFn, check_loss

if TYPE_CHECKING:
    from geodiloco.config import RunConfig

T = TypeVar("T")


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


_SITE_DATA = ("shard_sizes", "batch", "tokens", "eval_batches")


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
    """Load a warm start's weights, in the model's own names: a safetensors file or a directory
    of them (a ``save_pretrained`` directory), a ``torch.distributed.checkpoint`` directory, or a
    ``torch.save``'d state dict (or a dict holding one under ``"model"``). A tied weight that the
    file holds once (an output layer sharing the embedding) counts as loaded."""
    state = _read_weights(model, path)
    own = model.state_dict()
    loaded = {own[k].data_ptr() for k in state if k in own}
    missing = [k for k in own if k not in state and own[k].data_ptr() not in loaded]
    unexpected = [k for k in state if k not in own]
    if missing or unexpected:
        raise BuilderError(
            f"workload.init_weights: {path!r} does not fit the model: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[:3]
        raise BuilderError(
            f"workload.init_weights: {path!r} does not fit the model: {' '.join(first)}"
        ) from None


def _read_weights(model: nn.Module, path: str) -> dict[str, torch.Tensor]:
    where = Path(path)
    try:
        if where.is_dir() and (where / ".metadata").is_file():  # a DCP checkpoint
            import torch.distributed.checkpoint as dcp

            state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            with warnings.catch_warnings():  # read in one process, without a process group
                warnings.filterwarnings("ignore", message="torch.distributed is disabled")
                dcp.load(state, checkpoint_id=str(where))
            return state
        files = sorted(where.glob("*.safetensors")) if where.is_dir() else [where]
        if where.is_dir() and not files:
            raise BuilderError(f"workload.init_weights: {path!r} holds no *.safetensors and no DCP .metadata")
        if files[0].suffix == ".safetensors":
            from safetensors.torch import load_file

            return {k: v for f in files for k, v in load_file(str(f)).items()}
        state = torch.load(path, map_location="cpu", weights_only=True)
    except BuilderError:
        raise
    except ImportError:
        raise BuilderError(
            f"workload.init_weights: {path!r} is safetensors: pip install 'geodiloco[hf]'"
        ) from None
    except Exception as exc:  # a missing, unreadable or foreign file: one clear message
        first = " ".join(str(exc).split())[:300]
        raise BuilderError(f"workload.init_weights: cannot load {path!r}: {first}") from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        raise BuilderError(f"workload.init_weights: {path!r} holds {type(state).__name__}, not a state dict")
    return state


def build_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    optimizer = load_builder(cfg, "optimizer")(model, cfg)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise BuilderError(
            f"workload.optimizer: {cfg.workload.optimizer} returned {type(optimizer).__name__}, "
            "not a torch.optim.Optimizer"
        )
    return optimizer


def build_data(cfg: RunConfig) -> SiteData:
    """The data builder's result as :class:`SiteData`: its own, or a dataset adapted to the ledger
    (:mod:`geodiloco.workload.datasets`). Sizing it reads no item."""
    made = load_builder(cfg, "data")(cfg)
    data: SiteData
    if all(hasattr(made, name) for name in _SITE_DATA):
        data = made
    elif isinstance(made, DataSource) or (hasattr(made, "__len__") and hasattr(made, "__getitem__")):
        data = adapt(made, cfg)
    else:
        missing = [name for name in _SITE_DATA if not hasattr(made, name)]
        raise BuilderError(
            f"workload.data: {cfg.workload.data} returned {type(made).__name__}, which is neither a "
            f"map-style dataset (len and []), a geodiloco.workload.datasets.DataSource, nor SiteData "
            f"(it lacks {', '.join(missing)}; see geodiloco.builders.SiteData)"
        )
    sizes = list(data.shard_sizes)
    if len(sizes) != cfg.data.shards or min(sizes) < 1:
        raise BuilderError(
            f"workload.data: {cfg.workload.data} gave {len(sizes)} shards (smallest {min(sizes, default=0)} "
            f"items); data.shards is {cfg.data.shards} and every shard needs at least one item"
        )
    return data


def build_loss(cfg: RunConfig) -> LossFn:
    loss_fn = load_builder(cfg, "loss")(cfg)
    if not callable(loss_fn):
        raise BuilderError(
            f"workload.loss: {cfg.workload.loss} returned {type(loss_fn).__name__}, "
            "not a function (model, batch) -> loss"
        )
    return loss_fn


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__


# what to try when a shipped loss cannot call the model (a signature mismatch)
_HINTS = {
    "geodiloco.workload.loss:build_cross_entropy": " (it calls model(*inputs) for logits; if your model "
    "returns its own loss from model(*batch), set workload.loss = geodiloco.workload.loss:build_model_loss)",
    "geodiloco.workload.loss:build_model_loss": " (it calls model(*batch) for a loss; if your model gives "
    "logits from model(*inputs), drop workload.loss for the default cross-entropy)",
}


@contextmanager
def _blame(key: str, what: str, hint: str = "") -> Iterator[None]:
    """Turn any failure inside into a one-line :class:`BuilderError` naming ``workload.<key>``;
    ``hint`` is added to a signature mismatch (TypeError)."""
    try:
        yield
    except ConfigError:  # already one line naming its field
        raise
    except Exception as exc:
        extra = hint if isinstance(exc, TypeError) else ""
        raise BuilderError(
            f"workload.{key}: {what} failed in the dry step: {_one_line(exc)}{extra}"
        ) from None


def _call(key: str, what: str, fn: Callable[[], T]) -> T:
    with _blame(key, what):
        return fn()


def first_batch(cfg: RunConfig, data: SiteData) -> Batch:
    """The batch a one-rank site would take at its first step on shard 0."""
    end = min(data.shard_sizes[0], cfg.data.batch_size)
    batch = _call("data", "batch()", lambda: data.batch([DataRange(0, 0, end)], 0, 0, 1))
    return _tensors(cfg, batch)


def _tensors(cfg: RunConfig, batch: Any) -> Batch:
    if not isinstance(batch, tuple) or not all(isinstance(t, torch.Tensor) for t in batch):
        raise BuilderError(
            f"workload.data: {cfg.workload.data} gave a batch of {type(batch).__name__}, "
            "not a tuple of tensors (*inputs, targets)"
        )
    return batch


def _check_tokens(cfg: RunConfig, data: SiteData, batch: Batch) -> None:
    tokens = _call("data", "tokens()", lambda: data.tokens(batch))
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
        raise BuilderError(
            f"workload.data: {cfg.workload.data}'s tokens(batch) gave {tokens!r}, not a positive int"
        )


def _loss_on(cfg: RunConfig, loss_fn: LossFn, model: nn.Module, batch: Batch) -> torch.Tensor:
    what = (
        f"{cfg.workload.model}'s model with workload.loss {cfg.workload.loss} on a batch of "
        f"{len(batch)} tensor(s) {[tuple(t.shape) for t in batch]} from workload.data"
    )
    hint = _HINTS.get(cfg.workload.loss, "")
    with _blame("model", what, hint):
        return check_loss(loss_fn(model, batch))


def check_workload(cfg: RunConfig) -> None:
    """The coordinator's dry step, before it serves: build every builder's result and take one
    inner step (forward, loss, backward, optimizer step) on a throwaway model, then score one
    held-out batch in eval mode. Raises :class:`BuilderError` (one line) on any mismatch.

    For a dataset adapted to the ledger (:class:`ItemData`) it stops after the builders and the
    shard sizes: the coordinator never reads items, and each site's :func:`check_site_step`
    takes the dry step on its first batches before training."""
    model = build_model(cfg)
    data = build_data(cfg)
    loss_fn = build_loss(cfg)
    optimizer = build_optimizer(model, cfg)
    if isinstance(data, ItemData):  # a dataset: the coordinator reads no item (the sites' dry step does)
        return
    batch = first_batch(cfg, data)
    model.train()
    loss = _loss_on(cfg, loss_fn, model, batch)
    if not loss.requires_grad:
        raise BuilderError(
            f"workload.loss: {cfg.workload.loss} gave a loss that does not depend on the model's "
            f"parameters (no grad) for {cfg.workload.model}"
        )
    with _blame("model", "backward()"):
        loss.backward()
    with _blame("optimizer", f"{cfg.workload.optimizer}'s step()"):
        optimizer.step()
    _check_tokens(cfg, data, batch)
    check_site_step(cfg, model, data, loss_fn)


# From this size on the coordinator's dry step runs in a child process: its throwaway model,
# gradient and optimizer state (five or more times the model's bytes) would otherwise set the
# serving process's peak memory (at 10M parameters 0.61 GB in-process, against a serving peak
# under 0.5 GB). Smaller models (tests, the demo) skip the child's start-up (2 to 3 s).
DRY_STEP_APART_PARAMS = 4_000_000

_DRY_STEP_CHILD = "import sys; from geodiloco.builders import _dry_step_child; sys.exit(_dry_step_child())"


def check_workload_sized(cfg: RunConfig, num_params: int) -> None:
    """:func:`check_workload` for a model of ``num_params`` parameters: in this process when it
    is small, else in a fresh Python process (never a fork: a forked child of a process that
    has run torch's thread pool can hang). Its config error comes back as the same one line."""
    if num_params < DRY_STEP_APART_PARAMS:
        check_workload(cfg)
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    child = subprocess.run(
        [sys.executable, "-c", _DRY_STEP_CHILD],
        input=cfg.to_json(),
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if child.returncode == 2:
        raise BuilderError(child.stderr.strip().splitlines()[-1])
    if child.returncode != 0:
        last = (child.stderr.strip().splitlines() or [f"exit status {child.returncode}"])[-1]
        raise BuilderError(f"workload: the coordinator's dry step failed: {last}")
    sys.stderr.write(child.stderr)  # the builders' warnings, as an in-process dry step shows them


def _dry_step_child() -> int:
    """The child of :func:`check_workload_sized`: the run config on stdin; exit status 2 with
    the config error as the last line of stderr."""
    from geodiloco.config import RunConfig

    try:
        check_workload(RunConfig.from_json(sys.stdin.read()))
    except ConfigError as exc:
        print(str(exc).replace("\n", " "), file=sys.stderr)
        return 2
    return 0


def check_site_step(
    cfg: RunConfig, model: nn.Module, data: SiteData, loss_fn: LossFn, device: torch.device | None = None
) -> None:
    """A site's dry step before its first inner step: score the first held-out batch with the
    site's own (wrapped) model in eval mode, without gradients, so nothing changes. Every rank
    of a site calls it (the model may be sharded); raises :class:`BuilderError` (one line).
    Data the coordinator did not read (a dataset, :class:`ItemData`) also gives its first
    training batch here, checked for its form and its token count."""
    if isinstance(data, ItemData):
        _check_tokens(cfg, data, first_batch(cfg, data))
    batches = _call("data", "eval_batches()", lambda: iter(data.eval_batches(0, 1)))
    found = _call("data", "eval_batches()", lambda: next(batches, None))
    if found is None:
        raise BuilderError(f"workload.data: {cfg.workload.data}'s eval_batches(0, 1) is empty")
    batch = _tensors(cfg, found)
    if device is not None:  # the batch goes where the model's parameters live
        batch = tuple(t.to(device) for t in batch)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            _loss_on(cfg, loss_fn, model, batch)
    finally:
        model.train(was_training)


def exit_config_error(exc: ConfigError) -> NoReturn:
    """Leave a rank with one line for a config error (status 2), where people look for it and
    where torchrun shows a failed rank's cause, instead of a traceback."""
    line = f"invalid config: {exc}"
    print(f"geodiloco site: {line}", file=sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun prints this as the failed rank's cause, instead of "<N/A>"
        entry = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
        with open(error_file, "w") as f:
            json.dump({"message": entry}, f)
    raise SystemExit(2)
