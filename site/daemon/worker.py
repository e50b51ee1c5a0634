"""One rank of a site: the daemon's training loop (started by torchrun, on one or many nodes).

Reads top to bottom: join, build the run's model on the rank's device (``LOCAL_RANK``'s GPU, or
the CPU), its optimizer and data with the builders its config names (``workload.*``; the
reference workload by default), attach, then H inner steps and one outer sync per round.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import functools
import gc
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import grpc
import torch
import torch.distributed as dist

import geodiloco.site.parallel.checkpoint as checkpoint
from geodiloco import faults, logs
from geodiloco.builders import (
    Batch,
    build_data,
    build_loss,
    build_model,
    build_optimizer,
    check_site_step,
    exit_config_error,
)
from geodiloco.config import ConfigError
from geodiloco.distributed import DEVICES, init_rank, shutdown_distributed
from geodiloco.lifecycle import GracefulStop
from geodiloco.logs import setup_logging
from geodiloco.pages import keep_freed_pages
from geodiloco.prometheus import SiteTelemetry
from geodiloco.security.chunks import KeyMismatch
from geodiloco.security.secrets import load_secret
from geodiloco.security.tls import TlsFiles
from geodiloco.site.daemon.launcher import EXIT_REFUSED, REFUSAL_FILE_ENV
from geodiloco.site.edge.client import transient
from geodiloco.site.edge.grpc_link import GrpcLink
from geodiloco.site.outer_sync import OuterSync
from geodiloco.site.parallel.layout import (
    ACTIVATION_CHECKPOINTING,
    PRECISIONS,
    LayoutError,
    ParallelConfig,
    build_mesh,
    data_parallel_rank,
    layout_summary,
    parallelize,
    precision_problem,
)
from geodiloco.workload.steps import evaluate_batches, inner_step

log = logging.getLogger("geodiloco.site")
PR_SET_PDEATHSIG = 1  # linux/prctl.h
REFUSAL_KEY = "geodiloco/join-refused"  # in the site's rendezvous store: the refusal, for every node


@dataclass(frozen=True, slots=True)
class SiteOptions:
    """How this site runs, beside the run's own config (which the coordinator sends)."""

    layout: ParallelConfig
    checkpoint_dir: Path | None = None
    checkpoint_every: int = 0  # rounds; 0: only on SIGTERM (when checkpoint_dir is set)
    device: str = "auto"  # auto, cpu or cuda (LOCAL_RANK's GPU)
    streams: int = 1  # TCP connections per rank (site/grpc_link.py)


def on_device(batch: Batch, device: torch.device) -> Batch:
    """A batch on the rank's device (pinned and copied asynchronously to a GPU)."""
    if device.type == "cpu":
        return batch
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in batch)


def batches_on(batches: Iterable[Batch], device: torch.device) -> Iterator[Batch]:
    return (on_device(b, device) for b in batches)


def resume(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, sync: OuterSync) -> None:
    """Load a checkpoint; continue mid-round only if the coordinator is still at that round with
    the same θ_r and data, else keep the optimizer and residual and take the global state."""
    global_round, global_hash, global_data = sync.round, sync.digest(sync.snapshot), sync.data
    meta = checkpoint.load(path, model, optimizer, sync)
    loaded = {
        "checkpoint": path.name,
        "state_hash": sync.digest(sync.snapshot),
        "params_hash": sync.digest(),
        "residual_hash": checkpoint.residual_digest(sync),
        "ranks": sync.group.world,
    }
    if sync.group.rank == 0:
        (path.parent / "resumed.json").write_text(json.dumps(loaded, indent=2))  # what was loaded
    current = (meta.round, meta.state_hash, sync.data) == (global_round, global_hash, global_data)
    if not current:
        log.warning(
            "checkpoint of round %d is behind the run (round %d); taking the global state",
            meta.round,
            global_round,
        )
        sync.reload_global_state()
    log.info(
        "resumed from %s (round %d, step %d, %d ranks before, %d now)",
        path.name,
        sync.round,
        sync.steps_in_round,
        meta.ranks,
        sync.group.world,
    )


def round_train_loss(losses: list[float], trained_round: int, closed_round: int) -> float:
    """The mean inner loss of the round this site just closed; NaN when the sync resynced it to
    a later round (a lapsed lease, a refused push), since the losses belong to a round the run
    closed without them."""
    if closed_round != trained_round or not losses:
        return math.nan
    return sum(losses) / len(losses)


