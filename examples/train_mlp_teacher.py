"""A site's training loop of the user's own, around geodiloco's OuterSync (run it with torchrun).

    torchrun --standalone --nproc-per-node=2 examples/train_mlp_teacher.py \\
        --coordinator 127.0.0.1:50051 --site site-1

Every rank runs this file: the ranks form a gloo group and train the MLP with DDP; every H
inner steps ``sync.step`` pushes this site's pseudo-gradient and applies the run's outer
update. Without ``--tls``/``--secret`` it talks plaintext, which the coordinator accepts only
when started with ``--insecure`` on loopback.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mlp_teacher import build_data, build_model, build_optimizer
from torch.nn.parallel import DistributedDataParallel

from geodiloco.security.secrets import load_secret
from geodiloco.security.tls import TlsFiles
from geodiloco.site import connect


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[float, int]:
    total, count = 0.0, 0
    for x, labels in batches:
        total += float(F.cross_entropy(model(x), labels)) * x.shape[0]
        count += x.shape[0]
    return total, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", required=True, help="host:port")
    parser.add_argument("--site", required=True, help="this site's name in the run config")
    parser.add_argument("--tls", nargs=3, type=Path, metavar=("CERT", "KEY", "CA"))
    parser.add_argument("--secret", type=Path, help="site-NAME.secret (payload sealing)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    sync = connect(
        args.coordinator,
        args.site,
        tls=TlsFiles(*args.tls) if args.tls else None,
        site_secret=load_secret(args.secret) if args.secret else None,
    )
    cfg = sync.config  # the run's config, as the coordinator sent it
    model = build_model(cfg)
    ddp = DistributedDataParallel(model)
    sync.attach(model)  # takes the run's current parameters if this site joins late
    optimizer = build_optimizer(model, cfg)
    data = build_data(cfg)
    # this site's share of the held-out set (by its data shard), split among its ranks
    eval_part, eval_parts = sync.shard_index + sync.shard_count * rank, sync.shard_count * world

    losses, started = [], time.perf_counter()
    while not sync.finished:
        x, labels = data.batch(sync.data, sync.steps_in_round, rank, world)
        loss = F.cross_entropy(ddp(x), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        if not sync.step(tokens=x.shape[0]):  # True once every H steps, after the outer sync
            continue
        eval_sum, eval_count = evaluate(model, data.eval_batches(eval_part, eval_parts))
        totals = torch.tensor([eval_sum, eval_count, sum(losses) / len(losses)], dtype=torch.float64)
        dist.all_reduce(totals)
        compute_s = time.perf_counter() - started
        sync.report(float(totals[0]), int(totals[1]), float(totals[2]) / world, compute_s)
        if rank == 0:
            print(f"round {sync.round - 1}: eval loss {float(totals[0] / totals[1]):.4f}", flush=True)
        losses, started = [], time.perf_counter()
    sync.close()
    del ddp
    dist.barrier()  # leave together, before DDP's reducer is torn down at exit
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
