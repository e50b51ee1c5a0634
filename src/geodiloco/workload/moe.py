"""The reference model with mixture-of-experts MLPs (``model.experts`` > 0).

Every block's MLP becomes ``experts`` MLPs and a router: each token goes to its ``top_k``
experts by router probability, and their outputs are mixed with those probabilities
(renormalised over the chosen ones). A load-balancing loss (Switch Transformer's
``E * sum_e f_e * P_e``: the share of routed tokens ``f_e`` times the mean router probability
``P_e``) keeps the router from sending everything to a few experts.

Experts are stacked parameters, ``w_in [E, d, hidden]`` and ``w_out [E, hidden, d]``, so the
canonical parameter list is the same whatever a site does with them; expert parallelism
(:mod:`geodiloco.site.parallel.experts`) shards them on dim 0, which makes a rank's experts one contiguous
range of the canonical vector.

The load-balancing loss enters through the gradient: the logits carry it backwards, so it is
trained whatever ``workload.loss`` scores the logits with (the default cross-entropy, or
``model(idx, targets)``), while the reported loss stays the language-modelling loss, comparable
with a dense model's.

An expert that no token of a step reached does not move in that step (:func:`hold_unreached`):
without it, AdamW's momentum and weight decay would move it anyway, and a site would push a
pseudo-gradient for an expert it never trained. With it, an expert no token of a site reached in
a whole round has a pseudo-gradient of exactly zero there, and the coordinator's token-weighted
mean counts that site's tokens as tokens that chose other experts, as the gradient of a
synchronous data-parallel step over all sites' tokens would.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from geodiloco.workload.model import VOCAB_SIZE, CausalSelfAttention

if TYPE_CHECKING:
    from geodiloco.config import ModelConfig


class Dispatch(Protocol):
    """How tokens reach experts held elsewhere (:class:`geodiloco.site.parallel.experts.AllToAll`)."""

    def __call__(self, experts: GroupedExperts, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Outputs for ``tokens`` sorted by expert, ``counts[e]`` of them for expert ``e``."""
        ...

    def set_training(self, experts: GroupedExperts, training: bool) -> None:
        """Called on every rank together when ``experts`` switches between train and eval mode."""
        ...


