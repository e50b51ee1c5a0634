"""Outer-sync cost at scale: overhead per round against a floor measured in the same run.

Run:  nice -n 10 .venv/bin/python benchmarks/scale.py --json runs/scale.json
      (--smoke: a 200k-parameter run of a few seconds)

For each case (parameters x sites) this starts a real coordinator process (`geodiloco
coordinator serve`, plaintext loopback, durable run directory) whose model is one flat seeded
parameter of the case's size (``workload.model = scale_model:build_flat_model``), and one synthetic
site process per site. A synthetic site trains nothing: each round it pushes a seeded
pseudo-gradient through the real client (encoded chunk by chunk as the stream sends it),
pulls the committed update, decodes it and adds and hashes it chunk by chunk as a site
applies it. Every byte crosses the real client, wire, coordinator and durable state. The sites
run in Linux's idle scheduling class (``SCHED_IDLE``; nice +10 where that is refused): in a
deployment they run on machines of their own, not on the coordinator's two cores.

Per case, over the measured rounds (the first is left out):
- ``overhead_s``: median time between consecutive round ends (the sites compute nothing, so
  the whole round is outer-sync overhead);
- ``floor_s``: the same compressed bytes (every site's push and pull) streamed over a raw
  loopback gRPC stream up and down, plus four ``copy_`` passes over the fp32 model; the median
  of ``FLOOR_SAMPLES`` measurements (``floor_samples_s``), as the overhead is a median of
  rounds: one measurement alone moved by up to 2.6x between runs on this project's VM;
- ``coordinator_peak_rss_bytes``: the coordinator's VmHWM over its whole life, start-up
  included (below ``DRY_STEP_APART_PARAMS``, the --smoke case, its dry step's throwaway
  model, gradient and AdamW state count here; from there on that step runs in a child);
- ``serving_peak_rss_bytes``: its VmHWM from the moment it serves (reset then through
  ``/proc/PID/clear_refs``) to the last round: what rounds and sites cost;
- ``max_loop_stall_ms``: the longest Heartbeat round trip of a probe calling every 50 ms;
- ``disk_bytes_per_round``: bytes of the durable files a commit wrote (its update log file and
  round-log line; no snapshot falls in the measured rounds), next to ``update_bytes``;
- ``restart_to_serving_s``: SIGKILL after the last round, restart, until a Join is served
  (the restart loads the snapshot of θ_0 written when the run began and replays every round);
- ``lease_expiries``: from the coordinator's journal (must be 0);
- ``coordinator_cpu_s_per_round`` and ``site_cpu_s_per_round``: CPU seconds (every thread) per
  measured round, of the coordinator (``/proc`` sampled by the probe) and of a site (the mean of
  the sites' medians): on these shared cores they tell where the round's time goes, and they
  move less from run to run than the round's length.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import torch

from geodiloco.compression import EncodedChunk, Place, parse_pipeline
from geodiloco.config import RunConfig
from geodiloco.exchange import LazyChunks, StreamFacts, WireChunk
from geodiloco.pages import keep_freed_pages
from geodiloco.params import Checksum, add_encoded_and_hash
from geodiloco.segment import Segment
from geodiloco.site.edge.client import Heartbeater, OuterSyncClient

HERE = Path(__file__).resolve().parent
CODEC = "q8|zstd:1"
CHUNK = 1 << 20
PROBE_S = 0.05
FLOOR_SAMPLES = 3  # floor measurements per case, of which the median is floor_s
SITE_NICENESS = 10  # relative to the coordinator and the probe, where SCHED_IDLE is refused
AUTOGROUP_NICENESS = 19  # of each site's session (lower_priority)


def run_config(params: int, sites: int, rounds: int, rule: str | None = None) -> RunConfig:
    return RunConfig.from_dict(
        {
            **({"aggregation": {"rule": rule}} if rule else {}),
            "run_id": "scale-bench",
            "sites": [f"site-{i}" for i in range(sites)],
            "min_sites": sites,  # every round is measured with every site in it
            "rounds": rounds + 100,  # never finished: the restart below must replay, as after a crash
            "round_timeout_s": 3600.0,
            "heartbeat_interval_s": 1.0,
            "lease_s": 15.0,
            "data": {"max_bytes": 200_000, "shards": max(8, sites), "batch_size": 1},
            "inner": {"steps_per_round": 1},
            "outer": {"optimizer": "nesterov", "lr": 0.7, "momentum": 0.9},
            "compression": {"uplink": CODEC, "downlink": CODEC, "chunk_elements": CHUNK},
            "workload": {
                "model": "scale_model:build_flat_model",
                "loss": "geodiloco.workload.loss:build_model_loss",
                "options": {"params": params},
            },
        }
    )


# -- synthetic site ---------------------------------------------------------------------------


class SeededDelta(LazyChunks):
    """A round's pseudo-gradient, encoded chunk by chunk when the push stream takes it."""

    def __init__(self, numel: int, base: torch.Tensor, round_: int) -> None:
        self.numel, self.base, self.round = numel, base, round_
        self.codec = parse_pipeline(CODEC)

    def __len__(self) -> int:
        return -(-self.numel // CHUNK)

    def chunk(self, i: int) -> WireChunk:
        start = i * CHUNK
        n = min(CHUNK, self.numel - start)
        values = self.base[:n] * (1e-3 * (1 + 0.1 * self.round + 0.01 * i))
        return WireChunk(Segment(start, 1, n, n), self.codec.encode(values))


def lower_priority() -> None:
    # Each site starts a session of its own, and Linux weighs a session's autogroup against the
    # coordinator's as an equal whatever the policy of the threads inside it: with 8 sites the
    # coordinator's event loop, runnable, waited up to 74 ms behind a site's thread (perf
    # sched). The group's nice (19: weight 15 against 1024) makes the idle class below hold
    # across sessions.
    with contextlib.suppress(OSError):  # no autogroups (kernel, or /proc absent): policy alone
        Path("/proc/self/autogroup").write_text(str(AUTOGROUP_NICENESS))
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):  # not Linux, or refused
        os.nice(SITE_NICENESS)


