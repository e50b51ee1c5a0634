"""Blocking vs streaming DiLoCo behind an emulated WAN, with real processes (issue 14).

Run:  nice -n 10 .venv/bin/python benchmarks/wan.py --json runs/wan.json

A coordinator process and two sites (torchrun, one rank each, gloo on the CPU) on loopback, each
site behind its own WAN proxy (:mod:`geodiloco.app.wan`: bandwidth, 100 ms round trip, bounded
buffers). In one run, side by side:

1. the same two sites training with no outer sync at all (same processes, model, data, eval
   cadence): the tokens/s every other row is divided by, and the inner step time, which sizes
   the links;
2. the link sized so that one round's compressed pseudo-gradient (measured by encoding one)
   takes about half a round's compute to cross, and one 4x slower;
3. on each link, blocking DiLoCo (P = 1, τ = 0) and streaming (P fragments, τ overlapped steps,
   mixing α).

Per row: ``throughput_ratio`` (tokens/s of the run over the no-sync tokens/s, the mean of a
no-sync run before the rows and one after them, as the machine's load may drift; eval time left
out of both), ``peak_to_mean_rate`` (the highest 1-second byte count through a site's proxy over its
mean, from the first inner step to the last; the larger of the two sites), ``final_eval_loss``
(the coordinator's last round), ``hashes_agree`` (every site's hash report matched, the round log
chains, every round had both sites), and ``stolen_fraction``: 1 − (mean inner-step time while
the background sender was idle) / (mean while it was busy), the share of a step that the
sender's encoding, sealing and decoding took from training.

Each rank records its own timeline (inner steps, evals, the sender's busy spans) by wrapping
the site daemon's functions in this script's rank entry (``_rank``), which then runs the real
daemon (:mod:`geodiloco.site.daemon.worker`). ``--smoke`` (a tiny model, 2 rounds, a 2x faster link)
checks that the script runs (on the sized link only); its figures mean nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import math
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from geodiloco.app.status import fetch_status, request_shutdown
from geodiloco.app.wan import LinkConfig, ProxyThread
from geodiloco.builders import build_data, build_loss, build_model, build_optimizer
from geodiloco.compression import parse_pipeline
from geodiloco.compression.frames import encode_chunks
from geodiloco.config import RunConfig
from geodiloco.params import flatten_parameters
from geodiloco.site.daemon.launcher import worker_env
from geodiloco.testing.processes import kill_tree, spawn_geodiloco
from geodiloco.workload.data import DataRange
from geodiloco.workload.steps import evaluate_batches, inner_step

SITES = ("site-a", "site-b")
SLOWER = 4  # the second link is this much slower than the sized one
MODES = ("blocking", "streaming")


@dataclass(kw_only=True, slots=True)
class Settings:
    """The run: a reference model whose inner step is long against the 100 ms round trip."""

    rounds: int = 5
    steps_per_round: int = 32  # H
    fragments: int = 1  # P of the streaming rows
    overlap_steps: int = -1  # τ of the streaming rows; -1: the longest allowed, H // P - 1
    mix_alpha: float = 0.5
    rtt_ms: float = 100.0
    transfer_share: float = 0.5  # the sized link moves one round's push in this share of a round
    smoke: bool = False

    def __post_init__(self) -> None:
        if self.overlap_steps < 0:
            self.overlap_steps = self.steps_per_round // self.fragments - 1

    def run_config(self, fragments: int = 1, overlap: int = 0) -> RunConfig:
        return RunConfig.from_dict(
            {
                "run_id": "wan-bench",
                "sites": list(SITES),
                "min_sites": len(SITES),  # every round waits for both: equal tokens in every row
                "rounds": self.rounds,
                "seed": 0,
                "round_timeout_s": 600.0,
                "model": {
                    "n_layer": 2 if self.smoke else 4,
                    "n_head": 2 if self.smoke else 4,
                    "d_model": 32 if self.smoke else 128,
                    "seq_len": 32 if self.smoke else 128,
                },
                "data": {"max_bytes": 1_000_000, "batch_size": 8, "eval_sequences": 16},
                "inner": {"steps_per_round": self.steps_per_round, "lr": 3e-3},
                "outer": {
                    "optimizer": "nesterov",
                    "lr": 0.7,
                    "momentum": 0.5,
                    "fragments": fragments,
                    "overlap_steps": overlap,
                    "mix_alpha": self.mix_alpha,
                },
            }
        )


# -- one rank, under torchrun: its timeline -------------------------------------------------------


@dataclass(slots=True)
class Timeline:
    """What one rank did when (time.monotonic(), comparable across the machine's processes)."""

    steps: list[tuple[float, float, int]] = field(default_factory=list)  # start, end, tokens
    evals: list[tuple[float, float]] = field(default_factory=list)
    busy: list[tuple[float, float]] = field(default_factory=list)  # the background sender at work

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> Timeline:
        raw = json.loads(path.read_text())
        return cls([tuple(s) for s in raw["steps"]], [tuple(e) for e in raw["evals"]], raw["busy"])


def timed(fn: Callable[..., Any], spans: list[Any], tokens: bool = False) -> Callable[..., Any]:
    """``fn`` that appends (start, end[, tokens of its batch]) to ``spans`` for every call."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            end = time.monotonic()
            spans.append((start, end, args[4].numel()) if tokens else (start, end))  # inner_step's batch

    return wrapper


def site_rank(coordinator: str, site: str, out: Path) -> None:
    """The real site daemon's rank, its inner steps, evals and sender timed."""
    from geodiloco.site.daemon import worker
    from geodiloco.site.outer_sync import FragmentSync

    timeline = Timeline()
    worker.inner_step = timed(worker.inner_step, timeline.steps, tokens=True)  # type: ignore[attr-defined]
    worker.evaluate_batches = timed(worker.evaluate_batches, timeline.evals)  # type: ignore[attr-defined]
    FragmentSync._push_and_pull = timed(FragmentSync._push_and_pull, timeline.busy)  # type: ignore[method-assign]
    try:
        worker.main(["--coordinator", coordinator, "--site", site, "--device", "cpu"])
    finally:
        timeline.write(out)


def alone_rank(config: Path, shard: int, out: Path) -> None:
    """The same site with no outer sync: the daemon's model wrapping, inner steps and per-round
    eval on its own shard, and nothing else."""
    from geodiloco.distributed import init_rank, shutdown_distributed
    from geodiloco.site.parallel.layout import ParallelConfig, build_mesh, parallelize

    cfg = RunConfig.from_json(config.read_text())
    init_rank("cpu")
    layout = ParallelConfig.parse("ddp", 1, "fp32")
    model = build_model(cfg)
    trained = parallelize(model, layout, build_mesh(layout, "cpu"))
    optimizer = build_optimizer(model, cfg)
    data, loss_fn = build_data(cfg), build_loss(cfg)
    windows = [DataRange(shard, 0, data.shard_sizes[shard])]
    timeline = Timeline()
    step_fn = timed(inner_step, timeline.steps, tokens=True)
    eval_fn = timed(evaluate_batches, timeline.evals)
    H = cfg.inner.steps_per_round
    for step in range(cfg.rounds * H):
        batch = data.batch(windows, step, 0, 1)
        step_fn(trained, optimizer, cfg.inner, step, *batch, loss_fn=loss_fn)
        if (step + 1) % H == 0:
            eval_fn(trained, data.eval_batches(shard, len(SITES)), loss_fn)
    timeline.write(out)
    shutdown_distributed()


def rank_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description="one timed rank of benchmarks/wan.py (torchrun)")
    parser.add_argument("--timeline", type=Path, required=True)
    parser.add_argument("--coordinator")
    parser.add_argument("--site")
    parser.add_argument("--alone", type=Path, help="the run config: train with no outer sync")
    parser.add_argument("--shard", type=int, default=0)
    args = parser.parse_args(argv)
    if args.alone is not None:
        alone_rank(args.alone, args.shard, args.timeline)
    else:
        site_rank(args.coordinator, args.site, args.timeline)