def site_store(timeout_s: float = 10.0) -> dist.Store | None:
    """The key-value store torchrun's rendezvous gives every rank of the site, on every node
    (MASTER_ADDR:MASTER_PORT; node 0's torchrun hosts it and keeps it up until every node's ranks
    have finished); None outside torchrun."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def exit_refused(local_rank: int, line: str) -> NoReturn:
    """The coordinator refused the site at Join: say why in one line per node (its local rank 0),
    not in every rank's traceback and torchrun's failure box. Under `geodiloco site run` every
    rank leaves with status 0 and each node's launcher, finding the refusal written down in its
    node's file, exits EXIT_REFUSED."""
    refusal_file = os.environ.get(REFUSAL_FILE_ENV)
    if local_rank == 0:
        print(f"geodiloco site: {line}", file=sys.stderr, flush=True)
    if refusal_file:
        Path(refusal_file).write_text(line + "\n")
    logging.shutdown()
    os._exit(0 if refusal_file else EXIT_REFUSED)  # no process group teardown: a peer has gone


def join_refusal(rank: int, exc: BaseException) -> str | None:
    """The coordinator's refusal behind a failure to join, as one line, or None (a lost
    coordinator, a bug).

    Rank 0 finds it in the error (the link raises its domain error from the gRPC status) and
    writes it to the site's rendezvous store before it leaves; the other ranks, on whichever
    node, whose broadcast broke when rank 0 left, read it there."""
    if rank != 0:
        try:
            store = site_store()
            found = store is not None and store.check([REFUSAL_KEY])
            return store.get(REFUSAL_KEY).decode() if store is not None and found else None
        except (RuntimeError, OSError):  # no store to ask: not a refusal we know of
            return None
    for cause in (exc, exc.__cause__):
        if isinstance(cause, KeyMismatch) or (isinstance(cause, grpc.RpcError) and not transient(cause)):
            why = (
                f"{cause.code().name}: {cause.details()}" if isinstance(cause, grpc.RpcError) else str(cause)
            )
            line = f"join refused: {why}"
            try:
                store = site_store()
                if store is not None:
                    store.set(REFUSAL_KEY, line)
            except (RuntimeError, OSError):  # the other ranks then fail as before
                log.warning("could not tell the site's other ranks of the refusal")
            return line
    return None


