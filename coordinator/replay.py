"""θ at any durable round of a run directory: the last snapshot plus the logged updates after it.

The coordinator replays this way when it restarts; tools (an exporter, an auditor) call
:func:`committed_parameters` to read the global parameters a run committed, without a server.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from geodiloco.compression import EncodedChunk, Place, parse_pipeline
from geodiloco.coordinator.durable import STATE_FILE, CorruptStateError, StateError, load_state
from geodiloco.coordinator.rounds_pool import WORKERS
from geodiloco.coordinator.updatelog import LoggedUpdate, logged_rounds, read_update
from geodiloco.params import Checksum, add_encoded_and_hash, state_hash
from geodiloco.security.sealing import Sealer


@dataclass(frozen=True, slots=True)
class CommittedParameters:
    round: int  # θ at the start of this round (after `round` commits)
    theta: torch.Tensor
    state_hash: str
    run_id: str | None = None  # the run the snapshot belongs to (None: replayed from θ_0)


def apply_update(theta: torch.Tensor, update: LoggedUpdate) -> float:
    """θ += the update's decoded chunks, in place, checked against its logged hash; returns ‖θ‖."""
    codec = parse_pipeline(update.codec)
    spans = sorted((c.start, c.start + c.numel) for c in update.chunks)
    if any(a >= b for a, b in spans) or any(b > c for (_, b), (c, _) in itertools.pairwise(spans)):
        raise CorruptStateError(f"the update of round {update.round} has overlapping or empty chunks")
    if spans and spans[-1][1] > theta.numel():
        raise CorruptStateError(f"the update of round {update.round} has a chunk outside the model")

    def one(chunk: EncodedChunk) -> tuple[Checksum, float]:
        piece = theta[chunk.start : chunk.start + chunk.numel]
        place = Place.span(update.round, chunk.start, chunk.numel)
        return add_encoded_and_hash(codec, codec.unpack(chunk.payload, chunk.numel, place), place, piece)

    checksum, sumsq = Checksum(), 0.0
    for part, squares in WORKERS.map(one, update.chunks):  # disjoint chunks: in parallel
        checksum, sumsq = checksum.merge(part), sumsq + squares
    if checksum.count != theta.numel() or checksum.hexdigest() != update.state_hash:
        raise CorruptStateError(f"replaying round {update.round} does not give its logged hash")
    return math.sqrt(sumsq)


def committed_parameters(
    run_dir: Path,
    round_: int | None = None,
    sealer: Sealer | None = None,
    initial: torch.Tensor | None = None,
) -> CommittedParameters:
    """The committed global parameters of ``run_dir`` at the start of ``round_`` (the latest
    durable round by default), verified link by link against the hash chain.

    ``sealer`` opens a sealed run's files (its at-rest key); ``initial`` (θ_0) is needed only
    when the directory has no snapshot yet. Rounds before the snapshot are no longer available.
    """
    state = load_state(run_dir / STATE_FILE, sealer)
    run_id = None if state is None else str(state["run_id"])
    if state is not None:
        at, theta, digest = int(state["round"]), state["theta"], state["hashes"][int(state["round"])]
    elif initial is not None:
        at, theta = 0, initial.detach().to(torch.float32).clone()
        digest = state_hash(theta)
    else:
        raise StateError(f"{run_dir}: no snapshot; give the run's initial parameters to replay from round 0")
    logged = [r for r in logged_rounds(run_dir) if r >= at]
    last = logged[-1] + 1 if logged else at
    target = last if round_ is None else round_
    if not at <= target <= last:
        raise StateError(f"{run_dir}: round {target} is not available (rounds {at} to {last} are)")
    for r in range(at, target):
        update = read_update(run_dir, r, sealer)
        if update is None:
            raise CorruptStateError(f"{run_dir}: round {r} is not logged")
        if update.base_hash != digest:
            raise CorruptStateError(f"{run_dir}: the update of round {r} does not start from θ_{r}")
        apply_update(theta, update)
        digest = update.state_hash
    return CommittedParameters(target, theta, digest, run_id)
