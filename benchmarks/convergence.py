"""Convergence under compression: DiLoCo on the reference workload once per codec pipeline and seed.

Run:  .venv/bin/python benchmarks/convergence.py --seeds 1234 7 11 --json runs/convergence.json \
          --plot runs/convergence.png

Each run is the real system (coordinator + 3 sites x 2 ranks as processes over mTLS, the demo's
FedAvg outer step and H=25) with ``compression.uplink`` and ``compression.downlink`` set to the
pipeline; error feedback is on in both directions, as always. By default every run starts from
the same warm start (the reference model trained alone for 600 steps, as the DiLoCo paper starts
from a pretrained model) and trains 24 rounds with the inner lr decayed to 10% (cosine): from
scratch at a constant lr, this small model turns any perturbation, even fp16 rounding, into
final-loss differences of several percent either way, which hides what the codecs cost.
``--starts scratch warm`` runs every pipeline both ways (``scratch``: the model's random
initialisation, the same rounds and schedule), each compared with the dense run of the same start
and seed; ``--warm-start 0 --rounds 36 --schedule constant`` is the demo's from-scratch setting.

A pipeline is ``UPLINK`` (both ways) or ``UPLINK / DOWNLINK``, optionally followed by ``; KEY=VALUE``
config settings of its own (``topk:0.05:4096|q2 / topk:0.12:4096|q2 ; compression.feedback_decay=0.95``).

Every pipeline runs with every seed (the runs' data order), so each lossy pipeline is compared
with the uncompressed run of the same seed, and the spread over seeds shows how much of a
difference is noise. ``bits_per_param`` and ``downlink_bits_per_param`` are the frame size per
parameter of the uplink and of the downlink (every byte of a frame: header, indices, scales,
values; before zstd, which only shrinks it); ``worst_seed_ratio`` is the largest of the seeds'
final loss ÷ the dense run's of the same seed and start; ``wan_bytes`` counts every protobuf
message both ways, as the demo does. A run in which some round closed without every site
(``short_rounds`` > 0) trained on fewer tokens and is flagged in the table.

``--smoke`` (dense and int8 runs of 2 rounds on a tiny model, 2 sites of one rank, from scratch, and
a dense run from a 4-step warm start) only checks that the benchmark still runs.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from geodiloco.app.demo import DemoOptions, demo_config, run_diloco
from geodiloco.compression import parse_pipeline
from geodiloco.config import RunConfig
from geodiloco.params import num_parameters
from geodiloco.progress import Progress
from geodiloco.workload import (
    DataRange,
    DataShards,
    build_model,
    eval_windows,
    evaluate,
    inner_step,
    load_corpus,
    make_inner_optimizer,
    rank_batch,
)

# name: the uplink's spec, or "UPLINK / DOWNLINK" where the coordinator's update has its own codec
PIPELINES = {
    "none": "fp32",
    "int8": "q8|zstd:1",
    "4-bit": "q4|zstd:1",
    "2-bit": "q2|zstd:1",
    "topk10%+2-bit": "topk:0.1|q2|zstd:1",
    "fp16": "fp16",  # nearly lossless: how far a tiny perturbation alone moves the final loss
    "topk10%+4-bit": "topk:0.1|q4|zstd:1",
    "cyclic47%+2-bit": "cyclic:0.47|q2:256|zstd:1",  # <= 1 bit/param before zstd, no indices
    # SparseLoCo's rule (issue 42): chunked top-k with sign values, the sites' residual decayed,
    # the coordinator re-sparsifying the average at about the union's size, keeping its residual
    "topk6.5%+sign": "topk:0.065:4096|sign:256 / topk:0.16:4096|sign:256 ; "
    "compression.feedback_decay=0.95 ; compression.downlink_feedback_decay=1",
    "topk3%+sign": "topk:0.03:4096|sign:256 / topk:0.09:4096|sign:256 ; "
    "compression.feedback_decay=0.95 ; compression.downlink_feedback_decay=1",
    # the same with top-k over the whole chunk (of compression.chunk_elements), not per 4096: the
    # tensors' updates differ in scale, and an equal share per 4096 spends the budget on the small ones
    "global-topk6.5%+sign": "topk:0.065|sign:256 / topk:0.16|sign:256 ; "
    "compression.feedback_decay=0.95 ; compression.downlink_feedback_decay=1",
    "global-topk3%+sign": "topk:0.03|sign:256 / topk:0.09|sign:256 ; "
    "compression.feedback_decay=0.95 ; compression.downlink_feedback_decay=1",
}
SMOKE_SETTINGS = [
    'sites=["site-1","site-2"]',
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    "inner.steps_per_round=2",
    "data.eval_sequences=8",
]


STARTS = ("scratch", "warm")


def split_spec(spec: str) -> tuple[str, str, list[str]]:
    """A pipeline entry's uplink spec, downlink spec and own settings: ``UP[ / DOWN][ ; K=V ...]``."""
    codecs, *own = (p.strip() for p in spec.split(";"))
    up, _, down = (p.strip() for p in codecs.partition("/"))
    return up, down or up, [o for o in own if o]