def site_main(args: argparse.Namespace) -> None:
    # In a deployment every site has its own machines; here they share the coordinator's cores.
    # The idle class keeps their CPU from counting as the coordinator's stall: they get every
    # cycle the coordinator and the probe do not use, and none they want. Nice +10 did not
    # (8 sites at nice +10 weigh 8 x 110 against the coordinator's 1024: nearly half the CPU).
    lower_priority()
    keep_freed_pages()  # as a site's ranks do (site/worker.py)
    torch.set_num_threads(1)  # as a site's ranks run (torchrun's OMP_NUM_THREADS=1): idle OpenMP
    # threads spin, and here they would spin on the coordinator's cores
    client = OuterSyncClient(args.target, args.site)
    info = client.join()
    beat = Heartbeater(client, info.heartbeat_interval_s)
    beat.start()
    gen = torch.Generator().manual_seed(int(args.site.rpartition("-")[2]))
    base = torch.randn(CHUNK, generator=gen)
    scratch = torch.zeros(CHUNK)
    codec = parse_pipeline(CODEC)
    parts: dict[int, Checksum] = {}  # a round's pulled chunks, hashed by sequence number

    def apply(seq: int, chunk: EncodedChunk, facts: StreamFacts) -> None:
        # added from its codes and hashed in one pass, as a one-rank site does (ShardMap.add_encoded_range),
        # into a scratch span: the synthetic site holds no θ
        place = Place.span(facts.round, chunk.start, chunk.numel)
        raw = codec.unpack(chunk.payload, chunk.numel, place)
        parts[seq], _ = add_encoded_and_hash(codec, raw, place, scratch[: chunk.numel])

    rows = []
    for r in range(args.rounds):
        t0, sent, received = time.time(), client.bytes_sent, client.bytes_received
        cpu = time.process_time()
        client.push(r, CODEC, SeededDelta(args.params[0], base, r), tokens=1000, timeout_s=3600)
        t_pushed = time.time()
        parts.clear()
        # applied as it arrives, payloads not kept, as a one-rank site does (site/outer_sync.py)
        pulled = client.pull(r, timeout_s=3600, on_chunk=apply, keep_payloads=False)
        t_pulled = time.time()
        if pulled.codec != CODEC or sorted(parts) != list(range(pulled.total_chunks)):
            raise RuntimeError(
                f"round {r}: pulled {len(parts)} of {pulled.total_chunks} {pulled.codec} chunks"
            )
        checksum = Checksum()
        for seq in range(pulled.total_chunks):
            checksum = checksum.merge(parts[seq])
        beat.round = r + 1
        rows.append(
            {
                "round": r,
                "t0": t0,
                "t_pushed": t_pushed,
                "t_pulled": t_pulled,
                "t1": time.time(),
                "cpu_s": time.process_time() - cpu,  # every thread of this site's process
                "sent": client.bytes_sent - sent,
                "received": client.bytes_received - received,
            }
        )
    beat.stop()
    client.leave("benchmark done")
    Path(args.out).write_text(json.dumps(rows))


