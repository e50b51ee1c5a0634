"""Pipeline stages: the reference model cut into stages keeps canonical names and offsets, every
element has one owner in the site, and a 1F1B step gives the gradients of the whole model.

The split and the ownership are checked on plain tensors for every stage and data-parallel
rank; the schedule runs for real in gloo processes (pp=2; pp=2 with FSDP2 or DDP over 4 ranks)
and is compared with the unsplit model on the same batch.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from geodiloco.params import canonical_parameters, flatten_parameters, state_hash
from geodiloco.site.parallel.layout import (
    LayoutError,
    ParallelConfig,
    build_mesh,
    data_parallel_rank,
    parallelize,
)
from geodiloco.site.parallel.pipeline_stages import Pipelined, split_model, stage_blocks
from geodiloco.site.shards import PLACEMENT_ATTR, ShardMap, StagePlacement, replica_groups, stage_placement
from geodiloco.testing.rank_pool import RankPool
from geodiloco.testing.servers import free_port
from geodiloco.workload import GPTConfig, build_model
from geodiloco.workload.loss import cross_entropy
from geodiloco.workload.steps import evaluate_batches

MODEL = GPTConfig(n_layer=3, n_head=2, d_model=16, seq_len=8)


def test_layout_spec_takes_pp_and_refuses_what_it_cannot_build() -> None:
    config = ParallelConfig.parse("pp=2,dp_shard=2", 4)
    assert (config.pp, config.dp_shard, config.data_parallel, config.name) == (2, 2, 2, "pp+fsdp")
    assert ParallelConfig.parse("pp=2", 2).name == "pp"
    assert ParallelConfig.parse("pp=2,dp_replicate=2,microbatches=4", 4).stage_microbatches == 4
    with pytest.raises(LayoutError, match="must equal the site's 4 ranks"):
        ParallelConfig.parse("pp=3", 4)
    with pytest.raises(LayoutError, match="pp and tp"):
        ParallelConfig.parse("pp=2,tp=2", 4)
    with pytest.raises(LayoutError, match="microbatches=1 must be at least pp=2"):
        ParallelConfig.parse("pp=2,microbatches=1", 2)
    with pytest.raises(LayoutError, match="bf16 is not supported with pipeline stages"):
        ParallelConfig.parse("pp=2", 2, "bf16")
    with pytest.raises(LayoutError, match="microbatches"):
        ParallelConfig.parse("pp=2,micro=2", 2)


def test_stages_split_the_blocks_in_order() -> None:
    for blocks, stages in ((3, 2), (4, 4), (5, 3)):
        split = [list(stage_blocks(blocks, stages, s)) for s in range(stages)]
        assert [b for part in split for b in part] == list(range(blocks)) and all(split)


@pytest.mark.parametrize(("stages", "dp"), [(2, 1), (3, 1), (2, 3)])
def test_stage_ranks_own_every_element_once_and_in_place(stages: int, dp: int) -> None:
    flat = flatten_parameters(build_model(MODEL, seed=0))
    owned: list[int] = []
    held: set[str] = set()
    for stage in range(stages):
        model = build_model(MODEL, seed=0)
        module, placement = split_model(model, stage, stages)
        assert [n for n, _ in canonical_parameters(module)] == [n for n, _ in canonical_parameters(model)]
        held |= {n for n, _ in canonical_parameters(model)}
        for dp_index in range(dp):
            setattr(
                model,
                PLACEMENT_ATTR,
                StagePlacement(placement.canonical, placement.holders, stage, dp_index, dp),
            )
            shards = ShardMap(model, 0, 1)
            assert shards.num_params == flat.numel()  # offsets of the whole model
            targets = [torch.zeros_like(p.local) for p in shards.pieces]
            assert shards.scatter_range(0, flat, targets) == shards.local_numel < flat.numel()
            assert all(torch.equal(t, p.local) for t, p in zip(targets, shards.pieces, strict=True))
            owned += [i for o in shards.owned for i in o.segment.positions().tolist()]
            assert torch.equal(
                shards.gather_owned(), flat[[i for o in shards.owned for i in o.segment.positions()]]
            )
    assert sorted(owned) == list(range(flat.numel()))  # tok.weight: first and last stage share it
    assert held == {n for n, _ in canonical_parameters(build_model(MODEL, seed=0))}


def test_the_stages_compose_to_the_model() -> None:
    reference = build_model(MODEL, seed=0)
    x = torch.randint(0, 256, (2, MODEL.seq_len))
    out = x
    for stage in range(3):
        module, _ = split_model(build_model(MODEL, seed=0), stage, 3)
        out = module(out)
    assert torch.allclose(out, reference(x), atol=1e-6)


def _rank_main(rank: int, world: int, port: int, layout: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        batches = [torch.randint(0, 256, (4, MODEL.seq_len + 1)) for _ in range(2)]  # one per dp rank
        reference = build_model(MODEL, seed=0)
        flat = flatten_parameters(reference)
        config = ParallelConfig.parse(layout, world)
        mesh = build_mesh(config)
        model = build_model(MODEL, seed=0)
        trained = parallelize(model, config, mesh)
        assert isinstance(trained, Pipelined)
        dp_rank = data_parallel_rank(mesh)
        mine = batches[dp_rank]
        loss = trained.train_step((mine[:, :-1], mine[:, 1:]), cross_entropy)
        # the unsplit model on the data-parallel ranks' batches: the same mean loss and gradients
        used = torch.cat(batches[: config.data_parallel])
        ref_loss = cross_entropy(reference, (used[:, :-1], used[:, 1:]))
        ref_loss.backward()
        ref_grads = dict(canonical_parameters(reference))
        grads_ok = all(
            torch.allclose(
                p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad,
                ref_grads[name].grad,
                atol=1e-6,
            )
            for name, p in canonical_parameters(model)
        )
        mine_ref = float(cross_entropy(reference, (mine[:, :-1], mine[:, 1:])))
        logits = trained(mine[:, :-1])  # forward: the last stage's logits on every stage
        eval_sum, eval_rows = evaluate_batches(trained, [(mine[:, :-1], mine[:, 1:])], cross_entropy)
        shards = ShardMap(model, rank, world)
        # the checkpoint's sum over replicas: ones where a rank owns, added up, are ones everywhere
        parts = [torch.zeros_like(p.local) for p in shards.pieces]
        for _, view in shards.owned_views(parts):
            view.fill_(1.0)
        placement = stage_placement(model)
        for (name, p), part in zip(canonical_parameters(model), parts, strict=True):
            for group in replica_groups(name, p, placement):
                dist.all_reduce(part, group=group)
        with pytest.raises(TypeError, match="one input"):
            trained(mine[:, :-1], mine[:, 1:])  # a model_loss-style call, refused on every stage
        out.put(
            {
                "rank": rank,
                "loss": float(loss),
                "mine_ref": mine_ref,
                "grads_ok": grads_ok,
                "logits_ok": torch.allclose(logits, reference(mine[:, :-1]), atol=1e-5),
                "eval": (eval_sum, eval_rows),
                "owned": [p for o in shards.owned for p in o.segment.positions().tolist()],
                "owned_ok": torch.equal(
                    shards.gather_owned(), flat[[i for o in shards.owned for i in o.segment.positions()]]
                ),
                "replicas_ok": all(bool((part == 1).all()) for part in parts),
                "local": shards.local_numel,
                "num_params": shards.num_params,
                "hash": state_hash(flat),
            }
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.parametrize(
    ("layout", "world"), [("pp=2", 2), ("pp=2,dp_shard=2", 4), ("pp=2,dp_replicate=2", 4)]
)
def test_a_pipeline_step_gives_the_whole_models_gradients(
    rank_pool: RankPool, layout: str, world: int
) -> None:
    port = free_port()
    ranks = [(r, world, port, layout) for r in range(world)]
    results = sorted(rank_pool.run(_rank_main, ranks, timeout=180), key=lambda r: r["rank"])
    n = results[0]["num_params"]
    assert sorted(i for r in results for i in r["owned"]) == list(range(n))  # each element once
    for r in results:
        assert r["owned_ok"] and r["replicas_ok"] and r["local"] < n and r["grads_ok"] and r["logits_ok"], r[
            "rank"
        ]
        assert r["loss"] == pytest.approx(r["mine_ref"], abs=1e-5)  # every stage reports the loss
    counted = [r["eval"] for r in results if r["eval"][1]]
    assert len(counted) == world // 2  # one stage of each pipeline counts its batch
    assert all(
        s / rows == pytest.approx(r, abs=1e-5)
        for (s, rows), r in zip(counted, [x["mine_ref"] for x in results if x["eval"][1]], strict=True)
    )