def run_one(
    name: str, spec: str, settings: list[str], seed: int, run_dir: Path, ranks_per_site: int = 2
) -> dict[str, Any]:
    # --set comes after the pipeline, so that e.g. compression.downlink=q8|zstd:1 holds for every run
    up, down, own = split_spec(spec)
    overrides = [f"compression.uplink={up}", f"compression.downlink={down}", *own, *settings, f"seed={seed}"]
    opts = DemoOptions(overrides=overrides, baseline=False, ranks_per_site=ranks_per_site)
    cfg = demo_config(opts)
    print(f"== {name}: {cfg.compression.uplink} up, {cfg.compression.downlink} down, seed {seed}", flush=True)
    result = run_diloco(cfg, opts, run_dir)
    per_round = [p["tokens"] // (p["round"] + 1) for p in result["curve"]]
    per_direction = cfg.rounds * len(cfg.sites) * num_parameters(build_model(cfg.model, cfg.seed)) / 8
    return {
        "seed": seed,
        "final_eval_loss": result["final_eval_loss"],
        "wan_bytes": result["wan_bytes"],
        # every message each way (protobuf, sealing, heartbeats included) per parameter per site-round
        "wire_bits_up": result["wan_bytes_up"] / per_direction,
        "wire_bits_down": result["wan_bytes_down"] / per_direction,
        "tokens": result["tokens"],
        "short_rounds": sum(t < max(per_round) for t in per_round),
        "hashes_agree": result["hashes_agree"],
        "wall_seconds": result["wall_seconds"],
        "curve": [{"tokens": p["tokens"], "eval_loss": p["eval_loss"]} for p in result["curve"]],
    }


def warm_start(cfg: RunConfig, steps: int, path: Path) -> float:
    """Train the reference model alone for ``steps`` steps, save its state dict; its eval loss.

    The DiLoCo paper starts from a pretrained model too. One process, the whole run's batch per
    step (sites x ranks x ``data.batch_size``), the inner AdamW at a constant lr, the data in
    another order than the runs' (``seed + 1``). Every run then starts from this θ_0, so
    ``--seeds`` vary the runs' data order only.
    """
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, cfg.seed)
    optimizer = make_inner_optimizer(model, cfg.inner)
    corpus = load_corpus(cfg.data.paths, cfg.data.max_bytes, cfg.data.eval_fraction)
    shards = DataShards(corpus, count=cfg.data.shards, seq_len=cfg.model.seq_len, seed=cfg.seed + 1)
    windows = shards.windows([DataRange(i, 0, size) for i, size in enumerate(shards.sizes)])
    batch = len(cfg.sites) * 2 * cfg.data.batch_size
    with Progress("warm start", steps, every_s=30) as progress:
        for step in range(steps):
            x, y = rank_batch(windows, step, 0, 1, batch)
            inner_step(model, optimizer, cfg.inner, step, x, y)
            progress.advance()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    loss_sum, count = evaluate(model, eval_windows(corpus, cfg.data.eval_sequences, cfg.model.seq_len))
    return loss_sum / count


def summarise(
    name: str, spec: str, start: str, runs: list[dict[str, Any]], params: int, chunk: int
) -> dict[str, Any]:
    """One entry per pipeline and start: the issue's keys (means over seeds) plus every run."""
    losses = [r["final_eval_loss"] for r in runs]
    up, down, _ = split_spec(spec)
    return {
        "name": name,
        "pipeline": spec,
        "start": start,
        "bits_per_param": parse_pipeline(up).bits_per_param(min(params, chunk)),
        "downlink_bits_per_param": parse_pipeline(down).bits_per_param(min(params, chunk)),
        "final_eval_loss": statistics.fmean(losses),
        "final_eval_loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
        "wan_bytes": statistics.fmean(r["wan_bytes"] for r in runs),
        "wire_bits_up": _mean_of(runs, "wire_bits_up"),
        "wire_bits_down": _mean_of(runs, "wire_bits_down"),
        "seeds": [r["seed"] for r in runs],
        "runs": runs,
    }