# -- the floor: raw gRPC and copy passes -------------------------------------------------------


def floor_server_main(args: argparse.Namespace) -> None:
    """A bare gRPC server: Up swallows a stream of byte messages, Down sends one."""

    def up(requests: Iterator[bytes], context: Any) -> bytes:
        for _ in requests:
            pass
        return b""

    def down(request: bytes, context: Any) -> Iterator[bytes]:
        total, size = json.loads(request)
        payload = os.urandom(size)
        for at in range(0, total, size):
            yield payload[: min(size, total - at)]

    identity = lambda b: b  # noqa: E731
    handler = grpc.method_handlers_generic_handler(
        "floor.Floor",
        {
            "Up": grpc.stream_unary_rpc_method_handler(up, identity, identity),
            "Down": grpc.unary_stream_rpc_method_handler(down, identity, identity),
        },
    )
    from concurrent.futures import ThreadPoolExecutor

    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    server = grpc.server(ThreadPoolExecutor(4), options=options)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(args.out).write_text(str(port))
    server.wait_for_termination()


def raw_stream_s(up_bytes: list[int], down_bytes: list[int], message_bytes: int) -> float:
    """Every site's bytes up, then down, each site on its own stream, all at once."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        server = subprocess.Popen([sys.executable, __file__, "--floor-server", "--out", str(port_file)])
        try:
            while not port_file.exists():
                time.sleep(0.05)
            options = [
                ("grpc.max_receive_message_length", 64 << 20),
                ("grpc.max_send_message_length", 64 << 20),
            ]
            channel = grpc.insecure_channel(f"127.0.0.1:{port_file.read_text()}", options=options)
            up = channel.stream_unary("/floor.Floor/Up")
            down = channel.unary_stream("/floor.Floor/Down")
            payload = os.urandom(message_bytes)

            def send(total: int) -> None:
                up(payload[: min(message_bytes, total - at)] for at in range(0, total, message_bytes))

            def receive(total: int) -> None:
                for _ in down(json.dumps([total, message_bytes]).encode()):
                    pass

            send(message_bytes)  # warm the connection
            began = time.perf_counter()
            for fn, sizes in ((send, up_bytes), (receive, down_bytes)):
                threads = [threading.Thread(target=fn, args=(n,)) for n in sizes]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            elapsed = time.perf_counter() - began
            channel.close()
            return elapsed
        finally:
            server.terminate()
            server.wait()


def copy_passes_s(params: int, passes: int = 4) -> float:
    src, dst = torch.randn(params), torch.empty(params)
    dst.copy_(src)
    began = time.perf_counter()
    for _ in range(passes):
        dst.copy_(src)
    return time.perf_counter() - began


# -- one case ----------------------------------------------------------------------------------


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    with open(log, "ab") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def start_coordinator(
    config: Path, run_dir: Path, workdir: Path, log: str
) -> tuple[subprocess.Popen[bytes], str]:
    port_file = workdir / "port"
    port_file.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "geodiloco", "coordinator", "serve", "--config", str(config)]
    cmd += ["--port", "0", "--port-file", str(port_file), "--run-dir", str(run_dir), "--insecure"]
    proc = spawn(cmd, workdir / log)
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError((workdir / log).read_text()[-3000:])
        time.sleep(0.02)
    return proc, f"127.0.0.1:{port_file.read_text()}"


def reset_peak_rss(pid: int) -> None:
    """Start VmHWM afresh at the current RSS (Linux: ``clear_refs`` 5)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process ``pid``, every thread (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_between(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """CPU seconds spent between two moments, from the samples nearest them."""
    at = lambda t: min(samples, key=lambda s: abs(s[0] - t))[1]  # noqa: E731
    return at(end) - at(start)


class Probe(threading.Thread):
    """Heartbeat every 50 ms as site-0; records each round trip the coordinator answered.

    A refusal (site-0 not joined yet, or gone after the run ended) is answered on the
    same event loop, so it measures a stall as well as a success does; only calls that
    never reached the server are left out.
    """

    def __init__(self, target: str, run_id: str, coordinator_pid: int) -> None:
        super().__init__(daemon=True)
        self.client = OuterSyncClient(target, "site-0")
        self.client.run_id = run_id
        self.pid = coordinator_pid
        self.samples: list[tuple[float, float]] = []
        self.cpu: list[tuple[float, float]] = []  # (when, the coordinator's CPU seconds so far)
        self.unanswered: collections.Counter[str] = collections.Counter()
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(PROBE_S):
            with contextlib.suppress(OSError):  # the coordinator gone
                self.cpu.append((time.time(), cpu_seconds(self.pid)))
            began = time.time()
            try:
                self.client.heartbeat(0)
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    self.unanswered[e.code().name] += 1
                    continue
            self.samples.append((began, time.time() - began))


def run_case(params: int, sites: int, rounds: int, workdir: Path, rule: str | None = None) -> dict[str, Any]:
    workdir.mkdir(parents=True)
    cfg = run_config(params, sites, rounds, rule)
    config, run_dir = workdir / "run.json", workdir / "coord"
    config.write_text(cfg.to_json())
    coordinator, target = start_coordinator(config, run_dir, workdir, "coordinator.log")
    startup_rss = peak_rss(coordinator.pid)
    reset_peak_rss(coordinator.pid)
    probe = Probe(target, cfg.run_id, coordinator.pid)
    probe.start()
    outs = [workdir / f"site-{i}.json" for i in range(sites)]
    procs = []
    for i in range(sites):
        cmd = [sys.executable, __file__, "--site", f"site-{i}", "--target", target, "--params", str(params)]
        cmd += ["--rounds", str(rounds), "--out", str(outs[i])]
        procs.append(spawn(cmd, workdir / f"site-{i}.log"))
    try:
        for i, proc in enumerate(procs):
            if proc.wait(timeout=7200) != 0:
                raise RuntimeError((workdir / f"site-{i}.log").read_text()[-3000:])
        probe.stop.set()
        rss = max(startup_rss, peak_rss(coordinator.pid))
        serving_rss = peak_rss(coordinator.pid)
        coordinator.send_signal(signal.SIGKILL)
        coordinator.wait()
        began = time.perf_counter()
        coordinator, target = start_coordinator(config, run_dir, workdir, "coordinator-restart.log")
        served = OuterSyncClient(target, "site-0")
        served.join()
        restart_s = time.perf_counter() - began
        served.close()
    finally:
        for proc in (*procs, coordinator):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait()
    per_site = [json.loads(out.read_text()) for out in outs]
    (workdir / "probe.json").write_text(json.dumps(probe.samples))  # (sent at, round trip) per call
    ends = [max(site[r]["t1"] for site in per_site) for r in range(rounds)]
    periods = [b - a for a, b in itertools.pairwise(ends)]
    measured = (min(site[1]["t1"] for site in per_site) if rounds > 1 else 0.0, ends[-1])
    stalls = [d for t, d in probe.samples if measured[0] <= t <= measured[1]] or [d for _, d in probe.samples]
    if not stalls:
        raise RuntimeError(f"the stall probe got no answer from the coordinator: {dict(probe.unanswered)}")
    log = [json.loads(x) for x in (run_dir / "rounds.jsonl").read_text().splitlines()]
    update_files = sorted((run_dir / "updates").glob("*.update"))
    line_bytes = (run_dir / "rounds.jsonl").stat().st_size / len(log)
    events = (run_dir / "events.jsonl").read_text().splitlines()
    up = [int(statistics.mean(r["sent"] for r in site[1:] or site)) for site in per_site]
    down = [int(statistics.mean(r["received"] for r in site[1:] or site)) for site in per_site]
    floors = [raw_stream_s(up, down, CHUNK) + copy_passes_s(params) for _ in range(FLOOR_SAMPLES)]
    return {
        "params": params,
        "sites": sites,
        "rule": cfg.aggregation.rule,
        "overhead_s": round(statistics.median(periods or [ends[0] - per_site[0][0]["t0"]]), 3),
        "floor_s": round(statistics.median(floors), 3),
        "floor_samples_s": [round(f, 3) for f in floors],
        "coordinator_peak_rss_bytes": rss,
        "serving_peak_rss_bytes": serving_rss,
        "max_loop_stall_ms": round(1000 * max(stalls), 1),
        "disk_bytes_per_round": int(statistics.mean(f.stat().st_size for f in update_files) + line_bytes),
        "restart_to_serving_s": round(restart_s, 2),
        "update_bytes": int(statistics.mean(r["update_bytes"] for r in log)),
        "push_bytes_per_site": int(statistics.mean(up)),
        "model_fp32_bytes": 4 * params,
        "lease_expiries": sum('"lease_expired"' in e for e in events),
        "rounds": rounds,
        # CPU per measured round: the coordinator's (all threads) and the mean of each site's median
        "coordinator_cpu_s_per_round": round(
            cpu_between(probe.cpu, ends[0], ends[-1]) / max(len(periods), 1), 3
        )
        if probe.cpu
        else None,
        "site_cpu_s_per_round": round(
            statistics.mean(statistics.median(r["cpu_s"] for r in site[1:] or site) for site in per_site), 3
        ),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    two = sorted((r for r in rows if r["sites"] == 2), key=lambda r: r["params"])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["params"] for r in two], [r["overhead_s"] for r in two], "o-", label="outer-sync overhead")
    ax.plot(
        [r["params"] for r in two], [r["floor_s"] for r in two], "s--", label="floor (raw gRPC + 4 copies)"
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("seconds per round (2 sites)")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def driver(args: argparse.Namespace) -> None:
    if args.smoke:
        cases = [(200_000, 2)]
        rounds = 3
    else:
        cases = [(p, 2) for p in args.params] + [(args.site_params, s) for s in args.sites if s != 2]
        rounds = args.rounds
    rows = []
    with tempfile.TemporaryDirectory(prefix="scale-") as tmp:
        root = args.keep or Path(tmp)
        for i, (params, sites) in enumerate(cases):
            row = run_case(params, sites, rounds, root / f"case-{i}", args.rule)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2))
        plot(rows, args.plot or args.json.with_suffix(".png"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, nargs="+", default=[10_000_000, 100_000_000])
    parser.add_argument(
        "--sites", type=int, nargs="+", default=[2, 4, 8], help="site counts at --site-params"
    )
    parser.add_argument("--site-params", type=int, default=100_000_000)
    parser.add_argument("--rounds", type=int, default=4, help="rounds per case (the first is left out)")
    parser.add_argument("--smoke", action="store_true", help="one 200k-parameter case: seconds")
    parser.add_argument("--rule", help="aggregation.rule (default: the run config's default)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path, help="default: the --json path with .png")
    parser.add_argument("--keep", type=Path, help="keep each case's logs and run directory here")
    parser.add_argument("--site", help=argparse.SUPPRESS)
    parser.add_argument("--target", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--floor-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.site:
        site_main(args)
    elif args.floor_server:
        floor_server_main(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
