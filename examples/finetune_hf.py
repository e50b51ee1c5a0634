"""Fine-tune a Hugging Face model across two sites on your own text files, then export it and
read it back with transformers (needs the `hf` extra: pip install 'geodiloco[hf]').

    python examples/finetune_hf.py --workdir runs/finetune [--text MY_FILES...]

1. "Pretrained": a small Llama is created and briefly trained on the Python standard library's
   sources (a stand-in for the checkpoint you would start from), saved with save_pretrained.
2. The run: `geodiloco.workload.hf:build_model` with that directory as its architecture and as
   θ_0 (`workload.init_weights`), the byte data over your text files (`data.paths`; default:
   this repository's Markdown, cut into sections), a coordinator and two sites (DDP, and FSDP2
   over 2 ranks) as real processes on loopback (plaintext: local only).
3. `geodiloco export` writes the committed model as a save_pretrained directory, which
   `AutoModelForCausalLM.from_pretrained` reads; the held-out loss on your text is printed
   before and after, and saved in WORKDIR/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from geodiloco.builders import build_data
from geodiloco.config import RunConfig, load_config
from geodiloco.workload.data import DataRange
from geodiloco.workload.hf import tiny_llama
from geodiloco.workload.loss import cross_entropy
from geodiloco.workload.steps import evaluate_batches

REPO = Path(__file__).resolve().parents[1]
SEQ_LEN = 64


def pretrain(out: Path, steps: int) -> None:
    """A 0.2M-parameter Llama over bytes, trained ``steps`` steps on the stdlib's sources."""
    model = tiny_llama(0, hidden=64, intermediate=192, positions=SEQ_LEN)
    stdlib = load_config(None, [f"model.seq_len={SEQ_LEN}", "data.max_bytes=2000000", "data.batch_size=16"])
    data = build_data(stdlib)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    size, shards = stdlib.data.batch_size, stdlib.data.shards
    for step in range(steps):  # through the shards in turn, each window once
        start = step // shards * size
        x, y = data.batch([DataRange(step % shards, start, start + size)], 0, 0, 1)
        loss = cross_entropy(model, (x, y))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"pretraining step {step}: loss {float(loss.detach()):.3f}", flush=True)
    model.save_pretrained(out)


def sample_text(workdir: Path) -> list[str]:
    """Stand-in for your files: this repository's Markdown (README, docs/, the folders' READMEs),
    one file per section, so that the byte data can hold whole files out for evaluation (every
    tenth, ``data.eval_fraction``)."""
    out = workdir / "text"
    out.mkdir(exist_ok=True)
    sections = [
        part
        for doc in sorted([*REPO.glob("*.md"), *REPO.glob("*/README.md"), *REPO.glob("docs/*.md")])
        for part in doc.read_text().split("\n## ")
    ]
    for i, part in enumerate(sections):
        (out / f"{i:03d}.md").write_text(part)
    return sorted(str(p) for p in out.glob("*.md"))


def held_out_loss(model: torch.nn.Module, cfg: RunConfig) -> float:
    total, count = evaluate_batches(model, build_data(cfg).eval_batches(0, 1), cross_entropy)
    return total / count


def run_config(workdir: Path, text: list[str], rounds: int) -> RunConfig:
    pretrained = workdir / "pretrained"
    return load_config(
        None,
        [
            "run_id=finetune-hf",
            f"rounds={rounds}",
            "heartbeat_interval_s=1",
            "lease_s=20",
            "workload.model=geodiloco.workload.hf:build_model",
            f'workload.options.hf_model="{pretrained}"',
            f'workload.init_weights="{pretrained}"',
            f"data.paths={json.dumps(text)}",
            f"model.seq_len={SEQ_LEN}",
            "data.shards=8",
            "data.batch_size=8",
            "data.eval_sequences=64",
            "data.eval_fraction=0.1",
            "inner.steps_per_round=20",
            "inner.lr=1e-3",
            "outer.momentum=0.5",
        ],
    )


def train_across_sites(cfg: RunConfig, workdir: Path) -> None:
    """A coordinator and two sites as processes; returns when the run is over."""
    config = workdir / "config.json"
    config.write_text(cfg.to_json())
    port_file = workdir / "port"
    port_file.unlink(missing_ok=True)
    geodiloco = [sys.executable, "-m", "geodiloco"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}

    def spawn(args: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(workdir / log, "wb") as out:
            return subprocess.Popen([*geodiloco, *args], stdout=out, stderr=subprocess.STDOUT, env=env)

    serve = ["coordinator", "serve", "--config", str(config), "--insecure", "--port", "0"]
    serve += ["--port-file", str(port_file), "--run-dir", str(workdir / "coord"), "--exit-when-finished"]
    coordinator = spawn(serve, "coordinator.log")
    while not port_file.exists():
        if coordinator.poll() is not None:
            raise SystemExit(f"the coordinator failed: see {workdir / 'coordinator.log'}")
        time.sleep(0.2)
    target = f"127.0.0.1:{port_file.read_text()}"
    sites = [
        spawn(["site", "run", "--name", name, "--coordinator", target, "--insecure", *layout], f"{name}.log")
        for name, layout in (("site-1", ["--nproc", "1"]), ("site-2", ["--nproc", "2", "--layout", "fsdp"]))
    ]
    for name, proc in zip(cfg.sites, sites, strict=True):
        if proc.wait() != 0:
            coordinator.kill()
            raise SystemExit(f"{name} failed: see {workdir / (name + '.log')}")
    if coordinator.wait(timeout=120) != 0:
        raise SystemExit(f"the coordinator failed: see {workdir / 'coordinator.log'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/finetune"))
    parser.add_argument("--text", nargs="+", help="your text files (default: this repository's Markdown)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--pretrain-steps", type=int, default=300)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    text = args.text or sample_text(args.workdir)
    started = time.monotonic()
    if not (args.workdir / "pretrained" / "config.json").exists():
        pretrain(args.workdir / "pretrained", args.pretrain_steps)
    cfg = run_config(args.workdir, text, args.rounds)
    before = held_out_loss(AutoModelForCausalLM.from_pretrained(args.workdir / "pretrained"), cfg)
    print(f"held-out loss on your text before fine-tuning: {before:.4f}", flush=True)
    train_across_sites(cfg, args.workdir)
    exported = args.workdir / "exported"
    export = [sys.executable, "-m", "geodiloco", "export", str(args.workdir / "coord")]
    export += ["--config", str(args.workdir / "config.json"), "--out", str(exported)]
    subprocess.run(export, check=True)
    after = held_out_loss(AutoModelForCausalLM.from_pretrained(exported), cfg)
    print(f"held-out loss on your text after {cfg.rounds} rounds across 2 sites: {after:.4f}", flush=True)
    summary = {
        "text_files": len(text),
        "rounds": cfg.rounds,
        "inner_steps": cfg.inner.steps_per_round,
        "loss_before": before,
        "loss_after": after,
        "exported": str(exported),
        "wall_seconds": time.monotonic() - started,
    }
    (args.workdir / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