# -- the run's figures --------------------------------------------------------------------------


def tokens_per_s(t: Timeline) -> float:
    """Tokens over the time from the first inner step to the last, eval time left out."""
    start, end = t.steps[0][0], t.steps[-1][1]
    evals = sum(b - a for a, b in t.evals if start <= a and b <= end)
    return sum(s[2] for s in t.steps) / (end - start - evals)


def no_sync_tps(timelines: list[Timeline]) -> float:
    return sum(tokens_per_s(t) for t in timelines)


def compute_share(t: Timeline) -> float:
    """The share of the time from the first inner step to the last spent in inner steps (eval
    left out): the throughput ratio measured within the run, blind to the machine's load."""
    start, end = t.steps[0][0], t.steps[-1][1]
    evals = sum(b - a for a, b in t.evals if start <= a and b <= end)
    return sum(b - a for a, b, _ in t.steps) / (end - start - evals)


def step_times(t: Timeline) -> tuple[list[float], list[float]]:
    """Inner-step durations while the background sender was busy, and while it was idle."""
    busy, idle = [], []
    for a, b, _ in t.steps:
        overlaps = any(s < b and a < e for s, e in t.busy)
        (busy if overlaps else idle).append(b - a)
    return busy, idle


def stolen_fraction(timelines: list[Timeline]) -> float:
    busy = [d for t in timelines for d in step_times(t)[0]]
    idle = [d for t in timelines for d in step_times(t)[1]]
    if not busy or not idle:
        return 0.0
    return 1 - statistics.fmean(idle) / statistics.fmean(busy)  # below 0: noise (the load moved)


