"""Per-model parallel plans: a Llama's decoder layers split head-aware across tensor-parallel
ranks give the unsplit model's logits and train; FSDP2 wraps each decoder layer; models
without a plan, and head counts tp does not divide, are refused by name."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from geodiloco.params import flatten_parameters
from geodiloco.site.parallel import plans
from geodiloco.site.parallel.layout import LayoutError, ParallelConfig, build_mesh, parallelize
from geodiloco.site.shards import ShardMap
from geodiloco.testing.rank_pool import RankPool
from geodiloco.testing.servers import free_port
from geodiloco.workload.hf import tiny_llama
from geodiloco.workload.model import GPTConfig
from geodiloco.workload.model import build_model as build_gpt


def test_blocks_are_the_reference_blocks_or_a_transformers_models_decoder_layers() -> None:
    llama = tiny_llama(0)
    assert plans.blocks(llama) == list(llama.model.layers)
    gpt = build_gpt(GPTConfig(n_layer=2, d_model=32, n_head=2, seq_len=16), seed=0)
    assert plans.blocks(gpt) == list(gpt.blocks)  # type: ignore[arg-type]
    assert plans.blocks(nn.Linear(2, 2)) == []


def test_the_plan_follows_the_structure_and_refuses_what_it_cannot_split() -> None:
    llama = tiny_llama(0)
    ((_, plan), _) = plans.tensor_parallel_plans(llama, 2)
    assert sorted(plan) == [
        "mlp.down_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "self_attn.k_proj",
        "self_attn.o_proj",
        "self_attn.q_proj",
        "self_attn.v_proj",
    ]
    gpt = build_gpt(GPTConfig(n_layer=1, d_model=32, n_head=2, seq_len=16), seed=0)
    assert sorted(plans.tensor_parallel_plans(gpt, 2)[0][1]) == ["fc", "out"]  # attention replicated
    with pytest.raises(LayoutError, match=r"tp=4 must divide the attention's 4 query heads and 2 key/value"):
        plans.tensor_parallel_plans(llama, 4)
    with pytest.raises(LayoutError, match=r"^tensor parallel: Sequential has no blocks to split"):
        plans.tensor_parallel_plans(nn.Sequential(nn.Linear(2, 2)), 2)


def _rank_main(rank: int, world: int, port: int, layout: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        whole, model = tiny_llama(3), tiny_llama(3)
        flat = flatten_parameters(model)
        config = ParallelConfig.parse(layout, world)
        trained = parallelize(model, config, build_mesh(config, "cpu"))
        x = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            want, got = whole(x).logits, trained(x).logits
        q = model.model.layers[0].self_attn.q_proj.weight
        o = model.model.layers[0].self_attn.o_proj.weight
        loss = torch.nn.functional.cross_entropy(trained(x).logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        shards = ShardMap(model, rank, world)
        out.put(
            {
                "rank": rank,
                "close": bool(torch.allclose(want, got, atol=1e-5)),
                "q": (type(q).__name__, tuple(q.to_local().shape) if isinstance(q, DTensor) else None),
                "o": tuple(o.to_local().shape) if isinstance(o, DTensor) else None,
                "grad": all(p.grad is not None for p in model.parameters()),
                "owned": [p for s in shards.owned for p in s.segment.positions().tolist()],
                "num_params": flat.numel(),
                "fsdp_units": sum(type(m).__name__.startswith("FSDP") for m in model.modules()),
            }
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.parametrize(("layout", "world"), [("tp", 2), ("fsdp", 2)])
def test_a_llama_split_by_its_plan_gives_the_same_logits_and_owns_each_element_once(
    rank_pool: RankPool, layout: str, world: int
) -> None:
    port = free_port()
    ranks = [(r, world, port, layout) for r in range(world)]
    results = sorted(rank_pool.run(_rank_main, ranks, timeout=180), key=lambda r: r["rank"])
    assert all(r["close"] and r["grad"] for r in results)
    owned = sorted(i for r in results for i in r["owned"])
    assert owned == list(range(results[0]["num_params"]))  # disjoint, and together everything
    if layout == "tp":  # 4 query heads of 8 dims: 2 whole heads per rank; o_proj split by rows
        assert all(r["q"] == ("DTensor", (16, 32)) and r["o"] == (32, 16) for r in results)
    else:  # one FSDP2 unit per decoder layer, and the root
        assert all(r["fsdp_units"] == 3 for r in results)
