"""Convergence under compression: the demo's DiLoCo run once per codec pipeline, same seeds and tokens.

Run:  .venv/bin/python benchmarks/convergence.py --json runs/convergence.json --plot runs/convergence.png

Each run is the real system (coordinator + 3 sites x 2 ranks as processes, ``geodiloco demo``
settings: FedAvg outer step, H=25, 36 rounds) with ``compression.uplink`` and
``compression.downlink`` set to the pipeline; error feedback is on in both directions, as always.
``bits_per_param`` is the frame size per parameter of one direction (header included, before
zstd); ``wan_bytes`` counts every protobuf message both ways, as the demo does.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from geodiloco.compression import parse_pipeline
from geodiloco.demo import DemoOptions, demo_config, run_diloco
from geodiloco.params import num_parameters
from geodiloco.progress import Progress
from geodiloco.workload import build_model

PIPELINES = {
    "none": "fp32",
    "int8": "q8|zstd:1",
    "4-bit": "q4|zstd:1",
    "2-bit": "q2|zstd:1",
    "topk10%+2-bit": "topk:0.1|q2|zstd:1",
    "topk10%+4-bit": "topk:0.1|q4|zstd:1",
}


def run_one(name: str, spec: str, rounds: int | None, seed: int | None, run_dir: Path) -> dict[str, Any]:
    overrides = [f"compression.uplink={spec}", f"compression.downlink={spec}"]
    if rounds:
        overrides.append(f"rounds={rounds}")
    if seed is not None:
        overrides.append(f"seed={seed}")
    opts = DemoOptions(overrides=overrides, baseline=False)
    cfg = demo_config(opts)
    print(f"== {name}: {spec}", flush=True)
    result = run_diloco(cfg, opts, run_dir)
    params = num_parameters(build_model(cfg.model, cfg.seed))
    return {
        "name": name,
        "pipeline": spec,
        "bits_per_param": parse_pipeline(spec).bits_per_param(min(params, cfg.compression.chunk_elements)),
        "seed": cfg.seed,
        "final_eval_loss": result["final_eval_loss"],
        "wan_bytes": result["wan_bytes"],
        "tokens": result["tokens"],
        "hashes_agree": result["hashes_agree"],
        "wall_seconds": result["wall_seconds"],
        "curve": [{"tokens": p["tokens"], "eval_loss": p["eval_loss"]} for p in result["curve"]],
    }


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in results:
        curve = r["curve"]
        label = f"{r['name']} ({r['pipeline']}, {r['bits_per_param']:.2f} bits/param)"
        ax.plot([p["tokens"] for p in curve], [p["eval_loss"] for p in curve], label=label)
    ax.set_xlabel("tokens")
    ax.set_ylabel("eval loss")
    ax.set_title("DiLoCo, 3 sites x 2 ranks, H=25: eval loss under each codec pipeline")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--plot", type=Path, help="write a PNG of eval loss against tokens here")
    parser.add_argument("--rounds", type=int, help="outer rounds per run (default: the demo's 36)")
    parser.add_argument("--seed", type=int, help="model and data seed for every run (default: the demo's)")
    parser.add_argument("--only", nargs="*", help="run only these of the pipelines (by name)")
    parser.add_argument(
        "--extra", nargs="*", default=[], metavar="NAME=SPEC", help="more pipelines: 'q4-b32=q4:32|zstd:1'"
    )
    args = parser.parse_args(argv)
    pipelines = {**PIPELINES, **dict(e.split("=", 1) for e in args.extra)}
    chosen = {
        name: spec
        for name, spec in pipelines.items()
        if args.only is None or name in args.only or f"{name}={spec}" in args.extra
    }
    results = []
    with Progress("convergence runs", max(1, len(chosen)), every_s=0) as progress:
        for name, spec in chosen.items():
            with tempfile.TemporaryDirectory(prefix=f"convergence-{name.replace('%', '')}-") as tmp:
                results.append(run_one(name, spec, args.rounds, args.seed, Path(tmp)))
            progress.advance(note=f"{name} done")
    none = next((r["final_eval_loss"] for r in results if r["name"] == "none"), None)
    print("| name | pipeline | bits/param | final eval loss | vs none | WAN bytes |")
    print("|---|---|---|---|---|---|")
    for r in results:
        ratio = f"{r['final_eval_loss'] / none - 1:+.2%}" if none else "-"
        print(
            f"| {r['name']} | `{r['pipeline']}` | {r['bits_per_param']:.3f} | {r['final_eval_loss']:.4f} | "
            f"{ratio} | {r['wan_bytes'] / 1e6:.1f} MB |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
