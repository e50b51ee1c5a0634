"""Activation checkpointing and compile per block: the layout keys are checked by name, the
checkpointed steps keep the plain layout's arithmetic (bit-identical parameters, for the reference
model and a Hugging Face Llama, alone and under FSDP2 and pipeline stages over gloo ranks), each
mode recomputes what it says, and a compiled model's losses follow the plain one's."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from geodiloco.config import InnerConfig
from geodiloco.params import flatten_parameters
from geodiloco.site.parallel.layout import (
    LayoutError,
    ParallelConfig,
    build_mesh,
    data_parallel_rank,
    layout_summary,
    parallelize,
)
from geodiloco.site.parallel.per_block import (
    apply_activation_checkpointing,
    apply_block_options,
    apply_compile,
)
from geodiloco.testing.rank_pool import RankPool
from geodiloco.testing.servers import free_port
from geodiloco.workload import GPTConfig, build_model
from geodiloco.workload.loss import cross_entropy
from geodiloco.workload.steps import inner_step

MODEL = GPTConfig(n_layer=2, n_head=2, d_model=16, seq_len=8)
MODES = ("none", "block", "selective")
INNER = InnerConfig(lr=1e-2, weight_decay=0.01, grad_clip=1.0)


def batches(n: int, seq_len: int = MODEL.seq_len, rows: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    windows = [torch.randint(0, 256, (rows, seq_len + 1), generator=g) for _ in range(n)]
    return [(w[:, :-1], w[:, 1:]) for w in windows]


def train(model: nn.Module, trained: nn.Module, steps: int = 3) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for batch in batches(steps):
        loss = cross_entropy(trained, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def test_the_layout_keys_are_checked_by_name() -> None:
    config = ParallelConfig.parse("ddp", 1, activation_checkpointing="selective", compile=True)
    assert (config.activation_checkpointing, config.compile) == ("selective", True)
    assert "activation checkpointing selective, compiled blocks" in layout_summary(config)
    assert ParallelConfig.parse("fsdp", 2) == ParallelConfig(dp_shard=2)  # defaults: none, not compiled
    accepted = "is not one of none, block, selective"
    with pytest.raises(LayoutError, match=rf"parallel\.activation_checkpointing: 'full' {accepted}"):
        ParallelConfig(activation_checkpointing="full")
    with pytest.raises(LayoutError, match=r"parallel\.compile: expected true or false, got 'yes'"):
        ParallelConfig(compile="yes")  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match=r"parallel\.activation_checkpointing: 'op'"):
        apply_activation_checkpointing(build_model(MODEL, seed=0), "op")
    with pytest.raises(LayoutError, match=r"parallel\.compile: Linear has no blocks"):
        apply_compile(nn.Linear(2, 2))


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run under it (by name, overload dropped)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def backward_ops(mode: str) -> Counter[str]:
    model = build_model(MODEL, seed=0)
    apply_activation_checkpointing(model, mode)
    loss = cross_entropy(model, batches(1)[0])
    with OpCounter() as counter:
        loss.backward()
    return counter.ops


def test_each_mode_recomputes_what_it_says() -> None:
    plain, block, selective = (backward_ops(mode) for mode in MODES)
    layers = MODEL.n_layer
    assert plain["gelu"] == 0 and plain["native_layer_norm"] == 0  # nothing recomputed
    # block: every block's forward again, matmuls and attention included
    assert block["gelu"] == layers and block["native_layer_norm"] == 2 * layers
    # (qkv, proj and fc: out's output feeds no backward, and recomputation stops when it has all it needs)
    assert plain["addmm"] == 0 and block["addmm"] == 3 * layers
    assert block["_scaled_dot_product_flash_attention_for_cpu"] == layers
    # selective: norms and the activation again, the matmuls' and attention's outputs kept
    assert selective["gelu"] == layers and selective["native_layer_norm"] == 2 * layers
    assert selective["addmm"] == 0
    assert selective["_scaled_dot_product_flash_attention_for_cpu"] == 0


@pytest.mark.parametrize("mode", MODES[1:])
def test_checkpointing_keeps_the_plain_arithmetic(mode: str) -> None:
    plain = build_model(MODEL, seed=0)
    plain_losses = train(plain, plain)
    model = build_model(MODEL, seed=0)
    names = [n for n, _ in model.named_parameters()]
    assert apply_activation_checkpointing(model, mode) == MODEL.n_layer
    assert train(model, model) == plain_losses
    assert [n for n, _ in model.named_parameters()] == names  # nothing renamed
    assert torch.equal(flatten_parameters(model), flatten_parameters(plain))  # bit for bit
    with torch.no_grad():  # evaluation runs the plain forward
        assert torch.equal(model(batches(1)[0][0]), plain(batches(1)[0][0]))


@pytest.mark.parametrize("mode", MODES[1:])
def test_a_hugging_face_llama_checkpoints_its_decoder_layers(mode: str) -> None:
    pytest.importorskip("transformers")  # the hf extra: installed by make setup
    from geodiloco.workload.hf import tiny_llama

    plain = tiny_llama(seed=0)
    plain_losses = train(plain, plain)
    model = tiny_llama(seed=0)
    assert apply_activation_checkpointing(model, mode) == 2  # its two decoder layers
    assert not model.config.use_cache  # recomputing a layer would append to the key/value cache again
    assert train(model, model) == plain_losses
    assert torch.equal(flatten_parameters(model), flatten_parameters(plain))


def _rank_main(rank: int, world: int, port: int, layout: str, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result: dict[str, Any] = {"rank": rank}
        for mode in MODES:
            config = ParallelConfig.parse(layout, world, activation_checkpointing=mode)
            mesh = build_mesh(config, "cpu")
            model = build_model(MODEL, seed=0)
            trained = parallelize(model, config, mesh)
            dp = config.data_parallel
            mine = batches(2 * dp)[data_parallel_rank(mesh) :: dp]
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            losses = [
                inner_step(trained, optimizer, INNER, step, *batch, loss_fn=cross_entropy)
                for step, batch in enumerate(mine)
            ]
            local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
            result[mode] = (losses, torch.cat([t.detach().flatten() for t in local]).tolist())
        out.put(result)
    finally:
        dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.parametrize("layout", ["fsdp", "pp=2"])
def test_checkpointed_blocks_under_fsdp2_and_stages_match_the_plain_layout(
    rank_pool: RankPool, layout: str
) -> None:
    world = 2
    port = free_port()
    results = rank_pool.run(_rank_main, [(r, world, port, layout) for r in range(world)], timeout=180)
    for r in results:
        losses, params = r["none"]
        assert all(x == x for x in losses) and params  # trained
        for mode in MODES[1:]:
            assert r[mode] == (losses, params), (r["rank"], mode)  # bit for bit


@pytest.mark.slow
def test_compiled_blocks_follow_the_plain_losses() -> None:
    plain = build_model(MODEL, seed=0)
    plain_losses = train(plain, plain, steps=6)
    model = build_model(MODEL, seed=0)
    names = [n for n, _ in model.named_parameters()]
    apply_block_options(model, ParallelConfig(activation_checkpointing="selective", compile=True))
    losses = train(model, model, steps=6)
    assert [n for n, _ in model.named_parameters()] == names  # compiled in place: nothing renamed
    assert not any("_orig_mod" in key for key in model.state_dict())
    # other kernels (fused, reordered): the same curve within rounding, not bit for bit
    assert losses == pytest.approx(plain_losses, rel=1e-4)
    assert torch.allclose(flatten_parameters(model), flatten_parameters(plain), atol=1e-4)
