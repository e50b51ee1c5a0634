"""A site's inner tokens/s with geodiloco's outer sync, against the same training in a plain torch loop.

Run:  .venv/bin/python benchmarks/inner.py --json runs/inner.json
      .venv/bin/python benchmarks/inner.py --activation-checkpointing none block selective --compile off on
      .venv/bin/python benchmarks/inner.py --device cuda --params 100M --batch 16 --mixed-precision bf16

For each configuration (activation checkpointing x compile) it starts a real coordinator process
(plaintext on loopback) serving a one-site run of ``--rounds`` + 1 rounds of ``--steps`` (H) inner
steps, and two worker processes on ``--device``, each holding the same model (the run's builders,
the same seed, the layout's activation checkpointing and compile), the same AdamW and the same
data builder:

- *plain*: a plain torch loop (forward, cross-entropy, backward, gradient clipping, step), no
  geodiloco past building the model: its batches are read in order from the data shards;
- *geodiloco*: the same loop with ``OuterSync`` attached as in the own-loop recipe
  (``docs/own-model.md``): batches from the coordinator's ledger (``sync.data``) and
  ``sync.step(tokens)`` after every step, which pushes Δ, waits for the round's commit, pulls
  and applies the update every H steps.

The workers take turns of ``--segment`` steps (10 by default), in alternating order (plain first
on even turns, geodiloco first on odd ones), so that the machine's drift falls on both alike; the
geodiloco loop's outer sync falls in its turn that reaches step H. The first round (allocator,
kernels, compilation, the first connection) is left out. Each worker is its own process, with
``--threads`` torch threads (default 1, as a site's ranks), so that its peak memory is its own:
``torch.cuda.max_memory_allocated`` on a GPU, the process's peak RSS (VmHWM, reset after the
first round) on the CPU. Evaluation and reports are left out of both loops: what is compared is
the inner loop with and without the outer sync.

Per configuration, one row: ``params``, ``device``, ``layout``, ``tokens_per_s_plain``,
``tokens_per_s_geodiloco``, ``ratio`` (geodiloco / plain), ``outer_sync_share`` (the time in
``sync.step`` over the geodiloco loop's time), ``peak_memory_bytes`` (the geodiloco worker's),
``activation_checkpointing``, ``compile``. ``--smoke``: a tiny model, 5 steps, 1 measured round.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from geodiloco.config import RunConfig

SITE = "inner"
# model shapes by size (the reference GPT; byte vocabulary, so the embeddings are small)
SIZES = {
    "0.5M": {"n_layer": 4, "n_head": 4, "d_model": 96, "seq_len": 64},  # the reference model
    "10M": {"n_layer": 8, "n_head": 8, "d_model": 320, "seq_len": 128},
    "100M": {"n_layer": 14, "n_head": 12, "d_model": 768, "seq_len": 256},
}
SMOKE = {"n_layer": 1, "n_head": 2, "d_model": 32, "seq_len": 16}
ROW_KEYS = (
    "params",
    "device",
    "layout",
    "tokens_per_s_plain",
    "tokens_per_s_geodiloco",
    "ratio",
    "outer_sync_share",
    "peak_memory_bytes",
    "activation_checkpointing",
    "compile",
)


def run_config(args: argparse.Namespace) -> RunConfig:
    return RunConfig.from_dict(
        {
            "run_id": "inner-bench",
            "sites": [SITE],
            "rounds": args.rounds + 1,
            "round_timeout_s": 3600.0,
            "heartbeat_interval_s": 2.0,
            "lease_s": 600.0,  # a compiling worker's first steps may take minutes
            "model": SMOKE if args.smoke else SIZES[args.params],
            "data": {"max_bytes": 4_000_000, "batch_size": args.batch, "eval_sequences": 8, "shards": 4},
            "inner": {"steps_per_round": args.steps, "lr": 1e-3},
        }
    )


def start_coordinator(cfg: RunConfig, workdir: Path) -> tuple[Any, str]:
    from geodiloco.testing.processes import spawn_geodiloco

    (workdir / "run.json").write_text(cfg.to_json())
    port_file = workdir / "port"
    cmd = ["coordinator", "serve", "--config", str(workdir / "run.json"), "--port", "0"]
    cmd += ["--port-file", str(port_file), "--run-dir", str(workdir / "coord"), "--insecure"]
    proc = spawn_geodiloco([*cmd, "--exit-when-finished"], workdir / "coordinator.log")
    deadline = time.monotonic() + 600
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError((workdir / "coordinator.log").read_text()[-3000:])
        time.sleep(0.1)
    return proc, f"127.0.0.1:{port_file.read_text()}"


class Memory:
    """The process's peak memory since :meth:`reset`: allocated CUDA memory on a GPU, RSS on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)

    def peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM in /proc/self/status")


