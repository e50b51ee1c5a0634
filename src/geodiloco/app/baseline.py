"""The synchronous baseline: every rank of every site in one data-parallel group.

This is what a user would otherwise run across datacenters: an fp32 gradient all-reduce every
step, with the same model, data shards, per-rank batch, inner optimizer and token budget as
the DiLoCo run. Started by torchrun with ``sites * ranks_per_site`` ranks; global rank g plays
rank ``g % ranks_per_site`` of site ``g // ranks_per_site``.
"""

import argparse
import gc
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from geodiloco.builders import build_data, build_loss, build_model, build_optimizer
from geodiloco.config import RunConfig
from geodiloco.coordinator.ledger import DataLedger
from geodiloco.distributed import init_distributed, shutdown_distributed
from geodiloco.logs import setup_logging
from geodiloco.workload.steps import evaluate_batches, inner_step


@dataclass(slots=True)
class AllReduceCounter:
    """Bytes of gradient buckets DDP actually all-reduced (counted in its comm hook)."""

    bytes: int = 0


def counting_allreduce_hook(
    state: AllReduceCounter, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    state.bytes += buffer.numel() * buffer.element_size()
    return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]


def cross_site_bytes(allreduced_bytes: int, sites: int) -> int:
    """WAN bytes of a hierarchical all-reduce whose inter-site stage is a ring over the sites.

    Each site first reduces inside its datacenter (no WAN traffic); the S site leaders then run
    a ring all-reduce of the M bytes, in which each leader sends 2(S-1)/S * M bytes (reduce-scatter
    then all-gather). Summed over the S sites that is 2(S-1) * M bytes crossing site boundaries.
    """
    return 2 * (sites - 1) * allreduced_bytes


def run(cfg: RunConfig, ranks_per_site: int, out: Path | None) -> None:
    rank, world = init_distributed()
    sites = world // ranks_per_site
    if sites * ranks_per_site != world:
        raise SystemExit(f"world size {world} is not a multiple of ranks_per_site {ranks_per_site}")
    if sites != len(cfg.sites):
        raise SystemExit(
            f"{world} ranks / {ranks_per_site} per site is {sites} sites; the config names {len(cfg.sites)}"
        )
    site, local = divmod(rank, ranks_per_site)
    # The sites' own builders: the reference GPT, or its mixture of experts with model.experts
    # (and AdamW that holds unreached experts), from workload.init_weights when one is set.
    model = build_model(cfg)
    ddp = DDP(model)
    counter = AllReduceCounter()
    ddp.register_comm_hook(counter, counting_allreduce_hook)
    optimizer = build_optimizer(model, cfg)
    loss_fn = build_loss(cfg)
    data = build_data(cfg)
    gc.freeze()  # built for the whole run: out of the collector's sight (as a site's rank does)
    # The same data, round by round, as a fault-free DiLoCo run: the ledger with every site live.
    ledger = DataLedger.create(data.shard_sizes, cfg.sites)
    me = cfg.sites[site]
    H = cfg.inner.steps_per_round
    tokens_per_step = cfg.data.batch_size * cfg.model.seq_len * world
    curve: list[dict[str, float]] = []
    started = time.perf_counter()
    for step in range(cfg.rounds * H):
        if step % H == 0:
            for name in cfg.sites:
                ledger.reserve(name, H * ranks_per_site * cfg.data.batch_size)
            ranges = ledger.reservations[me]
            ledger.settle(step // H, set(cfg.sites))
        batch = data.batch(ranges, step % H, local, ranks_per_site)
        inner_step(ddp, optimizer, cfg.inner, step, *batch, loss_fn=loss_fn)
        if (step + 1) % H:
            continue
        eval_sum, eval_count = evaluate_batches(model, data.eval_batches(rank, world), loss_fn)
        totals = torch.tensor([eval_sum, float(eval_count)], dtype=torch.float64)
        dist.all_reduce(totals)
        point = {
            "step": step + 1,
            "tokens": (step + 1) * tokens_per_step,
            "eval_loss": float(totals[0] / totals[1]),
            "wan_bytes": cross_site_bytes(counter.bytes, sites),
            "elapsed_s": time.perf_counter() - started,
        }
        curve.append(point)
        if rank == 0:
            print(
                f"baseline step {step + 1}/{cfg.rounds * H}  eval {point['eval_loss']:.4f}  "
                f"wan {point['wan_bytes'] / 1e6:.1f} MB  elapsed {point['elapsed_s']:.0f}s",
                flush=True,
            )
    if rank == 0 and out is not None:
        result = {
            "final_eval_loss": curve[-1]["eval_loss"],
            "wan_bytes": cross_site_bytes(counter.bytes, sites),
            "allreduced_bytes_per_rank": counter.bytes,
            "tokens": cfg.rounds * H * tokens_per_step,
            "steps": cfg.rounds * H,
            "curve": curve,
            "wall_seconds": time.perf_counter() - started,
        }
        out.write_text(json.dumps(result, indent=2))
    del ddp
    shutdown_distributed()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="synchronous data-parallel baseline (run by torchrun)")
    parser.add_argument("--config", required=True, type=Path, help="run config JSON")
    parser.add_argument("--ranks-per-site", required=True, type=int)
    parser.add_argument("--out", type=Path, help="write the result JSON here (rank 0)")
    args = parser.parse_args(argv)
    setup_logging(site="baseline", rank=int(os.environ.get("RANK", "0")))
    run(RunConfig.from_json(args.config.read_text()), args.ranks_per_site, args.out)


if __name__ == "__main__":
    main()
