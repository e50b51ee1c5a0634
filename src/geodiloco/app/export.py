"""`geodiloco export`: the committed global model as a checkpoint other tools read.

The coordinator keeps θ as one flat vector in canonical (sorted-name) order; export builds the
run's model with its own builder, loads θ into it and writes the model's own state dict, in its
own parameter names and order: a safetensors file (a ``save_pretrained`` directory for
``transformers`` models) or a ``torch.distributed.checkpoint`` directory. Buffers (batch-norm
statistics, for instance) are not part of θ: they are written as the builder makes them, and
listed in the export's ``geodiloco-export.json``.

Only :func:`read_committed` knows the coordinator's durable format.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from geodiloco.params import canonical_parameters, load_flat_parameters, state_hash

if TYPE_CHECKING:
    from collections.abc import Callable

    from geodiloco.config import RunConfig
    from geodiloco.security.sealing import Sealer

FORMATS = ("safetensors", "dcp")
METADATA_FILE = "geodiloco-export.json"
SAFETENSORS_FILE = "model.safetensors"


class ExportError(ValueError):
    """What export cannot read or write; the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class Committed:
    """A committed global model: its round (θ_round, after ``round`` outer steps) and θ."""

    round: int
    theta: torch.Tensor
    state_hash: str


def read_committed(
    run_dir: Path, cfg: RunConfig, run_secret: Path | None, round_: int | None = None
) -> Committed:
    """θ of round ``round_`` (default: the last committed) from a coordinator's ``--run-dir`` (or
    the ``coordinator/`` folder of a demo's run directory): the last snapshot plus the logged
    updates after it, checked against the hash chain. Round 0 is θ_0 as the builders make it;
    rounds before the last snapshot are no longer stored. A streaming run's (P > 1 fragments) θ
    is assembled from every fragment's θ after ``round_`` of its rounds (default: its last)."""
    from geodiloco.coordinator.durable import STATE_FILE, STATE_LABEL
    from geodiloco.coordinator.edge.server import initial_parameters
    from geodiloco.coordinator.rundir import PLAN_FILE
    from geodiloco.coordinator.updatelog import UPDATES_DIR
    from geodiloco.security.sealing import Keyring
    from geodiloco.security.secrets import load_secret

    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: not a directory (give the coordinator's --run-dir)")
    if (
        not any((run_dir / f).exists() for f in (STATE_FILE, UPDATES_DIR, PLAN_FILE))
        and (run_dir / "coordinator").is_dir()
    ):
        run_dir = run_dir / "coordinator"  # a demo's run directory
    if round_ == 0:
        theta = initial_parameters(cfg)
        return Committed(0, theta, state_hash(theta))
    sealer = None
    if run_secret is not None:
        try:
            sealer = Keyring(load_secret(run_secret), cfg.run_id).at_rest(STATE_LABEL)
        except (OSError, ValueError) as exc:
            raise ExportError(f"--run-secret: {exc}") from None
    if (run_dir / PLAN_FILE).exists():
        return _read_fragments(run_dir, cfg, sealer, round_)
    return _read_one(run_dir, cfg, sealer, round_, lambda: initial_parameters(cfg))


def _read_fragments(run_dir: Path, cfg: RunConfig, sealer: Sealer | None, round_: int | None) -> Committed:
    """Every fragment's committed θ, scattered into the canonical vector by the run's plan."""
    from geodiloco.coordinator.fragment_rounds import fragment_dir, read_plan
    from geodiloco.coordinator.refusals import CorruptStateError

    try:
        plan = read_plan(run_dir)
    except CorruptStateError as exc:
        raise ExportError(str(exc)) from None
    flat = torch.empty(sum(plan.sizes), dtype=torch.float32)
    last = 0
    for p in range(plan.count):
        # a fragment's first snapshot (θ_0's share) is written before the plan: no replay from θ_0
        one = _read_one(fragment_dir(run_dir, p), cfg, sealer, round_, None)
        plan.scatter(p, one.theta, flat)
        last = one.round  # the last fragment's: it ends each round of H steps
    return Committed(last, flat, state_hash(flat))


def _read_one(
    run_dir: Path,
    cfg: RunConfig,
    sealer: Sealer | None,
    round_: int | None,
    initial_parameters: Callable[[], torch.Tensor] | None,
) -> Committed:
    """θ after ``round_`` rounds of one round log: its snapshot plus its logged updates."""
    from geodiloco.coordinator.durable import STATE_FILE, StateError
    from geodiloco.coordinator.replay import committed_parameters
    from geodiloco.coordinator.updatelog import logged_rounds, read_update

    logged, snapshot = logged_rounds(run_dir), (run_dir / STATE_FILE).exists()
    if not snapshot and (not logged or initial_parameters is None):
        raise ExportError(
            f"{run_dir}: no committed round (no {STATE_FILE} and no logged update); --round 0 exports "
            "θ_0 as the run's builders make it"
        )
    own_config = "export with the run's own config (--config)"
    try:
        newest = read_update(run_dir, logged[-1], sealer) if logged else None
        if newest is not None and newest.run_id != cfg.run_id:
            raise ExportError(
                f"{run_dir} holds run {newest.run_id!r}, the config names {cfg.run_id!r}: {own_config}"
            )
        initial = None if snapshot or initial_parameters is None else initial_parameters()
        first = read_update(run_dir, logged[0], sealer) if initial is not None else None
        if first is not None and initial is not None and first.base_hash != state_hash(initial):
            raise ExportError(f"{run_dir}: round 0 did not start from this config's θ_0: {own_config}")
        committed = committed_parameters(run_dir, round_, sealer, initial)
    except StateError as exc:  # sealed without the secret, corrupt, altered, a round not kept
        raise ExportError(f"--round {round_}: {exc}" if round_ is not None else str(exc)) from None
    if committed.run_id is not None and committed.run_id != cfg.run_id:
        raise ExportError(
            f"{run_dir} holds run {committed.run_id!r}, the config names {cfg.run_id!r}: {own_config}"
        )
    return Committed(committed.round, committed.theta, committed.state_hash)


def model_with(cfg: RunConfig, theta: torch.Tensor) -> nn.Module:
    """The run's model (its own builder) holding θ."""
    from geodiloco.builders import build_model

    model = build_model(cfg)
    count = sum(p.numel() for _, p in canonical_parameters(model))
    if count != theta.numel():
        raise ExportError(
            f"the state holds {theta.numel()} parameters, workload.model {cfg.workload.model} builds "
            f"{count}: export with the run's own config (--config, --set)"
        )
    load_flat_parameters(model, theta)
    return model


def _buffers(model: nn.Module) -> list[str]:
    state = model.state_dict()
    params = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [name for name in state if name not in params]


def _save_safetensors(model: nn.Module, out: Path) -> list[str]:
    """A ``save_pretrained`` directory for transformers models, else one safetensors file.
    Returns the files written."""
    save_pretrained = getattr(model, "save_pretrained", None)
    if callable(save_pretrained):  # transformers: its config and tied weights, as it reads them
        save_pretrained(out, safe_serialization=True)
        return sorted(p.name for p in out.iterdir())
    try:
        from safetensors.torch import save_model
    except ImportError:
        raise ExportError(
            "--format safetensors needs the safetensors package: pip install 'geodiloco[hf]'"
        ) from None
    save_model(model, str(out / SAFETENSORS_FILE))  # drops a tied weight's duplicates
    return [SAFETENSORS_FILE]


def _save_dcp(model: nn.Module, out: Path) -> list[str]:
    import torch.distributed.checkpoint as dcp

    state = {name: t.detach().clone() for name, t in model.state_dict().items()}
    with warnings.catch_warnings():  # one process, no process group: what export means
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(out))
    return sorted(p.name for p in out.iterdir())


def export(
    cfg: RunConfig,
    run_dir: Path,
    out: Path,
    fmt: str,
    run_secret: Path | None = None,
    round_: int | None = None,
) -> dict[str, object]:
    """Write round ``round_``'s global model (default: the last committed) to ``out``; returns
    what was written (also saved in ``out/geodiloco-export.json``)."""
    if fmt not in FORMATS:
        raise ExportError(f"--format: unknown {fmt!r}; accepted: {', '.join(FORMATS)}")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out}: exists and is not an empty directory")
    committed = read_committed(run_dir, cfg, run_secret, round_)
    model = model_with(cfg, committed.theta)
    out.mkdir(parents=True, exist_ok=True)
    files = _save_safetensors(model, out) if fmt == "safetensors" else _save_dcp(model, out)
    summary: dict[str, object] = {
        "run_id": cfg.run_id,
        "round": committed.round,
        "state_hash": committed.state_hash,
        "format": fmt,
        "model": cfg.workload.model,
        "parameters": committed.theta.numel(),
        "files": files,
        "buffers_as_built": _buffers(model),  # not part of θ: as the builder makes them
    }
    (out / METADATA_FILE).write_text(json.dumps(summary, indent=2))
    return summary