def peak_to_mean(profile: list[int]) -> float | None:
    """None when the run had no whole second, or no bytes in it."""
    mean = statistics.fmean(profile) if profile else 0.0
    return max(profile) / mean if mean else None


def mean_step_s(timelines: list[Timeline]) -> float:
    return statistics.fmean(b - a for t in timelines for a, b, _ in t.steps)


def compressed_round_bytes(cfg: RunConfig) -> int:
    """Bytes of one round's compressed pseudo-gradient: H steps of one site from θ_0, encoded
    with the run's uplink codec (the payload a push carries, without framing)."""
    model, data = build_model(cfg), build_data(cfg)
    optimizer, loss_fn = build_optimizer(model, cfg), build_loss(cfg)
    theta0 = flatten_parameters(model)
    windows = [DataRange(0, 0, data.shard_sizes[0])]
    for step in range(cfg.inner.steps_per_round):
        inner_step(model, optimizer, cfg.inner, step, *data.batch(windows, step, 0, 1), loss_fn=loss_fn)
    delta = theta0 - flatten_parameters(model)
    codec = parse_pipeline(cfg.compression.uplink)
    chunks, _ = encode_chunks(codec, delta, cfg.compression.chunk_elements, round_=0)
    return sum(len(c.payload) for c in chunks)


# -- processes ----------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn_rank(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """This script's ``_rank`` entry under torchrun (one rank), in its own process group."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    cmd += ["--max-restarts=0", str(Path(__file__).resolve()), "_rank", *args]
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=worker_env(), start_new_session=True
        )


def wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float, what: str, logs: Path) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            code = proc.wait(max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"{what}: a process exited with {code}; see the logs in {logs}")
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{what} did not finish in {timeout_s:.0f}s; see the logs in {logs}") from None
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc)


def run_alone(settings: Settings, workdir: Path, timeout_s: float) -> list[Timeline]:
    """Both sites at once, training with no outer sync (3 rounds' steps at most: a rate)."""
    workdir.mkdir(parents=True)
    config = workdir / "alone.json"
    config.write_text(dataclasses.replace(settings, rounds=min(settings.rounds, 3)).run_config().to_json())
    outs = [workdir / f"alone-{i}.json" for i in range(len(SITES))]
    procs = [
        spawn_rank(
            ["--alone", str(config), "--shard", str(i), "--timeline", str(out)], workdir / f"alone-{i}.log"
        )
        for i, out in enumerate(outs)
    ]
    wait_all(procs, timeout_s, "the no-sync run", workdir)
    return [Timeline.read(out) for out in outs]


