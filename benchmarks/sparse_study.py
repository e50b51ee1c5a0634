"""Where sparse outer syncs lose: DiLoCo's arithmetic in one process, for sweeps of codecs and outer rules.

Run:  nice .venv/bin/python benchmarks/sparse_study.py --rounds 12 --json runs/study.json \
          --case 'none=fp32' --case 'topk5=topk:0.05:4096|q2 ; compression.feedback_decay=0.95'

Three sites train the reference workload one after another in this process, each from the same
global θ, with its own AdamW (kept across rounds, as a site keeps it) and its own third of the
data shards (batch ``2 x data.batch_size``: a site's two ranks); each sends its pseudo-gradient
through the uplink codec with error feedback (the library's ``Pipeline.roundtrip`` and
``ErrorFeedback``), the coordinator's outer optimizer (``build_outer_optimizer``) steps on the
average, and the change goes back through the downlink codec with the coordinator's error
feedback (``exact``: no downlink codec). No gRPC, no processes, no sealing: the numbers are the
system's (same codecs, same outer step) at a fraction of the cost of ``convergence.py``, which
runs the real system and gives the acceptance figures; use this one to decide what to run there.

A case is ``NAME=UPLINK[ / DOWNLINK][ ; KEY=VALUE ...]`` (config settings, as ``--set``), with keys
of its own: ``uplink_decay`` and ``downlink_decay`` (default: ``compression.feedback_decay`` and
``compression.downlink_feedback_decay``) set the two senders' residual decay; what-ifs the system
does not offer (docs/below-one-bit.md has what they gave): ``site_keeps=1`` (a site starts its
round from θ minus its unsent residual, DeMo-like), ``support_mean=1`` (each coordinate averaged
over the sites that sent it), ``dct=N`` (the uplink codec applied to the DCT of each block of N,
DeMo's transform) and ``dense_small=1`` (vectors, i.e. biases and norms, arrive whole both ways;
their bytes are not counted). ``--warm PATH``
starts from a saved state dict (``convergence.py``'s warm start). ``--smoke``: two tiny cases,
2 rounds, a tiny model.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from geodiloco.app.demo import DemoOptions, demo_config
from geodiloco.compression import ErrorFeedback, Pipeline, Place, parse_pipeline
from geodiloco.config import RunConfig
from geodiloco.coordinator.outer_optimizer import build_outer_optimizer
from geodiloco.workload import (
    DataRange,
    DataShards,
    build_model,
    eval_windows,
    evaluate,
    inner_step,
    load_corpus,
    make_inner_optimizer,
)

SITES = 3
# a case's own keys (not config settings); the last four are what-ifs of issue 42's second pass
OWN_KEYS = ("uplink_decay", "downlink_decay", "site_keeps", "support_mean", "dct", "dense_small")


def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix of size ``n`` (rows: frequencies)."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    i = torch.arange(n, dtype=torch.float64)[None, :]
    m = torch.cos(torch.pi * (i + 0.5) * k / n) * (2.0 / n) ** 0.5
    m[0] /= 2**0.5
    return m.float()


def dct_roundtrip(pipe: Pipeline, x: torch.Tensor, place: Place, n: int) -> tuple[bytes, torch.Tensor]:
    """DeMo's transform, emulated: the codec sees the DCT of each block of ``n``; decoded back."""
    m = dct_matrix(n)
    blocks = torch.nn.functional.pad(x, (0, (-x.numel()) % n)).view(-1, n)
    payload, decoded = pipe.roundtrip((blocks @ m.T).reshape(-1), place)
    return payload, (decoded.view(-1, n) @ m).reshape(-1)[: x.numel()]


SMOKE_SETTINGS = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "data.eval_sequences=8"]


def parse_case(text: str) -> tuple[str, str, str, list[str], dict[str, float]]:
    """``NAME=UP[ / DOWN][ ; K=V ...]`` -> name, uplink, downlink, config settings, own decays."""
    name, _, spec = text.partition("=")
    codecs, *rest = (p.strip() for p in spec.split(";"))
    up, _, down = (p.strip() for p in codecs.partition("/"))
    settings, decays = [], {}
    for item in filter(None, rest):
        key, _, value = item.partition("=")
        if key.strip() in OWN_KEYS:
            decays[key.strip()] = float(value)
        else:
            settings.append(item)
    return name.strip(), up, down or up, settings, decays


def flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@torch.no_grad()
def load_flat(model: torch.nn.Module, theta: torch.Tensor) -> None:
    at = 0
    for p in model.parameters():
        p.copy_(theta[at : at + p.numel()].view_as(p))
        at += p.numel()


