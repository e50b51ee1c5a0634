"""Streaming vs blocking DiLoCo at equal tokens, on the reference workload, in one process.

Run:  nice .venv/bin/python benchmarks/streaming.py --seeds 1 2 3 --json runs/streaming.json

Two sites (threads) train the reference byte-level GPT against in-process round controllers
(:mod:`geodiloco.testing.local_link`: the real site loop, codecs, error feedback, fragment rounds
and hashes; no gRPC, no WAN). Every mode trains the same rounds x H steps x batch (equal
tokens) from the same warm start (the model trained alone first, as the DiLoCo paper starts
from a pretrained model); ``--seeds`` vary the runs' data order. The loss reported is the
held-out loss of the *global* parameters (the coordinator's θ) at the end. Modes: blocking
DiLoCo (P = 1, τ = 0) and streaming ones (P fragments, τ overlapped steps, mixing α; one fragment
with the longest overlap, τ = H − 1, is what benchmarks/wan.py runs over the WAN); each
streaming run is compared with the blocking run of the same seed. ``--modes`` picks some.

This is a loss comparison, not a timing one: the WAN's cost is measured by benchmarks/wan.py.
``--smoke`` (a tiny model, 2 rounds, one seed, two modes) only checks that the script runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from geodiloco.builders import build_data, build_loss, build_model, build_optimizer
from geodiloco.config import RunConfig
from geodiloco.params import flatten_parameters, load_flat_parameters
from geodiloco.site.fragment_schedule import FragmentPlan
from geodiloco.site.outer_sync import OuterSync
from geodiloco.testing.local_link import LocalCoordinator
from geodiloco.workload.data import DataRange
from geodiloco.workload.steps import evaluate_batches, inner_step

LONGEST = -1  # τ = H // P - 1: the longest overlap the schedule allows (benchmarks/wan.py's default)
MODES = [  # (mode, fragments P, overlap_steps τ, mix_alpha α)
    ("blocking", 1, 0, 0.5),
    ("streaming", 1, LONGEST, 0.5),
    ("streaming", 2, 0, 0.5),
    ("streaming", 2, 1, 0.5),
    ("streaming", 4, 1, 0.5),
    ("streaming", 4, 1, 0.0),
    ("streaming", 2, LONGEST, 0.5),  # benchmarks/wan.py's streaming row with --fragments 2
]
SMOKE_MODES = [MODES[0], MODES[3]]  # blocking; P=2, τ=1


def base_config(smoke: bool, rounds: int, steps: int) -> dict[str, Any]:
    return {
        "run_id": "streaming-bench",
        "sites": ["site-a", "site-b"],
        "rounds": 2 if smoke else rounds,
        "round_timeout_s": 600.0,
        "lease_s": 600.0,
        "model": {"n_layer": 4, "n_head": 2, "d_model": 32 if smoke else 64, "seq_len": 64},
        "data": {"max_bytes": 1_000_000, "batch_size": 8, "eval_sequences": 16 if smoke else 96},
        "inner": {"steps_per_round": 4 if smoke else steps, "lr": 3e-3},
        "outer": {"optimizer": "nesterov", "lr": 0.7, "momentum": 0.5},
    }


def warm_start(cfg: RunConfig, steps: int) -> torch.Tensor:
    """θ_0: the reference model trained alone for ``steps`` steps on both sites' batch size."""
    model = build_model(cfg)
    optimizer = build_optimizer(model, cfg)
    data = build_data(cfg)
    loss_fn = build_loss(cfg)
    everything = [DataRange(i, 0, size) for i, size in enumerate(data.shard_sizes)]
    for step in range(steps):
        batch = data.batch(everything, step, 0, 1)
        inner_step(model, optimizer, cfg.inner, step, *batch, loss_fn=loss_fn)
    return flatten_parameters(model)


def train_site(
    coordinator: LocalCoordinator, name: str, cfg: RunConfig, theta0: torch.Tensor, out: dict
) -> None:
    data = build_data(cfg)  # one per site: a reader caches its round's windows
    sync = OuterSync.over(coordinator.link(name))
    model = build_model(cfg)
    load_flat_parameters(model, theta0)
    sync.attach(model)
    optimizer = build_optimizer(model, cfg)
    loss_fn = build_loss(cfg)
    H = cfg.inner.steps_per_round
    try:
        while not sync.finished:
            step = sync.round * H + sync.steps_in_round
            batch = data.batch(sync.data, sync.steps_in_round, 0, 1)
            inner_step(model, optimizer, cfg.inner, step, *batch, loss_fn=loss_fn)
            if sync.step(tokens=data.tokens(batch)):
                sync.report(0.0, 0, 0.0, 0.0)  # the hashes of the fragments merged
    finally:
        sync.close()
    out[name] = sync.bytes_sent


