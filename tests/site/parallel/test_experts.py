"""Expert parallelism over real gloo process groups: tokens reach their experts on other ranks
and come back, gradients match one process training on every rank's batch, each expert
element is owned by exactly one rank for the outer sync, and a DCP checkpoint of the sharded
experts loads into a model held whole."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from geodiloco.config import ConfigError, ModelConfig
from geodiloco.params import flatten_parameters
from geodiloco.site.parallel.experts import _source_to_expert_order, apply_expert_parallel
from geodiloco.site.parallel.layout import LayoutError, ParallelConfig, build_mesh, parallelize
from geodiloco.site.shards import ShardMap
from geodiloco.testing.rank_pool import RankPool
from geodiloco.testing.servers import free_port
from geodiloco.workload.loss import cross_entropy
from geodiloco.workload.model import build_model
from geodiloco.workload.moe import build_moe, hold_unreached
from geodiloco.workload.steps import evaluate_batches

MODEL = ModelConfig(n_layer=1, n_head=2, d_model=16, seq_len=8, experts=4, top_k=2, aux_loss_weight=0.1)


def rank_batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    w = torch.randint(0, 256, (2, MODEL.seq_len + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def test_received_rows_are_regrouped_by_local_expert() -> None:
    # two sources, two local experts: rows arrive as (s0 e0: 2, s0 e1: 1, s1 e0: 1, s1 e1: 3)
    by_source = torch.tensor([[2, 1], [1, 3]])
    order = _source_to_expert_order(by_source)
    assert order.tolist() == [0, 1, 3, 2, 4, 5, 6]  # e0: s0's two, s1's one; then e1's rows


def test_layouts_with_experts_parse_and_refuse_by_name() -> None:
    assert ParallelConfig.parse("ep", 2) == ParallelConfig(dp_replicate=2, ep=2)
    config = ParallelConfig.parse("dp_replicate=4,ep=2", 4)
    assert (config.ep, config.data_parallel, config.name) == (2, 4, "ep")
    with pytest.raises(LayoutError, match="ep 3 must divide the 4 data-parallel ranks"):
        ParallelConfig.parse("dp_replicate=4,ep=3", 4)
    with pytest.raises(LayoutError, match="composes with dp_replicate"):
        ParallelConfig.parse("dp_shard=2,ep=2", 2)
    with pytest.raises(LayoutError, match="ep=N"):
        ParallelConfig.parse("experts=2", 2)


def test_a_dense_model_under_ep_is_a_config_error_naming_the_setting() -> None:
    dense = build_model(ModelConfig(n_layer=1, n_head=2, d_model=16, seq_len=8), seed=0)
    with pytest.raises(ConfigError, match=r"ep > 1 needs a mixture-of-experts model \(set model\.experts\)"):
        apply_expert_parallel(dense, cast(DeviceMesh, None), data_parallel=2)  # refused before any mesh


def _rank_main(rank: int, world: int, port: int, layout: str, ckpt: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build_moe(MODEL, seed=0)
        config = ParallelConfig.parse(layout, world)
        trained = parallelize(model, config, build_mesh(config, "cpu"))
        loss = cross_entropy(trained, rank_batch(rank))
        loss.backward()
        grads = {
            name: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).tolist()
            for name, p in model.named_parameters()
            if p.grad is not None
        }
        with torch.no_grad():
            trained_logits = trained(rank_batch(rank)[0])
        # eval mode needs no peer: ranks score different numbers of batches
        batches = [rank_batch(rank)] * (rank + 1)
        eval_sum, eval_rows = evaluate_batches(trained, batches, cross_entropy)
        with torch.no_grad():
            trained.eval()
            eval_logits = trained(rank_batch(rank)[0])
            trained.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        hold_unreached(model, optimizer)
        optimizer.step()  # a step on the sharded experts
        model_state, _ = get_state_dict(model, optimizer)
        dcp.save({"model": model_state}, checkpoint_id=ckpt)
        stepped = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).tolist()
            for n, p in model.named_parameters()
        }
        shards = ShardMap(model, rank, world)
        out.put(
            {
                "rank": rank,
                "loss": float(loss.detach()),
                "grads": grads,
                "owned": [p for o in shards.owned for p in o.segment.positions().tolist()],
                "owned_before": shards.gather_owned([s.clone() for s in _initial_pieces(shards)]).tolist(),
                "local": shards.local_numel,
                "num_params": shards.num_params,
                "eval": (eval_sum, eval_rows),
                "logits_agree": bool(torch.allclose(trained_logits, eval_logits, atol=1e-6)),
                "stepped": stepped,
            }
        )
    finally:
        dist.destroy_process_group()


def _initial_pieces(shards: ShardMap) -> list[torch.Tensor]:
    """The pieces' values as built from the seed, laid out like the rank's pieces."""
    flat = flatten_parameters(build_moe(MODEL, seed=0))
    targets = [torch.zeros_like(p.local) for p in shards.pieces]
    shards.scatter_range(0, flat, targets)
    return targets


def _run(pool: RankPool, layout: str, world: int, ckpt: Path) -> list[dict[str, Any]]:
    port = free_port()
    ranks = [(r, world, port, layout, str(ckpt)) for r in range(world)]
    return sorted(pool.run(_rank_main, ranks, timeout=180), key=lambda r: r["rank"])


@pytest.mark.integration
@pytest.mark.parametrize(("layout", "world"), [("ep", 2), ("dp_replicate=4,ep=2", 4)])
def test_expert_parallel_matches_one_process_on_all_batches(
    rank_pool: RankPool, tmp_path: Path, layout: str, world: int
) -> None:
    results = _run(rank_pool, layout, world, tmp_path / "ckpt")
    ep = 2
    # one process, every rank's batch: the mean of the ranks' gradients, as DDP averages (each
    # backward carries its own forward's load-balancing loss, so they are taken one by one)
    reference = build_moe(MODEL, seed=0)
    losses = []
    for r in range(world):
        loss = cross_entropy(reference, rank_batch(r))
        loss.backward()
        losses.append(float(loss.detach()))
    for p in reference.parameters():
        assert p.grad is not None
        p.grad /= world
    for r, result in enumerate(results):
        assert result["loss"] == pytest.approx(losses[r], rel=1e-5)
        assert result["logits_agree"]  # eval mode (whole experts gathered) = the all-to-all path
        assert result["eval"][1] == 2 * (r + 1)
        held = r % ep  # ranks 0, 2 hold experts 0-1; ranks 1, 3 experts 2-3
        for name, p in reference.named_parameters():
            assert p.grad is not None
            expected = p.grad[2 * held : 2 * held + 2] if "experts" in name else p.grad
            got = torch.tensor(result["grads"][name])
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-7, msg=f"rank {r}: {name}")
    n = results[0]["num_params"]
    owned = [i for r in results for i in r["owned"]]
    assert sorted(owned) == list(range(n))  # each element owned once, over the whole site
    flat = flatten_parameters(build_moe(MODEL, seed=0))
    for r in results:
        assert r["owned_before"] == flat[r["owned"]].tolist()  # and where the canonical vector has it
        assert r["local"] < n  # a rank holds only its experts
    # the sharded experts' DCP checkpoint loads into one process holding the whole model
    plain = build_moe(MODEL, seed=9)
    state = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, checkpoint_id=str(tmp_path / "ckpt"))
    plain.load_state_dict(state)
    for name, p in plain.named_parameters():
        assert p.tolist() == results[0]["stepped"][name], name