def run_case(
    cfg: RunConfig, up_spec: str, down_spec: str, decays: dict[str, float], warm: Path | None
) -> dict:
    corpus = load_corpus(cfg.data.paths, cfg.data.max_bytes, cfg.data.eval_fraction)
    evals = eval_windows(corpus, cfg.data.eval_sequences, cfg.model.seq_len)
    shards = DataShards(corpus, count=cfg.data.shards, seq_len=cfg.model.seq_len, seed=cfg.seed)
    data = [
        shards.windows([DataRange(i, 0, shards.sizes[i]) for i in range(k, cfg.data.shards, SITES)])
        for k in range(SITES)
    ]
    models = [build_model(cfg.model, cfg.seed) for _ in range(SITES)]
    if warm is not None:
        models[0].load_state_dict(torch.load(warm))
    theta = flat(models[0]).clone()
    optimizers = [make_inner_optimizer(m, cfg.inner) for m in models]
    up = parse_pipeline(up_spec)
    down = None if down_spec == "exact" else parse_pipeline(down_spec)
    decay = cfg.compression.feedback_decay
    up_feedback = [ErrorFeedback(theta.numel(), decays.get("uplink_decay", decay)) for _ in range(SITES)]
    down_feedback = ErrorFeedback(theta.numel(), decays.get("downlink_decay", cfg.compression.downlink_decay))
    outer = build_outer_optimizer(cfg.outer)
    small = torch.cat([torch.full((p.numel(),), p.dim() < 2) for p in models[0].parameters()])
    batch, steps = 2 * cfg.data.batch_size, cfg.inner.steps_per_round
    up_bytes = down_bytes = 0
    curve = []
    for r in range(cfg.rounds):
        place = Place.span(r, 0, theta.numel())
        total = torch.zeros_like(theta)
        senders = torch.zeros_like(theta)
        for k in range(SITES):
            keeps = decays.get("site_keeps", 0.0) > 0
            # site_keeps: the site starts from θ minus what it has not sent yet (decayed), not from θ
            residual = up_feedback[k].decay * up_feedback[k].residual
            load_flat(models[k], theta - residual if keeps else theta)
            for h in range(steps):
                step = r * steps + h
                first = (step * batch) % (data[k].shape[0] - batch)
                window = data[k][first : first + batch]
                inner_step(models[k], optimizers[k], cfg.inner, step, window[:, :-1], window[:, 1:])
            delta = theta - flat(models[k])  # with site_keeps, the residual is in it already
            send = delta if keeps else up_feedback[k].compensate(delta)
            if decays.get("dct"):
                payload, decoded = dct_roundtrip(up, send, place, int(decays["dct"]))
            else:
                payload, decoded = up.roundtrip(send, place)
            if decays.get("dense_small"):  # vectors (biases, norms) arrive whole; their bytes not counted
                decoded = torch.where(small, send, decoded)
            up_feedback[k].record(send, decoded)
            up_bytes += len(payload)
            total += decoded
            senders += decoded != 0
        # support_mean: each coordinate averaged over the sites that sent it, not over all sites
        change = outer.step(total / (senders.clamp(min=1) if decays.get("support_mean") else SITES))
        if down is not None:
            send = down_feedback.compensate(change)
            payload, change = down.roundtrip(send, place)
            if decays.get("dense_small"):
                change = torch.where(small, send, change)
            down_feedback.record(send, change)
            down_bytes += len(payload)
        theta += change
        load_flat(models[0], theta)
        loss_sum, count = evaluate(models[0], evals)
        curve.append(loss_sum / count)
    per_direction = cfg.rounds * theta.numel() / 8
    return {
        "final_eval_loss": curve[-1],
        "curve": curve,
        "bits_up": up_bytes / SITES / per_direction,
        "bits_down": down_bytes / per_direction if down is not None else None,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", default=[], metavar="NAME=SPEC", help="see above")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1234])
    parser.add_argument("--schedule", choices=("cosine", "constant"), default="cosine")
    parser.add_argument("--warm", type=Path, help="start from this state dict (default: from scratch)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="config for every case")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="two tiny cases of 2 rounds")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.seeds = 2, [1234]
        args.set = [*SMOKE_SETTINGS, "inner.steps_per_round=2", *args.set]
        args.case = ["none=fp32 / exact", "topk=topk:0.1:64|q2 / topk:0.2:64|q2 ; downlink_decay=1"]
    torch.set_num_threads(1)  # one core, as a sweep runs cases side by side
    results = []
    for text in args.case or ["none=fp32 / exact"]:
        name, up, down, own, decays = parse_case(text)
        runs = []
        for seed in args.seeds:
            settings = [f"rounds={args.rounds}", f"seed={seed}", *args.set, *own]
            cfg = demo_config(DemoOptions(overrides=settings, baseline=False))
            if args.schedule == "cosine":  # decayed to 10% over the run, as convergence.py does
                settings.append(f"inner.decay_steps={cfg.rounds * cfg.inner.steps_per_round}")
                cfg = demo_config(DemoOptions(overrides=settings, baseline=False))
            started = time.monotonic()
            run = run_case(cfg, up, down, decays, args.warm)
            runs.append({"seed": seed, **run, "wall_seconds": time.monotonic() - started})
            loss, bits = run["final_eval_loss"], run["bits_up"]
            print(f"{name} seed {seed}: {loss:.4f} ({bits:.3f} bits up)", flush=True)
        results.append(
            {
                "name": name,
                "uplink": up,
                "downlink": down,
                "settings": own,
                "decays": decays,
                "final_eval_loss": statistics.fmean(r["final_eval_loss"] for r in runs),
                "bits_up": runs[0]["bits_up"],
                "bits_down": runs[0]["bits_down"],
                "runs": runs,
            }
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