def run_one(base: dict[str, Any], mode: tuple[str, int, int, float], seed: int, theta0: torch.Tensor) -> dict:
    name, fragments, overlap, alpha = mode
    if overlap == LONGEST:
        overlap = base["inner"]["steps_per_round"] // fragments - 1
    settings = {**base, "seed": seed, "outer": {**base["outer"], "fragments": fragments}}
    settings["outer"].update(overlap_steps=overlap, mix_alpha=alpha)
    cfg = RunConfig.from_dict(settings)
    data = build_data(cfg)
    model = build_model(cfg)
    plan = FragmentPlan.of_model(model, fragments)
    started = time.perf_counter()
    out: dict[str, int] = {}
    with LocalCoordinator(cfg, theta0, list(data.shard_sizes), plan) as coordinator:
        threads = [
            threading.Thread(target=train_site, args=(coordinator, n, cfg, theta0, out)) for n in cfg.sites
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        controller = coordinator.controller
        theta = controller.theta()
        histories = [c.history for c in controller.fragments]
    if set(out) != set(cfg.sites):
        raise RuntimeError(f"{name} P={fragments} τ={overlap}: a site failed (see its log)")
    load_flat_parameters(model, theta)
    loss_sum, count = evaluate_batches(model, data.eval_batches(0, 1), build_loss(cfg))
    return {
        "mode": name,
        "fragments": fragments,
        "overlap_steps": overlap,
        "mix_alpha": alpha,
        "seed": seed,
        "final_eval_loss": loss_sum / count,
        "tokens": sum(h.tokens for h in histories[-1]),
        "short_rounds": sum(len(h.contributors) < len(cfg.sites) for hs in histories for h in hs),
        "hashes_agree": all(h.hashes_agree and len(h.hash_reports) == 2 for hs in histories for h in hs),
        "uplink_bytes": sum(out.values()),
        "wall_s": time.perf_counter() - started,
    }


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    blocking = {r["seed"]: r["final_eval_loss"] for r in runs if r["mode"] == "blocking"}
    keys = sorted({(r["mode"], r["fragments"], r["overlap_steps"], r["mix_alpha"]) for r in runs})
    rows = []
    for mode, fragments, overlap, alpha in keys:
        mine = [
            r
            for r in runs
            if (r["mode"], r["fragments"], r["overlap_steps"], r["mix_alpha"])
            == (mode, fragments, overlap, alpha)
        ]
        ratios = [r["final_eval_loss"] / blocking[r["seed"]] for r in mine if r["seed"] in blocking]
        rows.append(
            {
                "mode": mode,
                "fragments": fragments,
                "overlap_steps": overlap,
                "mix_alpha": alpha,
                "seeds": [r["seed"] for r in mine],
                "final_eval_loss": statistics.fmean(r["final_eval_loss"] for r in mine),
                "loss_ratio_to_blocking": statistics.fmean(ratios) if ratios else None,
                "worst_seed_ratio": max(ratios, key=lambda x: abs(x - 1)) if ratios else None,
                "hashes_agree": all(r["hashes_agree"] for r in mine),
                "runs": mine,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--steps", type=int, default=8, help="H, inner steps per round")
    parser.add_argument("--warm-start", type=int, default=200, help="steps of the model alone first")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true")
    listed = ", ".join(
        f"{i}: {m[0]} P={m[1]} τ={'H//P-1' if m[2] == LONGEST else m[2]} α={m[3]}"
        for i, m in enumerate(MODES)
    )
    parser.add_argument(
        "--modes", type=int, nargs="+", choices=range(len(MODES)), help=f"which ({listed}); default all"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    chosen = [MODES[i] for i in args.modes] if args.modes else MODES
    seeds, modes = ([args.seeds[0]], SMOKE_MODES) if args.smoke else (args.seeds, chosen)
    base = base_config(args.smoke, args.rounds, args.steps)
    theta0 = warm_start(RunConfig.from_dict(base), 4 if args.smoke else args.warm_start)
    runs = []
    for seed in seeds:
        for mode in modes:
            run = run_one(base, mode, seed, theta0)
            print(
                f"{run['mode']:9s} P={run['fragments']} τ={run['overlap_steps']} α={run['mix_alpha']:.2f} "
                f"seed {seed}: eval loss {run['final_eval_loss']:.4f} ({run['wall_s']:.1f}s, "
                f"hashes agree: {run['hashes_agree']})",
                flush=True,
            )
            runs.append(run)
    rows = summarise(runs)
    for row in rows:
        ratio = row["loss_ratio_to_blocking"]
        print(
            f"{row['mode']:9s} P={row['fragments']} τ={row['overlap_steps']} α={row['mix_alpha']:.2f}: "
            f"mean loss {row['final_eval_loss']:.4f}, x{ratio:.4f} of blocking (worst seed "
            f"x{row['worst_seed_ratio']:.4f})"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
