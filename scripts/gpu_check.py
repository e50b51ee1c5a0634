"""The GPU check's runs (scripts/gpu_check.sh runs them; each prints one JSON line per run).

``agree``: a coordinator and two real sites, one rank on the GPU (``--mixed-precision`` bf16 or
fp8) and one on the CPU (fp32); passes when both sites report the coordinator's hash every round.

``layouts``: a site of two GPU ranks in pipeline stages (``pp=2``, fp32: stages take no mixed
precision yet), then one of two GPU ranks splitting a mixture of experts (``ep``); each passes
when the site reports the coordinator's (CPU-computed) hash every round. Fewer than two GPUs:
said, not failed.

``throughput``: one site rank on the GPU trains a ~100M-parameter reference model against a real
coordinator; reports inner tokens/s without the outer sync (inner steps only) and with it (wall
time of whole rounds), and the outer sync's share of the wall time at H inner steps per round.

Both take ``--device cpu`` and ``--smoke`` so that their CPU side is tested without a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.config import RunConfig
from geodiloco.testing.processes import kill_tree, spawn_geodiloco

# ~100M parameters: 14 blocks of 12 d^2 at d=768 (byte vocabulary: the embeddings are small)
MODEL_100M = {"n_layer": 14, "n_head": 12, "d_model": 768, "seq_len": 256}
MODEL_SMOKE = {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 16}
MODEL_AGREE = {"n_layer": 2, "n_head": 4, "d_model": 64, "seq_len": 64}  # fp8 needs dims % 16
MODEL_SMOKE_STAGES = {**MODEL_SMOKE, "n_layer": 2}  # a block per stage
# layout, ranks, precision (None: the run's), model keys added (ep splits a mixture of experts)
LAYOUTS = [("pp=2", 2, "fp32", {}), ("ep", 2, None, {"experts": 4, "top_k": 2})]


def run_config(sites: list[str], rounds: int, steps: int, model: dict[str, Any], batch: int) -> RunConfig:
    return RunConfig.from_dict(
        {
            "run_id": "gpu-check",
            "sites": sites,
            "rounds": rounds,
            "round_timeout_s": 300.0,
            "heartbeat_interval_s": 1.0,
            "lease_s": 60.0,
            "model": model,
            "data": {"max_bytes": 2_000_000, "batch_size": batch, "eval_sequences": 16},
            "inner": {"steps_per_round": steps, "lr": 1e-3},
            "outer": {"optimizer": "nesterov", "lr": 0.7, "momentum": 0.5},
        }
    )


def start_coordinator(cfg: RunConfig, workdir: Path) -> tuple[Any, str]:
    (workdir / "run.json").write_text(cfg.to_json())
    port_file = workdir / "port"
    args = ["coordinator", "serve", "--config", str(workdir / "run.json"), "--port", "0"]
    args += ["--port-file", str(port_file), "--run-dir", str(workdir / "coord"), "--insecure"]
    proc = spawn_geodiloco(args, workdir / "coordinator.log")
    deadline = time.monotonic() + 300
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((workdir / "coordinator.log").read_text()[-3000:])
        time.sleep(0.1)
    return proc, f"127.0.0.1:{port_file.read_text()}"


def train_sites(
    cfg: RunConfig, sites: dict[str, list[str]], workdir: Path, timeout: float
) -> tuple[bool, list[dict[str, Any]]]:
    """A coordinator and ``sites`` (name: `site run` flags) through the run; whether every site
    ended well and reported the coordinator's hash every round, and each round's reports."""
    coordinator, target = start_coordinator(cfg, workdir)
    procs = {}
    try:
        for name, flags in sites.items():
            run = ["site", "run", "--name", name, "--coordinator", target, "--insecure", *flags]
            procs[name] = spawn_geodiloco(run, workdir / f"{name}.log")
        codes = {name: proc.wait(timeout=timeout) for name, proc in procs.items()}
        status = fetch_status(target, None)
        rounds = [
            {"round": h.round, "hash_reports": h.hash_reports, "hashes_agree": h.hashes_agree}
            for h in status.history
        ]
        request_shutdown(target, None)
        coordinator.wait(timeout=30)
    finally:
        for proc in (*procs.values(), coordinator):
            if proc.poll() is None:
                kill_tree(proc)
    ok = (
        all(code == 0 for code in codes.values())
        and len(rounds) == cfg.rounds
        and all(r["hash_reports"] == len(sites) and r["hashes_agree"] for r in rounds)
    )
    for name, code in codes.items():
        if code != 0:
            print((workdir / f"{name}.log").read_text()[-3000:], file=sys.stderr)
    return ok, rounds


def agree(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    sites = {"site-gpu": (args.device, args.precision), "site-cpu": ("cpu", "fp32")}
    cfg = run_config(list(sites), args.rounds, args.steps, MODEL_SMOKE if args.smoke else MODEL_AGREE, 8)
    flags = {name: ["--nproc", "1", "--device", d, "--mixed-precision", p] for name, (d, p) in sites.items()}
    ok, rounds = train_sites(cfg, flags, workdir, args.timeout)
    return {"check": "agree", "device": args.device, "precision": args.precision, "ok": ok, "rounds": rounds}


def layouts(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    results = []
    for layout, ranks, fixed, model_keys in LAYOUTS:
        precision = fixed or args.precision
        result = {"check": "layout", "layout": layout, "device": args.device, "ranks": ranks}
        result["precision"] = precision
        gpus = torch.cuda.device_count() if args.device == "cuda" else ranks
        if gpus < ranks:  # said, not failed: each rank of a site needs a GPU of its own
            results.append({**result, "skipped": f"{layout} needs {ranks} GPUs, {gpus} visible"})
            continue
        model = {**(MODEL_SMOKE_STAGES if args.smoke else MODEL_AGREE), **model_keys}
        cfg = run_config(["site-layout"], args.rounds, args.steps, model, 8)
        flags = ["--nproc", str(ranks), "--layout", layout, "--device", args.device]
        flags += ["--mixed-precision", precision]
        run_dir = workdir / layout.replace("=", "")
        run_dir.mkdir()
        ok, rounds = train_sites(cfg, {"site-layout": flags}, run_dir, args.timeout)
        results.append({**result, "ok": ok, "rounds": rounds})
    return results


def throughput(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from geodiloco.builders import build_data, build_model, build_optimizer
    from geodiloco.site import connect
    from geodiloco.site.parallel.layout import Autocast
    from geodiloco.workload.steps import inner_step

    device = torch.device(args.device)
    model_shape, batch = (MODEL_SMOKE, 4) if args.smoke else (MODEL_100M, args.batch)
    cfg = run_config(["site-gpu"], args.rounds, args.steps, model_shape, batch)
    coordinator, target = start_coordinator(cfg, workdir)
    try:
        sync = connect(target, "site-gpu")
        model = build_model(sync.config).to(device)
        sync.attach(model)
        params = sum(p.numel() for p in model.parameters())
        trained = Autocast(model, device.type) if args.precision == "bf16" else model
        optimizer = build_optimizer(model, sync.config)
        data = build_data(sync.config)
        inner_s = sync_s = 0.0
        tokens = 0
        rounds = 0
        while not sync.finished:
            started = time.perf_counter()
            batch_ = tuple(t.to(device) for t in data.batch(sync.data, sync.steps_in_round, 0, 1))
            step = sync.round * cfg.inner.steps_per_round + sync.steps_in_round
            inner_step(trained, optimizer, cfg.inner, step, *batch_)  # returns a float: synchronises
            step_tokens = data.tokens(batch_)
            between = time.perf_counter()
            synced = sync.step(tokens=step_tokens)
            ended = time.perf_counter()
            if rounds > 0:  # round 0 warms up (allocator, kernels, the coordinator's first commit)
                inner_s += between - started
                sync_s += ended - between
                tokens += step_tokens
            rounds += synced
        sync.close()
        request_shutdown(target, None)
        coordinator.wait(timeout=60)
    finally:
        if coordinator.poll() is None:
            kill_tree(coordinator)
    return {
        "check": "throughput",
        "device": args.device,
        "precision": args.precision,
        "params": params,
        "inner_steps_per_round": args.steps,
        "measured_rounds": rounds - 1,
        "tokens_per_s_inner_only": tokens / inner_s,
        "tokens_per_s_with_outer_sync": tokens / (inner_s + sync_s),
        "outer_sync_share": sync_s / (inner_s + sync_s),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("check", choices=("agree", "layouts", "throughput"))
    parser.add_argument("--device", default="cuda", help="the GPU site's device (cpu: test the CPU side)")
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp8"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="inner steps per round (H)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (throughput)")
    parser.add_argument("--timeout", type=float, default=400.0)
    parser.add_argument("--smoke", action="store_true", help="a tiny model: seconds, on any device")
    args = parser.parse_args(argv)
    if args.check == "agree" and args.precision == "fp8":
        from geodiloco.site.parallel.layout import precision_problem

        problem = precision_problem("fp8", torch.device(args.device))
        if problem is not None:  # said, not failed: fp8 runs only where the hardware has it
            print(json.dumps({"check": "agree", "precision": "fp8", "skipped": problem}))
            return 0
    checks = {"agree": lambda w: [agree(args, w)], "layouts": lambda w: layouts(args, w)}
    with tempfile.TemporaryDirectory(prefix="geodiloco-gpu-check-") as tmp:
        results = checks.get(args.check, lambda w: [throughput(args, w)])(Path(tmp))
    for result in results:
        print(json.dumps(result))
    return 0 if all(r.get("ok", True) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
