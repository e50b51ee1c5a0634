"""Outer-sync time of a site by parallel layout: the same model as a 2-rank DDP site and a 2-rank FSDP2 site.

Run:  .venv/bin/python benchmarks/outer_sync.py --json runs/outer_sync.json

For each layout (alternated, ``--repeats`` times) this starts a real coordinator process
(plaintext on loopback) serving a one-site run, a WAN proxy in front of it (``geodiloco.app.wan``:
``--bandwidth-mbps`` per TCP connection, i.e. per rank's link, and ``--latency-ms`` one way), and
a torchrun site whose ranks run this file's ``--worker`` loop: the reference GPT made larger
(``--n-layer``, ``--d-model``), ``--inner-steps`` inner steps per round, and around each outer
sync a timer. The outer-sync time is that of the ``sync.step`` call that syncs: encode the
rank's part of Δ, push it, wait for the commit (one site: as soon as every rank's part is in),
pull the rank's share of the update, pass chunks among the ranks, apply, and hash. The first
round (connections warming up) is left out. Printed per layout: median, min and max of the
slowest rank's time per round, the elements each rank holds and pushes, and the bytes it sent
and received per round.

``--smoke`` (2 measured rounds of a 1-layer model, no emulated WAN) only checks that the benchmark
still runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from geodiloco.app.wan import LinkConfig, ProxyThread
from geodiloco.config import RunConfig

SITE = "bench"
# OuterSync's steps within one sync, timed from here by wrapping its methods (no library change):
# Δ with its error-feedback compensation ("encode"; the chunks themselves are compressed as the
# push stream sends them, inside "exchange"), push + wait for the commit + pull, decode and
# apply, hash.
# phase -> the method timed on each fragment's sync (a blocking run has one fragment)
PHASES = {"encode": "encode_delta", "exchange": "exchange", "apply": "apply", "hash": "digest"}


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "run_id": "outer-sync-bench",
        "sites": [SITE],
        "rounds": args.rounds + 1,
        "heartbeat_interval_s": 2.0,
        "lease_s": 60.0,
        "model": {"n_layer": args.n_layer, "n_head": 4, "d_model": args.d_model, "seq_len": 64},
        "data": {"max_bytes": 400_000, "batch_size": 2, "eval_sequences": 8, "shards": 4},
        "inner": {"steps_per_round": args.inner_steps},
        "outer": {"optimizer": "fedavg", "lr": 1.0, "momentum": 0.0},
        "compression": {"uplink": args.codec, "downlink": args.codec},
    }


def start_coordinator(cfg_path: Path, workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    port_file = workdir / "port"
    cmd = [sys.executable, "-m", "geodiloco", "coordinator", "serve", "--config", str(cfg_path)]
    cmd += ["--port", "0", "--port-file", str(port_file), "--insecure", "--exit-when-finished"]
    with open(workdir / "coordinator.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((workdir / "coordinator.log").read_text()[-3000:])
        time.sleep(0.1)
    return proc, int(port_file.read_text())


def run_layout(layout: str, args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    """One run of a site in ``layout``; returns each rank's measurements."""
    workdir.mkdir(parents=True)
    cfg_path = workdir / "run.json"
    cfg_path.write_text(RunConfig.from_dict(run_config(args)).to_json())
    coordinator, port = start_coordinator(cfg_path, workdir)
    link = LinkConfig(latency_ms=args.latency_ms, bandwidth_mbps=args.bandwidth_mbps)
    site = None
    try:
        with ProxyThread(f"127.0.0.1:{port}", link) as proxy:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={args.nproc}",
            ]
            cmd += [
                __file__,
                "--worker",
                "--coordinator",
                proxy.address,
                "--layout",
                layout,
                "--out",
                str(workdir),
            ]
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
            with open(workdir / "site.log", "ab") as log:
                site = subprocess.Popen(
                    cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
                )
            if site.wait(timeout=args.timeout_s) != 0:
                raise RuntimeError((workdir / "site.log").read_text()[-3000:])
        coordinator.wait(timeout=60)
    finally:
        for proc in (site, coordinator):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(args.nproc)]