def plain_ranges(sizes: list[int], first: int, count: int) -> list[Any]:
    """``count`` windows from window ``first`` of the shards read one after another (wrapping
    into the next pass): the plain loop's data, read as a ledger would hand it out."""
    from geodiloco.workload.data import DataRange

    total = sum(sizes)
    ranges = []
    while count:
        epoch, at = divmod(first, total)
        shard = 0
        while at >= sizes[shard]:
            at -= sizes[shard]
            shard += 1
        take = min(count, sizes[shard] - at)
        ranges.append(DataRange(shard, at, at + take, epoch))
        first, count = first + take, count - take
    return ranges


def worker(role: str, options: dict[str, Any], conn: Connection) -> None:
    """One of the two loops, in its own process: builds, then runs the next steps per request."""
    import torch.distributed as dist

    from geodiloco.builders import build_data, build_model, build_optimizer
    from geodiloco.site.parallel.layout import ParallelConfig, build_mesh, parallelize

    torch.set_num_threads(options["threads"])
    device = torch.device(options["device"])
    if device.type == "cuda":
        if device.index is None:  # "cuda": the current device, named by its index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    layout = ParallelConfig.parse(
        "ddp",
        1,
        options["mixed_precision"],
        activation_checkpointing=options["activation_checkpointing"],
        compile=options["compile"],
    )
    sync = None
    cfg = RunConfig.from_json(options["config"])
    if role == "geodiloco":
        from geodiloco.site import connect

        sync = connect(options["coordinator"], SITE)
        cfg = sync.config
    model = build_model(cfg).to(device)
    trained = parallelize(model, layout, build_mesh(layout, device.type))
    if sync is not None:
        sync.attach(model)
    optimizer = build_optimizer(model, cfg)
    data = build_data(cfg)
    sizes = list(data.shard_sizes)
    h, per_round = cfg.inner.steps_per_round, cfg.inner.steps_per_round * cfg.data.batch_size
    clip = cfg.inner.grad_clip or 0.0
    memory = Memory(device)
    done = 0  # steps so far

    def step(batch: tuple[torch.Tensor, ...]) -> None:
        *inputs, targets = batch
        logits = trained(*inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()

    def run_steps(count: int) -> dict[str, float]:
        nonlocal done
        sync_s, tokens = 0.0, 0
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started, cpu = time.perf_counter(), time.process_time()
        for _ in range(count):
            in_round = done % h
            source = sync.data if sync is not None else plain_ranges(sizes, done // h * per_round, per_round)
            batch = tuple(t.to(device, non_blocking=True) for t in data.batch(source, in_round, 0, 1))
            step(batch)
            tokens += data.tokens(batch)
            done += 1
            if sync is not None:
                before = time.perf_counter()
                sync.step(tokens=data.tokens(batch))
                sync_s += time.perf_counter() - before
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu
        return {"seconds": seconds, "cpu_s": cpu_s, "sync_s": sync_s, "tokens": tokens}

    conn.send({"params": sum(p.numel() for p in model.parameters())})
    while True:
        request = conn.recv()
        if request[0] == "steps":
            conn.send(run_steps(request[1]))
        elif request[0] == "reset_memory":  # after the warm-up
            memory.reset()
            conn.send({})
        else:
            conn.send({"peak_memory_bytes": memory.peak()})
            break
    if sync is not None:
        sync.close()
    dist.destroy_process_group()


def measure(args: argparse.Namespace, ac: str, compiled: bool, workdir: Path) -> dict[str, Any]:
    """One configuration: a coordinator, the two workers taking turns; its row and its segments."""
    cfg = run_config(args)
    coordinator, target = start_coordinator(cfg, workdir)
    ctx = mp.get_context("spawn")
    options = {
        "device": args.device,
        "threads": args.threads,
        "mixed_precision": args.mixed_precision,
        "activation_checkpointing": ac,
        "compile": compiled,
        "config": cfg.to_json(),
        "coordinator": target,
    }
    workers: dict[str, tuple[Any, Connection]] = {}
    segments: dict[str, list[dict[str, float]]] = {"plain": [], "geodiloco": []}
    try:
        for role in ("plain", "geodiloco"):
            here, there = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(role, options, there), daemon=True)
            proc.start()
            workers[role] = (proc, here)
        params = {role: _answer(w)["params"] for role, w in workers.items()}
        turns = args.steps // args.segment
        for index in range((args.rounds + 1) * turns):
            if index == turns:  # the first round warmed up: measure from here
                for w in workers.values():
                    w[1].send(("reset_memory",))
                    _answer(w)
            order = ("plain", "geodiloco") if index % 2 == 0 else ("geodiloco", "plain")
            for role in order:
                workers[role][1].send(("steps", args.segment))
                segments[role].append(_answer(workers[role]))
            if (index + 1) % turns == 0:
                took = {role: sum(s["seconds"] for s in segments[role][-turns:]) for role in order}
                said = ", ".join(f"{role} {t:.2f} s" for role, t in took.items())
                print(f"   round {index // turns}{' (warm-up)' if index < turns else ''}: {said}", flush=True)
        peaks = {}
        for role, w in workers.items():
            w[1].send(("finish",))
            peaks[role] = _answer(w)["peak_memory_bytes"]
        coordinator.wait(timeout=120)
    finally:
        for proc, _ in workers.values():
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        if coordinator.poll() is None:
            from geodiloco.testing.processes import kill_tree

            kill_tree(coordinator)
    assert params["plain"] == params["geodiloco"]
    plain, geo = segments["plain"][turns:], segments["geodiloco"][turns:]
    plain_rate = sum(r["tokens"] for r in plain) / sum(r["seconds"] for r in plain)
    geo_s = sum(r["seconds"] for r in geo)
    geo_rate = sum(r["tokens"] for r in geo) / geo_s
    row = {
        "params": params["plain"],
        "device": args.device,
        "layout": f"ddp, 1 rank, {args.mixed_precision}",
        "tokens_per_s_plain": plain_rate,
        "tokens_per_s_geodiloco": geo_rate,
        "ratio": geo_rate / plain_rate,
        "outer_sync_share": sum(r["sync_s"] for r in geo) / geo_s,
        "peak_memory_bytes": peaks["geodiloco"],
        "activation_checkpointing": ac,
        "compile": compiled,
    }
    assert tuple(row) == ROW_KEYS
    cpu = {role: sum(r["cpu_s"] for r in part) for role, part in (("plain", plain), ("geodiloco", geo))}
    detail = {
        "peak_memory_bytes_plain": peaks["plain"],
        # this process's CPU time: on a shared machine, steadier than wall time (not the outer
        # sync's waits, nor the coordinator's work)
        "tokens_per_cpu_s_plain": sum(r["tokens"] for r in plain) / cpu["plain"],
        "cpu_ratio": (sum(r["tokens"] for r in geo) / cpu["geodiloco"])
        / (sum(r["tokens"] for r in plain) / cpu["plain"]),
        "segments": segments,
    }
    return {"row": row, "detail": detail}


def _answer(w: tuple[Any, Connection], timeout_s: float = 1800) -> Any:
    proc, conn = w
    if not conn.poll(timeout_s):
        raise RuntimeError(f"a worker did not answer in {timeout_s:.0f} s")
    try:
        return conn.recv()
    except EOFError:
        raise RuntimeError(f"a worker died (exit code {proc.exitcode}); see its traceback above") from None


def print_table(rows: list[dict[str, Any]], details: list[dict[str, Any]], args: argparse.Namespace) -> None:
    first = rows[0]
    print(
        f"\ninner tokens/s, {first['params']:,} parameters on {first['device']} ({first['layout']}), "
        f"H={args.steps}, {args.rounds} measured rounds, batch {args.batch}"
    )
    head = (
        "| activation checkpointing | compile | plain tokens/s | geodiloco tokens/s | ratio "
        "| outer sync share | peak memory MB (geodiloco / plain) | plain tokens per CPU-s |"
    )
    print(head)
    print("|---" * (head.count("|") - 1) + "|")
    for row, detail in zip(rows, details, strict=True):
        print(
            f"| {row['activation_checkpointing']} | {'on' if row['compile'] else 'off'} "
            f"| {row['tokens_per_s_plain']:,.0f} | {row['tokens_per_s_geodiloco']:,.0f} | {row['ratio']:.4f} "
            f"| {row['outer_sync_share']:.2%} | {row['peak_memory_bytes'] / 1e6:,.0f} / "
            f"{detail['peak_memory_bytes_plain'] / 1e6:,.0f} | {detail['tokens_per_cpu_s_plain']:,.0f} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (both workers use it)")
    parser.add_argument("--params", default="0.5M", choices=tuple(SIZES), help="model size (default 0.5M)")
    parser.add_argument("--steps", type=int, default=100, help="inner steps per round, H (default 100)")
    parser.add_argument("--rounds", type=int, default=6, help="measured rounds (one more warms up)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (data.batch_size)")
    parser.add_argument("--mixed-precision", default="fp32", choices=("fp32", "bf16"))
    parser.add_argument(
        "--activation-checkpointing",
        nargs="+",
        default=["none"],
        choices=("none", "block", "selective"),
        help="one row per mode given",
    )
    parser.add_argument("--compile", nargs="+", default=["off"], choices=("off", "on"), help="one row each")
    parser.add_argument(
        "--threads",
        type=int,
        default=int(os.environ.get("OMP_NUM_THREADS", "1")),
        help="torch threads per worker (default: OMP_NUM_THREADS, else 1, as a site's ranks)",
    )
    parser.add_argument(
        "--segment", type=int, default=10, help="steps each loop runs per turn (divides --steps; default 10)"
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 5 steps, 1 measured round")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps, args.rounds, args.batch, args.segment = 5, 1, 2, 5
    if args.segment < 1 or args.steps % args.segment:
        parser.error(f"--segment: {args.segment} must divide --steps {args.steps}")
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device: torch sees no CUDA device")
    rows, details = [], []
    with tempfile.TemporaryDirectory(prefix="inner-bench-") as tmp:
        for i, (ac, comp) in enumerate(itertools.product(args.activation_checkpointing, args.compile)):
            print(f"== activation checkpointing {ac}, compile {comp}", flush=True)
            workdir = Path(tmp) / str(i)
            workdir.mkdir()
            measured = measure(args, ac, comp == "on", workdir)
            rows.append(measured["row"])
            details.append(measured["detail"])
    print_table(rows, details, args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"settings": settings, "rows": rows, "details": details}, indent=2))


if __name__ == "__main__":
    main()