def train(
    coordinator: str, site: str, tls: TlsFiles | None, site_secret: bytes | None, options: SiteOptions
) -> None:
    ctx = init_rank(options.device)
    rank, world, device = ctx.rank, ctx.world, ctx.device
    layout = options.layout
    problem = precision_problem(layout.mixed_precision, device)
    if problem is not None:
        raise LayoutError(problem)
    stop = GracefulStop.install()  # ops: SIGTERM leaves at the next step
    mesh = build_mesh(layout, device.type)
    try:
        link = GrpcLink(coordinator, site, tls=tls, site_secret=site_secret, streams=options.streams)
        sync = OuterSync.over(link, layout.data_parallel)
    except Exception as exc:
        refusal = join_refusal(rank, exc)
        if refusal is not None:
            exit_refused(ctx.local_rank, refusal)
        raise
    cfg = sync.config
    link.wait_for_coordinator(cfg.round_timeout_s)
    logs.bind(run=sync.info.run_id, round=lambda: sync.round)  # ops: run/round on every log line
    telemetry = SiteTelemetry.start(  # ops: metrics and progress (rank 0)
        site, rank, cfg.rounds * cfg.inner.steps_per_round, lambda: (sync.bytes_sent, sync.bytes_received)
    )
    model = build_model(cfg).to(device)
    trained = parallelize(model, layout, mesh)
    sync.attach(model)
    sync.tamper = functools.partial(faults.poison, site, rank)  # tests: a fault plan's poison, if any
    if rank == 0:
        log.info("layout: %s on %s", layout_summary(layout), device.type)
    optimizer = build_optimizer(model, cfg)
    found = checkpoint.latest(options.checkpoint_dir) if options.checkpoint_dir else None
    if found is not None and not sync.finished:
        resume(found, model, optimizer, sync)
    data = build_data(cfg)
    loss_fn = build_loss(cfg)
    check_site_step(cfg, trained, data, loss_fn, device)  # a mismatch is a config error, before training
    # Everything built so far (torch, dynamo and sympy's modules among it) lives as long as the
    # rank: out of the collector's sight, the full collection before the group is torn down and
    # the interpreter's at exit no longer walk it (about 1 s of CPU per rank), as in the coordinator.
    gc.freeze()
    dp_rank, dp = data_parallel_rank(mesh), layout.data_parallel
    # the site's share of the eval set (by its shard index), split among its data-parallel ranks
    eval_part, eval_parts = sync.shard_index + sync.shard_count * dp_rank, sync.shard_count * dp
    losses: list[float] = []
    started = time.perf_counter()
    while not sync.finished:
        if stop.requested():  # all ranks agree, then checkpoint (if asked to) and leave
            if options.checkpoint_dir is not None:
                checkpoint.save(options.checkpoint_dir, model, optimizer, sync, layout.name)
            break
        faults.at(site, rank, sync.round, sync.steps_in_round)  # tests: a fault plan's faults, if any
        trained_round = sync.round
        step = sync.round * cfg.inner.steps_per_round + sync.steps_in_round
        batch = on_device(data.batch(sync.data, sync.steps_in_round, dp_rank, dp), device)  # ledger's data
        tokens = data.tokens(batch)
        step_started = time.perf_counter()  # ops
        losses.append(inner_step(trained, optimizer, cfg.inner, sync.lr_step, *batch, loss_fn=loss_fn))
        # tests: a plan's slow makes this step last its factor times as long
        faults.stretch(site, rank, sync.round, sync.steps_in_round, time.perf_counter() - step_started)
        telemetry.step(time.perf_counter() - step_started, tokens * dp, sync.round, step + 1)  # ops
        compute_s = time.perf_counter() - started
        sync_started = time.perf_counter()  # ops
        if not sync.step(tokens=tokens):
            continue
        sync_s = time.perf_counter() - sync_started  # ops
        eval_sum, eval_count = evaluate_batches(
            trained, batches_on(data.eval_batches(eval_part, eval_parts), device), loss_fn
        )
        closed = sync.last_result.round if sync.last_result is not None else trained_round
        train_loss = round_train_loss(losses, trained_round, closed)  # NaN after a resync
        # summed over the site's ranks on its control group (host values, whatever the backend)
        summed = sync.sum_over_ranks(eval_sum, eval_count, train_loss)
        site_eval_sum, site_eval_count = summed[0] / layout.tp, summed[1] / layout.tp  # TP: one slice
        site_loss = summed[2] / world
        eval_loss = site_eval_sum / site_eval_count if site_eval_count else math.nan
        sync.report(site_eval_sum, round(site_eval_count), site_loss, compute_s)
        if rank == 0:
            log.info(
                "round %d done: train loss %s, eval slice loss %.4f",
                closed,
                f"{site_loss:.4f}" if closed == trained_round else f"- (trained round {trained_round})",
                eval_loss,
            )
        telemetry.round(train_loss=site_loss, eval_loss=eval_loss, sync_seconds=sync_s)  # ops
        losses.clear()
        every = options.checkpoint_every
        if options.checkpoint_dir is not None and every and sync.round % every == 0 and not sync.finished:
            checkpoint.save(options.checkpoint_dir, model, optimizer, sync, layout.name)
        started = time.perf_counter()
    sync.close(stop.reason)  # ops: "finished" or "stopped by SIGTERM"
    telemetry.close()  # ops
    del trained
    shutdown_distributed()


def die_with_parent() -> None:
    """torchrun starts ranks in their own sessions: if it is killed outright (SIGKILL, OOM),
    make the kernel kill its ranks too rather than leave them training as orphans."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one rank of a geodiloco site (run by torchrun)")
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--site", required=True)
    parser.add_argument("--tls", nargs=3, type=Path, metavar=("CERT", "KEY", "CA"))
    parser.add_argument("--secret", type=Path)
    parser.add_argument(
        "--layout", default="ddp", help="ddp, fsdp, hsdp, tp, fsdp+tp, ep or pp=P,dp_replicate=R,..."
    )
    parser.add_argument("--mixed-precision", default="fp32", choices=PRECISIONS)
    parser.add_argument("--activation-checkpointing", default="none", choices=ACTIVATION_CHECKPOINTING)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--device", default="auto", choices=DEVICES)
    parser.add_argument("--streams", type=int, default=1)
    args = parser.parse_args(argv)
    die_with_parent()
    keep_freed_pages()  # before gRPC's threads allocate: see geodiloco/pages.py
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(site=args.site, rank=rank)
    world, nodes = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    layout = ParallelConfig.parse(  # torchrun's nodes
        args.layout,
        world,
        args.mixed_precision,
        nodes,
        activation_checkpointing=args.activation_checkpointing,
        compile=args.compile,
    )
    tls = TlsFiles(*args.tls) if args.tls else None
    secret = load_secret(args.secret) if args.secret else None  # every rank pushes its own part
    options = SiteOptions(layout, args.checkpoint_dir, args.checkpoint_every, args.device, args.streams)
    try:
        train(args.coordinator, args.site, tls, secret, options)
    except ConfigError as exc:  # a builder that cannot be imported or does not fit: one line
        exit_config_error(exc)


if __name__ == "__main__":
    main()