class GroupedExperts(nn.Module):
    """``E`` two-layer MLPs as stacked weights. ``dispatch`` (set by expert parallelism) sends
    tokens to the rank holding their expert and back; without it every expert is local."""

    def __init__(self, experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(experts, d_model, hidden))
        self.w_out = nn.Parameter(torch.empty(experts, hidden, d_model))
        for w in (self.w_in, self.w_out):
            nn.init.normal_(w, std=0.02)
        self.dispatch: Dispatch | None = None

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Outputs for ``tokens`` sorted by expert, ``counts[e]`` of them for expert ``e``."""
        if self.dispatch is None:
            return self.compute(tokens, counts)
        return self.dispatch(self, tokens, counts)

    def train(self, mode: bool = True) -> GroupedExperts:
        if self.dispatch is not None and mode != self.training:
            self.dispatch.set_training(self, mode)
        return super().train(mode)

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The weights of the experts this rank holds (all of them without expert parallelism)."""
        return _expert_rows(self.w_in), _expert_rows(self.w_out)

    def compute(
        self,
        tokens: torch.Tensor,
        counts: torch.Tensor,
        weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Experts on their tokens (sorted by expert, ``counts`` each): this rank's own, or
        those of ``weights``."""
        w_in, w_out = self.local_weights() if weights is None else weights
        outs = [
            F.gelu(chunk @ w_in[e].to(chunk.dtype)) @ w_out[e].to(chunk.dtype)
            for e, chunk in enumerate(tokens.split(counts.tolist()))
        ]
        return torch.cat(outs)


class MoE(nn.Module):
    """A router and its experts, in place of a block's MLP."""

    def __init__(self, d_model: int, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(d_model, experts, bias=False)
        self.experts = GroupedExperts(experts, d_model, hidden)
        self.aux_loss: torch.Tensor = torch.zeros(())  # of the last forward, not weighted
        self.counts: torch.Tensor = torch.zeros(experts, dtype=torch.long)  # tokens per expert, last forward

    @property
    def num_experts(self) -> int:
        return self.router.out_features

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For tokens ``x [N, d]``: chosen experts ``[N, k]``, their mixing weights ``[N, k]`` and
        the load-balancing loss."""
        probs = self.router(x).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        counts = torch.bincount(chosen.flatten(), minlength=self.num_experts)
        share = counts.to(probs.dtype) / chosen.numel()
        aux = self.num_experts * (share * probs.mean(dim=0)).sum()
        self.counts = counts.detach()
        return chosen, weights, aux

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        chosen, weights, self.aux_loss = self.route(x)
        # one row per (token, choice), grouped by expert; stable, so that the order is reproducible
        order = chosen.flatten().argsort(stable=True)
        routed = self.experts(x[order // self.top_k], self.counts)
        mixed = routed[order.argsort()].view(-1, self.top_k, shape[-1])
        out = (mixed * weights.unsqueeze(-1).to(mixed.dtype)).sum(dim=1)
        return out.view(shape)


class MoEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.moe = MoE(cfg.d_model, 4 * cfg.d_model, cfg.experts, cfg.top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class _CarryLoss(torch.autograd.Function):
    """Identity on ``x`` whose backward also sends a gradient of 1 into ``loss``: the loss is
    minimised with whatever loss the caller computes from ``x``, once per forward (as if added
    to that forward's loss; data parallelism averages it over ranks like the rest)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.loss_shape = loss.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.new_ones(ctx.loss_shape, dtype=torch.float32)


class MoEGPT(nn.Module):
    """The byte-level GPT of :mod:`geodiloco.workload.model` with mixture-of-experts MLPs."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.experts < 2:
            raise ValueError(f"model.experts must be >= 2 for a mixture of experts, got {cfg.experts}")
        self.cfg = cfg
        self.aux_loss_weight = cfg.aux_loss_weight
        self.tok = nn.Embedding(VOCAB_SIZE, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        small = 0.02 / math.sqrt(2 * cfg.n_layer)  # residual projections, as in the dense model
        for name, p in self.named_parameters():
            if p.dim() == 1:  # layer norms' weights, and biases
                nn.init.ones_(p) if name.endswith(".weight") else nn.init.zeros_(p)
                continue
            std = small if name.endswith(("proj.weight", "w_out")) else 0.02
            nn.init.normal_(p, std=std)

    def moe_layers(self) -> list[MoE]:
        return [m for m in self.modules() if isinstance(m, MoE)]

    def aux_loss(self) -> torch.Tensor:
        """The weighted load-balancing loss of the last forward (summed over blocks)."""
        return self.aux_loss_weight * torch.stack([m.aux_loss for m in self.moe_layers()]).sum()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ``idx``, or the mean cross-entropy when ``targets`` is given; either way
        the backward pass also trains the load-balancing loss."""
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.ln_f(x) @ self.tok.weight.T
        aux = self.aux_loss()
        if torch.is_grad_enabled() and aux.requires_grad and self.aux_loss_weight:
            logits = _CarryLoss.apply(logits, aux)
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))


def build_moe(cfg: ModelConfig, seed: int) -> MoEGPT:
    """The same seed gives bit-identical parameters on every site (CPU)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return MoEGPT(cfg)


def _expert_rows(p: torch.Tensor) -> torch.Tensor:
    """The rows (experts) of a stacked expert parameter this rank holds, as a plain tensor."""
    # Imported here: at module level it would add DTensor's imports (sympy among them, 40 MB
    # and 0.25 s) to every process that reads the reference workload, the coordinator included.
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def hold_unreached(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Keep experts whose gradient is exactly zero in a step (no token reached them) where they
    were before ``optimizer``'s step; returns the number of expert parameters watched.

    Reached is read from the gradient itself, which every replica of an expert holds the same
    after the gradient reduction (DDP, FSDP2, expert parallel), so replicas decide alike with no
    extra collective, and each rank decides only for the experts it holds."""
    params = [p for m in model.modules() if isinstance(m, GroupedExperts) for p in (m.w_in, m.w_out)]
    held: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def before(*_: Any) -> None:
        held.clear()
        for p in params:
            rows = _expert_rows(p)
            grad = None if p.grad is None else _expert_rows(p.grad)
            idle = (
                torch.ones(rows.shape[0], dtype=torch.bool, device=rows.device)
                if grad is None
                else (grad.flatten(1) == 0).all(dim=1)
            )
            if bool(idle.any()):
                held.append((rows, idle, rows.detach()[idle].clone()))

    @torch.no_grad()
    def after(*_: Any) -> None:
        for rows, idle, saved in held:
            rows[idle] = saved
        held.clear()

    if params:
        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)
    return len(params)