def summarise(layout: str, ranks: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Per round, the slowest rank's sync time (the site is synced when its last rank is); per
    phase, the median over rounds and ranks."""
    per_round = [max(r["sync_s"][i] for r in run) for run in ranks for i in range(len(run[0]["sync_s"]))]
    phases = {
        name: statistics.median(t for run in ranks for r in run for t in r["phases"][name]) for name in PHASES
    }
    first = ranks[0]
    return {
        "layout": layout,
        "rounds_measured": len(per_round),
        "sync_s_median": statistics.median(per_round),
        "sync_s_min": min(per_round),
        "sync_s_max": max(per_round),
        "sync_s_all": per_round,
        "phase_s_median": phases,
        "params": first[0]["params"],
        "local_elements_per_rank": [r["local_numel"] for r in first],
        "pushed_elements_per_rank": [r["owned_numel"] for r in first],
        "pushed_chunks_per_rank": [r["chunks"] for r in first],
        "sent_bytes_per_round_per_rank": [r["sent_per_round"] for r in first],
        "received_bytes_per_round_per_rank": [r["received_per_round"] for r in first],
    }


def print_table(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    link = f"{args.bandwidth_mbps:g} Mbit/s per rank" if args.bandwidth_mbps else "unlimited"
    print(
        f"\nouter sync, {results[0]['params']:,} parameters, {args.nproc} ranks, {args.codec}, "
        f"link {link}, latency {args.latency_ms:g} ms"
    )
    head = (
        "| layout | rounds | median s | min s | max s | elements held/pushed per rank "
        "| chunks pushed per rank | MB sent/received per rank per round |"
    )
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for r in results:
        held = " / ".join(
            f"{h:,}/{p:,}"
            for h, p in zip(r["local_elements_per_rank"], r["pushed_elements_per_rank"], strict=True)
        )
        chunks = " / ".join(str(c) for c in r["pushed_chunks_per_rank"])
        io = " / ".join(
            f"{s / 1e6:.2f}/{v / 1e6:.2f}"
            for s, v in zip(
                r["sent_bytes_per_round_per_rank"], r["received_bytes_per_round_per_rank"], strict=True
            )
        )
        print(
            f"| {r['layout']} | {r['rounds_measured']} | {r['sync_s_median']:.3f} | {r['sync_s_min']:.3f} | "
            f"{r['sync_s_max']:.3f} | {held} | {chunks} | {io} |"
        )
    print(
        "\nmedian seconds per phase (over ranks and rounds): "
        + "; ".join(
            f"{r['layout']}: " + ", ".join(f"{k} {v:.3f}" for k, v in r["phase_s_median"].items())
            for r in results
        )
    )
    if len(results) == 2:
        print(
            f"\n{results[1]['layout']} / {results[0]['layout']} median sync time: "
            f"{results[1]['sync_s_median'] / results[0]['sync_s_median']:.2f}x"
        )


def driver(args: argparse.Namespace) -> None:
    runs: dict[str, list[list[dict[str, Any]]]] = {layout: [] for layout in args.layouts}
    with tempfile.TemporaryDirectory(prefix="outer-sync-") as tmp:
        for repeat in range(args.repeats):
            for layout in args.layouts:
                print(f"== {layout} (run {repeat + 1} of {args.repeats})", flush=True)
                runs[layout].append(run_layout(layout, args, Path(tmp) / f"{layout}-{repeat}"))
    results = [summarise(layout, ranks) for layout, ranks in runs.items()]
    print_table(results, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "worker")}
        args.json.write_text(json.dumps({"settings": settings, "results": results}, indent=2))


def time_phases(sync: Any) -> dict[str, list[float]]:
    """Accumulate, per sync, the time ``sync`` spends in each of :data:`PHASES`."""
    spent: dict[str, list[float]] = {name: [0.0] for name in PHASES}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*a: Any, **kw: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[name][-1] += time.perf_counter() - started

        return call

    for name, method in PHASES.items():
        for fragment in sync.fragments:
            setattr(fragment, method, timed(name, getattr(fragment, method)))
    return spent


def worker(args: argparse.Namespace) -> None:
    """One rank of the measured site (run by torchrun)."""
    from geodiloco.builders import build_data, build_model, build_optimizer
    from geodiloco.distributed import init_distributed, shutdown_distributed
    from geodiloco.site import connect
    from geodiloco.site.daemon.worker import die_with_parent
    from geodiloco.site.parallel.layout import ParallelConfig, build_mesh, data_parallel_rank, parallelize
    from geodiloco.workload.steps import inner_step

    die_with_parent()  # killing torchrun (on a timeout) takes the ranks with it
    rank, world = init_distributed()
    layout = ParallelConfig.parse(args.layout, world)
    mesh = build_mesh(layout)
    sync = connect(args.coordinator, SITE, data_parallel_size=layout.data_parallel)
    cfg = sync.config
    model = build_model(cfg)
    trained = parallelize(model, layout, mesh)
    sync.attach(model)
    optimizer = build_optimizer(model, cfg)
    data = build_data(cfg)
    dp_rank = data_parallel_rank(mesh)
    phases = time_phases(sync)
    sync_s: list[float] = []
    sent: list[int] = []
    received: list[int] = []
    while not sync.finished:
        step = sync.round * cfg.inner.steps_per_round + sync.steps_in_round
        batch = data.batch(sync.data, sync.steps_in_round, dp_rank, layout.data_parallel)
        inner_step(trained, optimizer, cfg.inner, step, *batch)
        before = (sync.bytes_sent, sync.bytes_received)
        for spent in phases.values():
            spent[-1] = 0.0
        started = time.perf_counter()
        if sync.step(tokens=data.tokens(batch)):
            sync_s.append(time.perf_counter() - started)
            for spent in phases.values():
                spent.append(0.0)
            sent.append(sync.bytes_sent - before[0])
            received.append(sync.bytes_received - before[1])
    assert sync.shards is not None
    result = {
        "rank": rank,
        "params": sync.shards.num_params,
        "local_numel": sync.shards.local_numel,
        "owned_numel": sync.shards.owned_numel,
        "chunks": len(list(sync.shards.wire_segments(cfg.compression.chunk_elements))),
        "sync_s": sync_s[1:],  # round 0 opens the connections
        "phases": {name: spent[1:-1] for name, spent in phases.items()},
        "sent_per_round": statistics.median(sent[1:]),
        "received_per_round": statistics.median(received[1:]),
    }
    (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(result))
    sync.close()
    del trained
    shutdown_distributed()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["ddp", "fsdp"])
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds per run (one more is run)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per layout, alternated")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=320)
    parser.add_argument("--inner-steps", type=int, default=2)
    parser.add_argument("--codec", default="q8|zstd:1")
    parser.add_argument(
        "--bandwidth-mbps", type=float, default=100.0, help="per rank's connection; 0: no limit"
    )
    parser.add_argument("--latency-ms", type=float, default=20.0)
    parser.add_argument("--timeout-s", type=float, default=900.0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--coordinator", help=argparse.SUPPRESS)
    parser.add_argument("--layout", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument(
        "--smoke", action="store_true", help="2 rounds of a tiny model, no WAN: does it still run"
    )
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.n_layer, args.d_model, args.bandwidth_mbps, args.latency_ms = 2, 1, 64, 0.0, 0.0
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
