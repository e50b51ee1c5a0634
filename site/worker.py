"""One rank of a site: the reference workload's training loop (started by torchrun).

Reads top to bottom: join, build, attach, then H inner steps and one outer sync per round.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from geodiloco import logs
from geodiloco.distributed import init_distributed, shutdown_distributed
from geodiloco.lifecycle import GracefulStop
from geodiloco.logs import setup_logging
from geodiloco.metrics import SiteTelemetry
from geodiloco.security.secrets import load_secret
from geodiloco.security.tls import TlsFiles
from geodiloco.site.outer_sync import OuterSync
from geodiloco.workload import (
    DataShards,
    build_model,
    eval_slice,
    eval_windows,
    evaluate,
    inner_step,
    load_corpus,
    make_inner_optimizer,
    rank_batch,
)

log = logging.getLogger("geodiloco.site")


def train(coordinator: str, site: str, tls: TlsFiles | None, site_secret: bytes | None) -> None:
    rank, world = init_distributed()
    sync = OuterSync.connect(coordinator, site, world_size=world, tls=tls, site_secret=site_secret)
    cfg = sync.config
    logs.bind(run=sync.info.run_id, round=lambda: sync.round)  # ops: run/round on every log line
    stop = GracefulStop.install()  # ops: SIGTERM leaves at the next step
    telemetry = SiteTelemetry.start(  # ops: metrics and progress (rank 0)
        site, rank, cfg.rounds * cfg.inner.steps_per_round, lambda: (sync.bytes_sent, sync.bytes_received)
    )
    model = sync.attach(build_model(cfg.model, cfg.seed))
    ddp = DDP(model)
    optimizer = make_inner_optimizer(model, cfg.inner)
    corpus = load_corpus(cfg.data.paths, cfg.data.max_bytes, cfg.data.eval_fraction)
    shards = DataShards(corpus, count=cfg.data.shards, seq_len=cfg.model.seq_len, seed=cfg.seed)
    my_eval = eval_slice(
        eval_windows(corpus, cfg.data.eval_sequences, cfg.model.seq_len),
        part=sync.shard_index * world + rank,
        parts=sync.shard_count * world,
    )
    tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
    losses: list[float] = []
    started = time.perf_counter()
    while not sync.finished:
        if stop.requested():  # ops: all ranks agree, then leave
            break
        if sync.steps_in_round == 0:
            windows = shards.windows(sync.data)  # the ledger's share of data for this round
        step = sync.round * cfg.inner.steps_per_round + sync.steps_in_round
        x, y = rank_batch(windows, sync.steps_in_round, rank, world, cfg.data.batch_size)
        step_started = time.perf_counter()  # ops
        losses.append(inner_step(ddp, optimizer, cfg.inner, step, x, y))
        telemetry.step(
            time.perf_counter() - step_started, tokens_per_step * world, sync.round, step + 1
        )  # ops
        compute_s = time.perf_counter() - started
        sync_started = time.perf_counter()  # ops
        if not sync.step(tokens=tokens_per_step):
            continue
        sync_s = time.perf_counter() - sync_started  # ops
        eval_sum, eval_count = evaluate(model, my_eval)
        totals = torch.tensor([eval_sum, float(eval_count), sum(losses) / len(losses)], dtype=torch.float64)
        dist.all_reduce(totals)
        sync.report(float(totals[0]), int(totals[1]), float(totals[2]) / world, compute_s)
        if rank == 0:
            log.info(
                "round %d done: train loss %.4f, eval slice loss %.4f",
                sync.round - 1,
                float(totals[2]) / world,
                float(totals[0] / totals[1]),
            )
        telemetry.round(  # ops
            train_loss=float(totals[2]) / world,
            eval_loss=float(totals[0] / totals[1]),
            sync_seconds=sync_s,
        )
        losses.clear()
        started = time.perf_counter()
    sync.close(stop.reason)  # ops: "finished" or "stopped by SIGTERM"
    telemetry.close()  # ops
    del ddp
    shutdown_distributed()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one rank of a geodiloco site (run by torchrun)")
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--site", required=True)
    parser.add_argument("--tls", nargs=3, type=Path, metavar=("CERT", "KEY", "CA"))
    parser.add_argument("--secret", type=Path)
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    setup_logging(site=args.site, rank=rank)
    tls = TlsFiles(*args.tls) if args.tls and rank == 0 else None
    secret = load_secret(args.secret) if args.secret and rank == 0 else None  # only rank 0 talks
    train(args.coordinator, args.site, tls, secret)


if __name__ == "__main__":
    main()
