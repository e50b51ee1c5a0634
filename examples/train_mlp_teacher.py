"""A site's training loop of the user's own, around geodiloco's OuterSync (run it with torchrun).

    torchrun --standalone --nproc-per-node=2 examples/train_mlp_teacher.py \\
        --coordinator 127.0.0.1:50051 --site site-1 [--device cuda]

Every rank runs this file: the ranks form their own process group (gloo on the CPU, NCCL on
GPUs, or ``--backend``) and train the MLP with DDP; every H inner steps ``sync.step`` pushes
this site's pseudo-gradient and applies the run's outer update. geodiloco's own collectives
(agreement, the join info, the pulled chunks, ``sum_over_ranks``) carry CPU tensors on a gloo
group it makes beside an NCCL one, so this loop is the same on either. Without
``--tls``/``--secret`` it talks plaintext, which the coordinator accepts only when started with
``--insecure`` on loopback. docs/own-model.md shows the part between the ``recipe`` markers.
"""

from __future__ import annotations

import argparse
import os
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
    model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> tuple[float, int]:
    total, count = 0.0, 0
    for x, labels in batches:
        total += float(F.cross_entropy(model(x.to(device)), labels.to(device))) * x.shape[0]
        count += x.shape[0]
    return total, count


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coordinator", required=True, help="host:port")
    parser.add_argument("--site", required=True, help="this site's name in the run config")
    parser.add_argument("--tls", nargs=3, type=Path, metavar=("CERT", "KEY", "CA"))
    parser.add_argument("--secret", type=Path, help="site-NAME.secret (payload sealing)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--backend", help="the process group's (default: nccl on cuda, gloo on cpu)")
    args = parser.parse_args(argv)

    # [recipe]
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(args.device, local_rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(args.backend or ("nccl" if device.type == "cuda" else "gloo"))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    sync = connect(  # on every rank; geodiloco makes its gloo control group here if it needs one
        args.coordinator,
        args.site,
        tls=TlsFiles(*args.tls) if args.tls else None,  # omit both for a coordinator run with
        site_secret=load_secret(args.secret) if args.secret else None,  # --insecure on loopback
    )
    cfg = sync.config  # the run's config, as the coordinator sent it
    model = build_model(cfg).to(device)  # the same θ_0 as the coordinator's (see builders)
    ddp = DistributedDataParallel(model)  # or fully_shard / tensor parallel, applied first
    sync.attach(model)  # takes the run's current parameters if this site joins late
    optimizer = build_optimizer(model, cfg)
    data = build_data(cfg)
    # this site's share of the held-out set (by its data shard), split among its ranks
    eval_part, eval_parts = sync.shard_index + sync.shard_count * rank, sync.shard_count * world

    losses, started = [], time.perf_counter()
    while not sync.finished:
        x, labels = (t.to(device) for t in data.batch(sync.data, sync.steps_in_round, rank, world))
        loss = F.cross_entropy(ddp(x), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss))
        if not sync.step(tokens=x.shape[0]):  # True once every H steps, after the outer sync
            continue
        eval_sum, eval_count = evaluate(model, data.eval_batches(eval_part, eval_parts), device)
        # summed over the site's ranks on geodiloco's control group: host numbers, any backend
        eval_sum, eval_count, loss_sum = sync.sum_over_ranks(eval_sum, eval_count, sum(losses) / len(losses))
        sync.report(eval_sum, int(eval_count), loss_sum / world, time.perf_counter() - started)
        if rank == 0:
            print(f"round {sync.round - 1}: eval loss {eval_sum / eval_count:.4f}", flush=True)
        losses, started = [], time.perf_counter()
    sync.close()
    del ddp
    dist.barrier()  # leave together, before DDP's reducer is torn down at exit
    dist.destroy_process_group()
    # [/recipe]


if __name__ == "__main__":
    main()