def _mean_of(runs: list[dict[str, Any]], key: str) -> float | None:
    """The mean of ``key`` over the runs that have it (runs of older versions of this script do not)."""
    values = [r[key] for r in runs if key in r]
    return statistics.fmean(values) if values else None


def summarise_all(
    pipelines: dict[str, str],
    runs: dict[tuple[str, str], list[dict[str, Any]]],
    params: int,
    chunk: int,
) -> list[dict[str, Any]]:
    """Entries by start, then pipeline, each with ``worst_seed_ratio`` against its start's ``none``."""
    entries = [
        summarise(n, spec, start, runs[n, start], params, chunk)
        for start in STARTS
        for n, spec in pipelines.items()
        if runs.get((n, start))
    ]
    for entry in entries:
        dense = next((e for e in entries if e["name"] == "none" and e["start"] == entry["start"]), None)
        ratios = [1 + d for d in paired_deltas(entry, dense)]
        entry["worst_seed_ratio"] = max(ratios) if ratios else None
    return entries


def write_json(path: Path, results: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2))


def paired_deltas(entry: dict[str, Any], none: dict[str, Any] | None) -> list[float]:
    """Relative final-loss difference to the uncompressed run of the same seed, per seed."""
    if none is None:
        return []
    base = {r["seed"]: r["final_eval_loss"] for r in none["runs"]}
    return [r["final_eval_loss"] / base[r["seed"]] - 1 for r in entry["runs"] if r["seed"] in base]


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| start | name | pipeline | bits/param up / down | final eval loss (mean ± std) | vs none, per seed "
        "| mean | WAN bytes | wire bits/param up / down |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        start = r.get("start", "warm")
        none = next((e for e in results if e["name"] == "none" and e.get("start", "warm") == start), None)
        deltas = paired_deltas(r, none)
        per_seed = " ".join(f"{d:+.2%}" for d in deltas) or "-"
        mean = f"{statistics.fmean(deltas):+.2%}" if deltas else "-"
        short = sum(run["short_rounds"] for run in r["runs"])
        flag = f" ({short} short rounds)" if short else ""
        lines.append(
            f"| {start} | {r['name']} | `{r['pipeline']}` | "
            f"{r['bits_per_param']:.3f} / {r.get('downlink_bits_per_param', r['bits_per_param']):.3f} | "
            f"{r['final_eval_loss']:.4f} ± {r['final_eval_loss_std']:.4f}{flag} | {per_seed} | {mean} | "
            f"{r['wan_bytes'] / 1e6:.1f} MB | "
            f"{_bits(r.get('wire_bits_up'))} / {_bits(r.get('wire_bits_down'))} |"
        )
    return "\n".join(lines)