def hashes_agree(run_dir: Path, rounds: int) -> bool:
    """Every site reported every round's hash of every fragment and each matched; each round log
    chains; every round had both sites. (A run of P > 1 fragments keeps one log per fragment, in
    ``fragment-N/``.)"""
    logs = [run_dir] if (run_dir / "rounds.jsonl").exists() else sorted(run_dir.glob("fragment-*"))
    return bool(logs) and all(_fragment_agrees(d, rounds) for d in logs)


def _fragment_agrees(log_dir: Path, rounds: int) -> bool:
    log = [json.loads(line) for line in (log_dir / "rounds.jsonl").read_text().splitlines()]
    reports = [json.loads(line) for line in (log_dir / "reports.jsonl").read_text().splitlines()]
    chained = all(b["base_hash"] == a["state_hash"] for a, b in itertools.pairwise(log))
    complete = [r["round"] for r in log] == list(range(rounds)) and all(
        sorted(r["contributors"]) == sorted(SITES) for r in log
    )
    reported = {(r["round"], r["site"]) for r in reports} >= {(r, s) for r in range(rounds) for s in SITES}
    return chained and complete and reported and all(r["hash_ok"] for r in reports)


def run_row(
    settings: Settings, workdir: Path, mode: str, link_mbps: float, timeout_s: float
) -> dict[str, Any]:
    """One run of coordinator and sites behind their proxies; its row of figures."""
    streaming = mode == "streaming"
    fragments = settings.fragments if streaming else 1
    overlap = settings.overlap_steps if streaming else 0
    cfg = settings.run_config(fragments, overlap)
    workdir.mkdir(parents=True)
    config = workdir / "run.json"
    config.write_text(cfg.to_json())
    port = free_port()
    target = f"127.0.0.1:{port}"
    serve = ["coordinator", "serve", "--config", str(config), "--port", str(port)]
    serve += ["--run-dir", str(workdir / "coord"), "--insecure"]
    link = LinkConfig(latency_ms=settings.rtt_ms / 2, bandwidth_mbps=link_mbps)
    proxies = {name: ProxyThread(target, link) for name in SITES}
    coordinator = spawn_geodiloco(serve, workdir / "coordinator.log")
    outs = {name: workdir / f"{name}.json" for name in SITES}
    started = time.monotonic()
    try:
        sites = [
            spawn_rank(
                ["--coordinator", proxies[name].address, "--site", name, "--timeline", str(outs[name])],
                workdir / f"{name}.log",
            )
            for name in SITES
        ]
        wait_all(sites, timeout_s, f"{mode} at {link_mbps:.2f} Mbit/s", workdir)
        status = fetch_status(target, None)
        request_shutdown(target, None)
        coordinator.wait(timeout=60)
    finally:
        if coordinator.poll() is None:
            kill_tree(coordinator)
        for proxy in proxies.values():
            proxy.close()
    timelines = [Timeline.read(outs[name]) for name in SITES]
    start = min(t.steps[0][0] for t in timelines)
    end = max(t.steps[-1][1] for t in timelines)
    rates = [peak_to_mean(proxies[name].proxy.rate_profile(start, end)) for name in SITES]
    busy, idle = zip(*(step_times(t) for t in timelines), strict=True)
    wan_bytes = [proxies[name].proxy.bytes_forwarded for name in SITES]
    return {
        "mode": mode,
        "fragments": fragments,
        "overlap_steps": overlap,
        "mix_alpha": settings.mix_alpha if streaming else None,
        "link_mbps": round(link_mbps, 3),
        "rtt_ms": settings.rtt_ms,
        "throughput_ratio": math.nan,  # set once the no-sync run after this one is in
        "compute_share": statistics.fmean(compute_share(t) for t in timelines),
        "peak_to_mean_rate": max((r for r in rates if r is not None), default=None),
        "final_eval_loss": status.history[-1].eval_loss if status.history else math.nan,
        "hashes_agree": hashes_agree(workdir / "coord", cfg.rounds),
        "stolen_fraction": stolen_fraction(timelines),
        "step_s_sender_busy": statistics.fmean(d for ds in busy for d in ds) if any(busy) else None,
        "step_s_sender_idle": statistics.fmean(d for ds in idle for d in ds) if any(idle) else None,
        "tokens_per_s": sum(tokens_per_s(t) for t in timelines),
        "wan_bytes_per_site_round": statistics.fmean(wan_bytes) / cfg.rounds,
        "wall_s": time.monotonic() - started,
    }


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_rank"]:
        rank_main(argv[1:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32, help="H, inner steps per round")
    parser.add_argument("--fragments", type=int, default=1, help="P of the streaming rows")
    parser.add_argument("--overlap", type=int, default=-1, help="τ of the streaming rows (-1: H // P - 1)")
    parser.add_argument("--mix-alpha", type=float, default=0.5, help="α of the streaming rows")
    parser.add_argument("--rtt-ms", type=float, default=100.0)
    parser.add_argument("--keep", type=Path, help="keep the processes' logs and timelines here")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="rows to run (default both)"
    )
    parser.add_argument("--sized-only", action="store_true", help="leave out the 4x slower link")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 2 rounds of 4 steps, one link")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the processes it started, too
    settings = Settings(
        rounds=2 if args.smoke else args.rounds,
        steps_per_round=4 if args.smoke else args.steps,
        fragments=args.fragments,
        overlap_steps=args.overlap,
        mix_alpha=args.mix_alpha,
        rtt_ms=args.rtt_ms,
        smoke=args.smoke,
    )
    settings.run_config(settings.fragments, settings.overlap_steps)  # a bad P, τ or α: refused now
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="geodiloco-wan-") as scratch:
        root = args.keep or Path(scratch)
        root.mkdir(parents=True, exist_ok=True)
        push_bytes = compressed_round_bytes(settings.run_config())
        alone = [run_alone(settings, root / "no-sync-0", args.timeout)]
        round_s = settings.steps_per_round * mean_step_s(alone[0])
        sized = push_bytes * 8 / (settings.transfer_share * round_s) / 1e6
        if args.smoke:
            sized *= 2
        print(
            f"no outer sync: {no_sync_tps(alone[0]):.0f} tokens/s, a round's compute {round_s:.2f}s; a "
            f"round's push {push_bytes} bytes: link {sized:.2f} Mbit/s and {sized / SLOWER:.2f} Mbit/s",
            flush=True,
        )
        rows = []
        links = (sized,) if args.smoke or args.sized_only else (sized, sized / SLOWER)
        for i, (mbps, mode) in enumerate(itertools.product(links, args.modes)):
            row = run_row(settings, root / f"{i}-{mode}", mode, mbps, args.timeout)
            # the machine's load drifts: each row against no-sync runs just before and just after it
            alone.append(run_alone(settings, root / f"no-sync-{i + 1}", args.timeout))
            row["no_sync_tokens_per_s"] = (no_sync_tps(alone[-2]) + no_sync_tps(alone[-1])) / 2
            row["throughput_ratio"] = row["tokens_per_s"] / row["no_sync_tokens_per_s"]
            print(
                f"{mode:9s} P={row['fragments']} τ={row['overlap_steps']} at {row['link_mbps']:.2f} "
                f"Mbit/s: throughput x{row['throughput_ratio']:.3f} (compute share "
                f"{row['compute_share']:.3f}), peak/mean rate {row['peak_to_mean_rate']}, eval loss "
                f"{row['final_eval_loss']:.4f}, stolen {row['stolen_fraction']:.3f}, hashes agree: "
                f"{row['hashes_agree']} ({row['wall_s']:.0f}s)",
                flush=True,
            )
            rows.append(row)
    results = {
        "settings": asdict(settings),
        "num_params": sum(p.numel() for p in build_model(settings.run_config()).parameters()),
        "round_push_bytes": push_bytes,
        "round_compute_s": round_s,
        "no_sync_tokens_per_s": [no_sync_tps(t) for t in alone],
        "rows": rows,
    }
    print(json.dumps(results, indent=2))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
