"""Peak memory of the coordinator and of one rank when the corpus is large: text is read in place.

Run:  .venv/bin/python benchmarks/corpus_memory.py --json runs/corpus_memory.json

For each size in ``--sizes-mb`` (default 4 and 200) this writes one text file of that size into a
temporary folder (words of random letters), runs a one-site run on it with ``data.max_bytes=0``
(all of it) as real processes on loopback — ``geodiloco coordinator serve`` and ``geodiloco site
run`` with one rank, the reference model, ``--rounds`` rounds of ``--steps`` inner steps — and
samples the peak resident set size (``VmHWM`` in ``/proc/PID/status``) of the coordinator and of
the rank every 50 ms until they exit; then deletes the folder. The coordinator sizes the data
ledger from the files (a stat and an 8 KiB sniff each); a rank reads only the windows of its
rounds and the evaluation windows, so neither should grow with the corpus. ``--smoke`` (1 and
40 MB, one round of 2 steps) checks that the benchmark still runs, and the growth at a glance.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from geodiloco.config import RunConfig
from geodiloco.testing.processes import descendants, kill_tree, spawn_geodiloco

WORKER_MODULE = "geodiloco.site.daemon.worker"
LETTERS = b"etaoin shrdlucmfwyp\n"
POLL_S = 0.05
TIMEOUT_S = 600.0


def write_corpus(path: Path, size: int, seed: int = 0) -> None:
    """``size`` bytes of word-like text, written in 8 MB pieces (never all of it in memory)."""
    letters = torch.tensor(list(LETTERS), dtype=torch.uint8)
    generator = torch.Generator().manual_seed(seed)
    with open(path, "wb") as out:
        for start in range(0, size, 8 << 20):
            n = min(8 << 20, size - start)
            out.write(letters[torch.randint(len(LETTERS), (n,), generator=generator)].numpy().tobytes())


def peak_rss_mb(pid: int) -> float | None:
    """The process's peak resident set size so far (VmHWM), MB; None once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def is_rank(pid: int) -> bool:
    """A rank runs ``python -u -m geodiloco.site.daemon.worker`` (torchrun names that module too,
    later on)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"torch.distributed.run" not in argv and WORKER_MODULE.encode() in argv


def run_config(corpus: Path, rounds: int, steps: int) -> RunConfig:
    return RunConfig.from_dict(
        {
            "run_id": "corpus-memory",
            "sites": ["site-1"],
            "rounds": rounds,
            "data": {"paths": [str(corpus)], "max_bytes": 0},
            "inner": {"steps_per_round": steps},
        }
    )


def measure(size_mb: float, rounds: int, steps: int, workdir: Path) -> dict[str, Any]:
    """One run on a fresh ``size_mb`` MB file; peak RSS of the coordinator and of the rank."""
    corpus = workdir / "corpus.txt"
    write_corpus(corpus, int(size_mb * 1e6))
    config = workdir / "run.json"
    config.write_text(run_config(corpus, rounds, steps).to_json())
    port_file = workdir / "port"
    started = time.monotonic()
    serve = ["coordinator", "serve", "--config", str(config), "--port", "0", "--port-file", str(port_file)]
    serve += ["--run-dir", str(workdir / "coord"), "--insecure", "--exit-when-finished"]
    coordinator = spawn_geodiloco(serve, workdir / "coordinator.log")
    site = None
    peaks = {"coordinator": 0.0, "rank": 0.0}
    try:
        while not port_file.exists():
            if coordinator.poll() is not None or time.monotonic() - started > TIMEOUT_S:
                raise RuntimeError((workdir / "coordinator.log").read_text()[-3000:])
            time.sleep(POLL_S)
        target = f"127.0.0.1:{port_file.read_text()}"
        site_args = ["site", "run", "--name", "site-1", "--coordinator", target, "--nproc", "1", "--insecure"]
        site = spawn_geodiloco(site_args, workdir / "site-1.log")
        while coordinator.poll() is None or site.poll() is None:
            if time.monotonic() - started > TIMEOUT_S:
                raise RuntimeError(f"the run did not finish in {TIMEOUT_S:.0f}s (logs in {workdir})")
            if site.poll() not in (None, 0):
                raise RuntimeError((workdir / "site-1.log").read_text()[-3000:])
            peaks["coordinator"] = max(peaks["coordinator"], peak_rss_mb(coordinator.pid) or 0.0)
            for pid in (p for p in descendants(site.pid) if is_rank(p)):
                peaks["rank"] = max(peaks["rank"], peak_rss_mb(pid) or 0.0)
            time.sleep(POLL_S)
    finally:
        for proc in (site, coordinator):
            if proc is not None and proc.poll() is None:
                kill_tree(proc)
    if coordinator.returncode != 0 or not peaks["rank"]:
        raise RuntimeError(f"coordinator exited {coordinator.returncode}, rank seen: {bool(peaks['rank'])}")
    return {
        "corpus_mb": size_mb,
        "corpus_bytes": corpus.stat().st_size,
        "files": 1,
        "coordinator_peak_rss_mb": round(peaks["coordinator"], 1),
        "rank_peak_rss_mb": round(peaks["rank"], 1),
        "wall_s": round(time.monotonic() - started, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[4.0, 200.0], help="corpus sizes, MB")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="inner steps per round")
    parser.add_argument("--json", type=Path, help="write the figures here")
    parser.add_argument("--smoke", action="store_true", help="1 and 40 MB, one round of 2 steps")
    args = parser.parse_args()
    if args.smoke:
        args.sizes_mb, args.rounds, args.steps = [1.0, 40.0], 1, 2
    if len(args.sizes_mb) < 2 or min(args.sizes_mb) <= 0:
        parser.error("--sizes-mb: give at least two sizes > 0 (the smallest is the reference)")
    runs = []
    for size in args.sizes_mb:
        with tempfile.TemporaryDirectory(prefix="geodiloco-corpus-memory-") as tmp:
            runs.append(measure(size, args.rounds, args.steps, Path(tmp)))
        r = runs[-1]
        print(
            f"{r['corpus_mb']:8g} MB corpus, data.max_bytes=0: coordinator peak RSS "
            f"{r['coordinator_peak_rss_mb']:7.1f} MB, rank peak RSS {r['rank_peak_rss_mb']:7.1f} MB "
            f"({r['wall_s']:.1f} s)",
            flush=True,
        )
    small, large = runs[0], runs[-1]
    growth = {
        f"{role}_growth_mb": round(large[f"{role}_peak_rss_mb"] - small[f"{role}_peak_rss_mb"], 1)
        for role in ("coordinator", "rank")
    }
    result = {
        "settings": {"rounds": args.rounds, "steps_per_round": args.steps, "sites": 1, "ranks": 1},
        "runs": runs,
        **growth,
    }
    print(
        f"from {small['corpus_mb']:g} MB to {large['corpus_mb']:g} MB of text: coordinator "
        f"{result['coordinator_growth_mb']:+.1f} MB, rank {result['rank_growth_mb']:+.1f} MB"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