def _bits(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(results):
        curves = [run["curve"] for run in r["runs"]]
        tokens = [p["tokens"] for p in curves[0]]
        mean = [statistics.fmean(c[i]["eval_loss"] for c in curves) for i in range(len(tokens))]
        start, bits = r.get("start", "warm"), r["bits_per_param"]
        label = f"{r['name']}, {start} ({r['pipeline']}, {bits:.2f} bits/param)"
        # ten colours, then the same colours dashed, so that no two curves look alike
        ax.plot(tokens, mean, label=label, color=f"C{i % 10}", linestyle="-" if i < 10 else "--")
    ax.set_xlabel("tokens")
    ax.set_ylabel("eval loss (mean over the seeds each pipeline ran)")
    ax.set_title("DiLoCo, 3 sites x 2 ranks, H=25: eval loss under each codec pipeline")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write a PNG of eval loss against tokens here")
    parser.add_argument("--rounds", type=int, default=24, help="outer rounds per run (the demo: 36)")
    parser.add_argument(
        "--seeds",
        type=int,
        nargs="+",
        help="seeds of the data order (and, from scratch, of the model) (default: the demo's)",
    )
    parser.add_argument("--only", nargs="*", help="run only these of the pipelines (by name, in this order)")
    parser.add_argument(
        "--extra", nargs="*", default=[], metavar="NAME=SPEC", help="more pipelines: 'q4-b32=q4:32|zstd:1'"
    )
    parser.add_argument(
        "--schedule",
        choices=("cosine", "constant"),
        default="cosine",
        help="inner lr: cosine decay to 10%% over the run (default), or the demo's constant lr",
    )
    parser.add_argument(
        "--warm-start",
        type=int,
        default=600,
        metavar="STEPS",
        help="the warm start: the reference model trained alone for STEPS steps (0: from scratch only)",
    )
    parser.add_argument(
        "--starts",
        nargs="+",
        choices=STARTS,
        default=list(STARTS),
        help="run every pipeline from scratch, from the warm start, or both (default)",
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="more config overrides, applied after the pipeline's",
    )
    parser.add_argument("--keep", type=Path, help="keep every run's logs under this folder")
    parser.add_argument(
        "--resume", type=Path, help="start from the runs in this JSON (an earlier --json) and skip those"
    )
    parser.add_argument(
        "--smoke", action="store_true", help="tiny dense and int8 runs (and a dense warm one): does it run"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.warm_start, args.only, args.seeds = 2, 4, ["none", "int8"], None
    starts = [s for s in args.starts if s == "scratch" or args.warm_start]
    settings = [f"rounds={args.rounds}"] if args.rounds else []
    settings += SMOKE_SETTINGS if args.smoke else []  # before the warm start, which trains this model
    ranks = 1 if args.smoke else 2
    defaults = demo_config(DemoOptions(overrides=settings, baseline=False))
    if args.schedule == "cosine":
        settings.append(f"inner.decay_steps={defaults.rounds * defaults.inner.steps_per_round}")
    settings += args.set
    start_settings: dict[str, list[str]] = {"scratch": []}
    if "warm" in starts:
        path = (
            args.keep or Path(tempfile.gettempdir())
        ) / f"warm-start-{defaults.seed}-{args.warm_start}{'-smoke' * args.smoke}.pt"
        if not path.exists():
            loss = warm_start(defaults, args.warm_start, path)
            print(f"warm start: {args.warm_start} steps, eval loss {loss:.4f}, saved to {path}", flush=True)
        start_settings["warm"] = [f"workload.init_weights={path}"]
    seeds = args.seeds or [defaults.seed]
    extra = dict(e.split("=", 1) for e in args.extra)
    unknown = [n for n in args.only or [] if n not in PIPELINES]
    if unknown:
        parser.error(f"unknown pipeline names {unknown}; known: {', '.join(PIPELINES)} (or use --extra)")
    pipelines = {n: PIPELINES[n] for n in args.only} if args.only is not None else dict(PIPELINES)
    pipelines |= extra
    params = num_parameters(build_model(defaults.model, defaults.seed))
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(n, s): [] for n in pipelines for s in starts}
    if args.resume and args.resume.exists():
        for entry in json.loads(args.resume.read_text()):
            key = (entry["name"], entry.get("start", "warm"))  # older results: warm runs only
            if pipelines.get(entry["name"]) == entry["pipeline"] and key in runs:
                runs[key] = [r for r in entry["runs"] if r["seed"] in seeds]
    todo = [
        (seed, start, name, spec)
        for seed in seeds  # seed by seed, so that an interrupted sweep still has paired comparisons
        for start in starts
        for name, spec in pipelines.items()
        if not any(r["seed"] == seed for r in runs[name, start])  # measured already (--resume)
        and not (args.smoke and start == "warm" and name != "none")  # the smoke: one warm run is enough
    ]
    chunk = defaults.compression.chunk_elements
    with Progress("convergence runs", max(1, len(todo)), every_s=0) as progress:
        for seed, start, name, spec in todo:
            label = f"{name.replace('%', '')}-{start}-{seed}"
            run_settings = settings + start_settings[start]
            if args.keep:
                run_dir = args.keep / label
                shutil.rmtree(run_dir, ignore_errors=True)
                run_dir.mkdir(parents=True)
                runs[name, start].append(run_one(name, spec, run_settings, seed, run_dir, ranks))
            else:
                with tempfile.TemporaryDirectory(prefix=f"convergence-{label}-") as tmp:
                    runs[name, start].append(run_one(name, spec, run_settings, seed, Path(tmp), ranks))
            if args.json:  # after every run, so a long sweep leaves its results as it goes
                write_json(args.json, summarise_all(pipelines, runs, params, chunk))
            progress.advance(note=f"{name} from {start}, seed {seed} done")
    results = summarise_all(pipelines, runs, params, chunk)
    if args.json:
        write_json(args.json, results)
    print(table(results))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
