"""The mixture-of-experts reference model: routing, the load-balancing loss, gradients, and
experts that no token reached."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from geodiloco.config import ConfigError, ModelConfig, RunConfig
from geodiloco.workload.loss import cross_entropy, model_loss
from geodiloco.workload.moe import MoE, MoEGPT, build_moe, hold_unreached
from geodiloco.workload.reference import build_model, build_optimizer

CFG = ModelConfig(n_layer=2, n_head=2, d_model=16, seq_len=8, experts=4, top_k=2, aux_loss_weight=0.1)


def batch(seed: int = 0, rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(0, 256, (rows, CFG.seq_len + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def test_config_fields_are_validated_by_name() -> None:
    cfg = RunConfig.from_dict({"model": {"experts": 4, "top_k": 1, "aux_loss_weight": 0.02}})
    assert (cfg.model.experts, cfg.model.top_k, cfg.model.aux_loss_weight) == (4, 1, 0.02)
    assert RunConfig.from_json(cfg.to_json()).model == cfg.model
    for bad, field in [
        ({"experts": 1}, "model.experts"),
        ({"experts": 4, "top_k": 5}, "model.top_k"),
        ({"top_k": 0}, "model.top_k"),
        ({"aux_loss_weight": -1.0}, "model.aux_loss_weight"),
    ]:
        with pytest.raises(ConfigError, match=field):
            RunConfig.from_dict({"model": bad})
    with pytest.raises(ConfigError, match=r"model\.experts: is read only by the reference model"):
        RunConfig.from_dict({"model": {"experts": 4}, "workload": {"model": "mine.models:build"}})


def test_reference_builder_makes_the_moe_model_reproducibly() -> None:
    cfg = RunConfig.from_dict({"model": {"n_layer": 1, "d_model": 16, "n_head": 2, "experts": 4}})
    a, b = build_model(cfg), build_model(cfg)
    assert isinstance(a, MoEGPT)
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(p, q), name
    shapes = {n: tuple(p.shape) for n, p in a.named_parameters()}
    assert shapes["blocks.0.moe.experts.w_in"] == (4, 16, 64)
    assert shapes["blocks.0.moe.experts.w_out"] == (4, 64, 16)
    assert shapes["blocks.0.moe.router.weight"] == (4, 16)


def test_routing_picks_top_k_and_mixes_with_renormalised_weights() -> None:
    torch.manual_seed(0)
    layer = MoE(d_model=8, hidden=16, experts=4, top_k=2)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(5, 7, 8)
    out = layer(x)
    assert out.shape == x.shape
    assert int(layer.counts.sum()) == 5 * 7 * 2  # every token reached two experts
    # the same layer computed token by token, expert by expert
    flat = x.reshape(-1, 8)
    probs = layer.router(flat).softmax(-1)
    top, chosen = probs.topk(2, dim=-1)
    expected = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(2):
            e = int(chosen[t, j])
            h = F.gelu(flat[t] @ layer.experts.w_in[e]) @ layer.experts.w_out[e]
            expected[t] += top[t, j] / top[t].sum() * h
    torch.testing.assert_close(out.reshape(-1, 8), expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(layer.counts, torch.bincount(chosen.flatten(), minlength=4))


def test_aux_loss_is_one_when_balanced_and_grows_with_imbalance() -> None:
    layer = MoE(d_model=4, hidden=8, experts=4, top_k=1)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4) * 10)
    balanced = torch.eye(4).repeat(8, 1)  # each expert chosen by a quarter of the tokens
    layer(balanced)
    assert float(layer.aux_loss.detach()) == pytest.approx(1.0, abs=1e-3)
    layer(torch.eye(4)[:1].repeat(32, 1))  # every token to expert 0
    assert float(layer.aux_loss.detach()) == pytest.approx(4.0, abs=1e-2)


def test_aux_loss_is_trained_whatever_loss_scores_the_logits() -> None:
    idx, targets = batch()
    model = build_moe(CFG, seed=3)
    explicit = build_moe(CFG, seed=3)
    explicit.aux_loss_weight = 0.0  # no aux gradient carried by the logits: added by hand below
    cross_entropy(model, (idx, targets)).backward()
    logits = explicit(idx)
    lm = F.cross_entropy(logits.reshape(-1, 256), targets.reshape(-1))
    loss = lm + CFG.aux_loss_weight * torch.stack([m.aux_loss for m in explicit.moe_layers()]).sum()
    loss.backward()
    for (name, p), (_, q) in zip(model.named_parameters(), explicit.named_parameters(), strict=True):
        assert p.grad is not None and q.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-8, msg=name)
    router = model.blocks[0].moe.router.weight.grad
    plain = build_moe(CFG, seed=3)
    plain.aux_loss_weight = 0.0
    cross_entropy(plain, (idx, targets)).backward()
    assert not torch.allclose(router, plain.blocks[0].moe.router.weight.grad)  # the aux term counts
    # model(idx, targets) is the language-modelling loss; its gradient carries the aux loss too
    model.zero_grad()
    value = model_loss(model, (idx, targets))
    assert float(value.detach()) == pytest.approx(float(lm.detach()), rel=1e-5)
    value.backward()
    torch.testing.assert_close(model.blocks[0].moe.router.weight.grad, router)


def test_gradients_reach_only_the_chosen_experts() -> None:
    model = build_moe(CFG, seed=1)
    idx, targets = batch(rows=1)
    idx, targets = idx[:, :1], targets[:, :1]  # one token: top_k experts per block
    cross_entropy(model, (idx, targets)).backward()
    for layer in model.moe_layers():
        chosen = layer.counts > 0
        assert int(chosen.sum()) == CFG.top_k
        for w in (layer.experts.w_in, layer.experts.w_out):
            assert w.grad is not None
            reached = w.grad.flatten(1).abs().sum(1) > 0
            assert torch.equal(reached, chosen)


def test_eval_mode_scores_without_carrying_the_aux_loss() -> None:
    model = build_moe(CFG, seed=1)
    idx, _ = batch()
    model.eval()
    with torch.no_grad():
        logits = model(idx)
    assert logits.shape == (3, CFG.seq_len, 256) and torch.isfinite(logits).all()


def test_experts_no_token_reached_keep_their_values() -> None:
    torch.manual_seed(0)
    layer = MoE(d_model=4, hidden=8, experts=4, top_k=1)
    assert layer.experts.w_in.abs().min() > 0
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4) * 10)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, weight_decay=0.1)
    assert hold_unreached(layer, optimizer) == 2
    before = [p.detach().clone() for p in (layer.experts.w_in, layer.experts.w_out)]
    layer(torch.eye(4)[:2].repeat(4, 1)).square().sum().backward()  # experts 0 and 1 only
    optimizer.step()
    optimizer.zero_grad()
    # a second step reaching only expert 0: expert 1 is not moved by its momentum either
    layer(torch.eye(4)[:1].repeat(4, 1)).square().sum().backward()
    optimizer.step()
    for old, p in zip(before, (layer.experts.w_in, layer.experts.w_out), strict=True):
        assert not torch.equal(p[0], old[0])
        assert torch.equal(p[2:], old[2:])  # never reached: bit for bit
        assert not torch.equal(p[1], old[1])  # moved in step one only


def test_without_the_hold_adamw_moves_unreached_experts() -> None:
    # why hold_unreached exists: weight decay and momentum move an expert with a zero gradient
    torch.manual_seed(0)
    layer = MoE(d_model=4, hidden=8, experts=4, top_k=1)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4) * 10)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, weight_decay=0.1)
    before = layer.experts.w_in.detach().clone()
    layer(torch.eye(4)[:1].repeat(4, 1)).square().sum().backward()
    optimizer.step()
    assert not torch.equal(layer.experts.w_in[3], before[3])


def test_reference_optimizer_holds_unreached_experts() -> None:
    cfg = RunConfig.from_dict({"model": {"n_layer": 1, "d_model": 16, "n_head": 2, "experts": 4}})
    model = build_model(cfg)
    optimizer = build_optimizer(model, cfg)
    assert optimizer._optimizer_step_pre_hooks and optimizer._optimizer_step_post_hooks


def test_the_reference_workload_leaves_dtensor_unimported() -> None:
    """The coordinator reads the reference workload to build θ_0 and the data's shard sizes;
    DTensor's imports (sympy among them) would add about 40 MB to its memory for nothing."""
    code = (
        "import sys, geodiloco.coordinator.edge.server, geodiloco.workload.reference; "
        "print(sorted(m for m in ('sympy', 'torch.distributed.tensor') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
