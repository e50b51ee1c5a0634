"""`geodiloco demo`: a coordinator and several sites as real processes on loopback, then the
synchronous baseline on the same token budget, and a side-by-side summary."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from geodiloco.app.status import fetch_status, human_bytes, request_shutdown
from geodiloco.config import REFERENCE_BUILDERS, ConfigError, RunConfig, apply_overrides
from geodiloco.security.pki import PkiDir
from geodiloco.security.tls import TlsFiles
from geodiloco.site.daemon.launcher import worker_command, worker_env

# Chosen from measurement on this workload (docs/measurements.md, "Choosing the demo's settings"): from
# scratch over 900 steps, outer momentum only hurt here, so the demo averages (lr 1, no momentum).
# The codec: the fewest bytes whose run stayed within the demo's loss bound (1.07x the baseline):
# q4 both ways, 154x fewer WAN bytes than the baseline at 1.05x; q2 (316x) ended at 1.08x, and
# every sparse pipeline costs percents more from scratch (docs/measurements.md, "The demo's codec").
DEMO_DEFAULTS: dict[str, Any] = {
    "run_id": "demo",
    "rounds": 36,
    "inner": {"steps_per_round": 25, "lr": 6e-3},
    "outer": {"optimizer": "fedavg", "lr": 1.0, "momentum": 0.0},
    "data": {"batch_size": 8},
    "compression": {"uplink": "q4|zstd:1", "downlink": "q4|zstd:1"},
}


@dataclass(kw_only=True, slots=True)
class DemoOptions:
    sites: int = 3
    ranks_per_site: int = 2
    run_dir: Path | None = None
    json_path: Path | None = None
    overrides: list[str] = field(default_factory=list)
    baseline: bool = True
    timeout_s: float = 1800.0


def demo_config(opts: DemoOptions) -> RunConfig:
    """The demo's defaults under the user's overrides. With one's own optimizer the demo's inner
    lr is not applied (the builder sets its own); the baseline runs the reference workload only."""
    data = apply_overrides(json.loads(json.dumps(DEMO_DEFAULTS)), opts.overrides)
    data["sites"] = [f"site-{i + 1}" for i in range(opts.sites)]
    if not any(o.startswith("min_sites=") for o in opts.overrides):
        data["min_sites"] = opts.sites  # same token budget as the baseline: every round waits for every site
    workload = data.get("workload", {})
    own_optimizer = (
        workload.get("optimizer", REFERENCE_BUILDERS["optimizer"]) != REFERENCE_BUILDERS["optimizer"]
    )
    if own_optimizer and not any(o.startswith("inner.lr=") for o in opts.overrides):
        data["inner"].pop("lr", None)
    cfg = RunConfig.from_dict(data)
    own = [key for key, ref in REFERENCE_BUILDERS.items() if getattr(cfg.workload, key) != ref]
    if opts.baseline and own:
        raise ConfigError(
            f"workload.{own[0]}: the demo's synchronous baseline trains the reference workload only; "
            "run the demo with --no-baseline when workload.* names your own builders"
        )
    return cfg


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    log = open(log_path, "wb")  # noqa: SIM115 - handed to the child, closed with it
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=worker_env())


def _wait_for_port(path: Path, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 180.0) -> int:
    # its start-up (imports, the workload's dry step) took over a minute on a loaded 2-core machine
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return int(path.read_text())
        if proc.poll() is not None:
            raise RuntimeError(f"the coordinator exited during start-up: {_reason(log)} (log: {log})")
        time.sleep(0.1)
    raise RuntimeError("the coordinator did not start in time")


def _reason(log: Path) -> str:
    """A process's one-line reason for exiting: the last line it wrote (the CLI's message, or the
    exception's line of a traceback)."""
    lines = _tail(log).splitlines()
    return lines[-1].strip() if lines else "no output"


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class DemoPki:
    """A fresh development CA with certificates for everyone in the demo, in ``run_dir/pki``."""

    dir: PkiDir
    coordinator: TlsFiles
    admin: TlsFiles
    sites: dict[str, tuple[TlsFiles, Path]]

    @classmethod
    def create(cls, run_dir: Path, sites: list[str]) -> DemoPki:
        # A new CA and run secret every demo, so a new run: the coordinator state a previous demo
        # left in the same folder is sealed under the old secret and would refuse to open.
        for previous in ("pki", "coordinator"):
            shutil.rmtree(run_dir / previous, ignore_errors=True)
        pki = PkiDir(run_dir / "pki")
        pki.init()
        return cls(
            pki,
            pki.issue_coordinator(["127.0.0.1", "localhost"]),
            pki.issue_admin("demo"),
            {name: pki.issue_site(name) for name in sites},
        )


def _tls_flags(files: TlsFiles) -> list[str]:
    return ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca)]


def run_diloco(cfg: RunConfig, opts: DemoOptions, run_dir: Path) -> dict[str, Any]:
    """Coordinator + sites as processes over mTLS; returns the DiLoCo half of the summary."""
    pki = DemoPki.create(run_dir, cfg.sites)
    config_path = run_dir / "config.json"
    config_path.write_text(cfg.to_json())
    port_file = run_dir / "coordinator.port"
    port_file.unlink(missing_ok=True)
    started = time.monotonic()
    coordinator = _spawn(
        [
            sys.executable,
            "-m",
            "geodiloco",
            "coordinator",
            "serve",
            "--config",
            str(config_path),
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--run-dir",
            str(run_dir / "coordinator"),
            *_tls_flags(pki.coordinator),
            "--run-secret",
            str(pki.dir.run_secret),
        ],
        run_dir / "coordinator.log",
    )
    sites: dict[str, subprocess.Popen[bytes]] = {}
    try:
        target = f"127.0.0.1:{_wait_for_port(port_file, coordinator, run_dir / 'coordinator.log')}"
        print(
            f"coordinator on {target}; starting {len(cfg.sites)} sites x {opts.ranks_per_site} ranks "
            f"(logs in {run_dir})",
            flush=True,
        )
        for name in cfg.sites:
            sites[name] = _spawn(
                [
                    sys.executable,
                    "-m",
                    "geodiloco",
                    "site",
                    "run",
                    "--name",
                    name,
                    "--coordinator",
                    target,
                    "--nproc",
                    str(opts.ranks_per_site),
                    *_tls_flags(pki.sites[name][0]),
                    "--secret",
                    str(pki.sites[name][1]),
                ],
                run_dir / f"{name}.log",
            )
        return _watch(cfg, target, pki.admin, coordinator, sites, run_dir, started, opts.timeout_s)
    finally:
        for proc in (*sites.values(), coordinator):
            if proc.poll() is None:
                proc.terminate()
        for proc in (*sites.values(), coordinator):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def _watch(
    cfg: RunConfig,
    target: str,
    admin: TlsFiles,
    coordinator: subprocess.Popen[bytes],
    sites: dict[str, subprocess.Popen[bytes]],
    run_dir: Path,
    started: float,
    timeout_s: float,
) -> dict[str, Any]:
    curve: list[dict[str, Any]] = []
    status = None
    tokens = 0  # committed rounds' tokens, as the sites' data builder counts them
    while True:
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"the DiLoCo run did not finish within {timeout_s:.0f}s")
        for name, proc in sites.items():
            if proc.poll() not in (None, 0):
                raise RuntimeError(f"site {name} failed:\n{_tail(run_dir / f'{name}.log')}")
        try:
            status = fetch_status(target, admin)
        except grpc.RpcError:
            if coordinator.poll() is not None:
                raise RuntimeError(f"the coordinator exited:\n{_tail(run_dir / 'coordinator.log')}") from None
            time.sleep(0.5)
            continue
        for record in status.history[len(curve) :]:
            if record.hash_reports < len(record.contributors):
                break  # wait until every contributor has reported its hash and eval loss
            tokens += record.tokens
            point = {
                "round": record.round,
                "tokens": tokens,
                "eval_loss": record.eval_loss,
                "wan_bytes": status.wan_bytes_in + status.wan_bytes_out,
                "hashes_agree": record.hashes_agree,
                "elapsed_s": time.monotonic() - started,
            }
            curve.append(point)
            print(
                f"diloco round {record.round + 1}/{cfg.rounds}  eval {record.eval_loss:.4f}  "
                f"wan {human_bytes(point['wan_bytes'])}  elapsed {point['elapsed_s']:.0f}s  "
                f"hashes {'agree' if record.hashes_agree else 'DISAGREE'}",
                flush=True,
            )
        if status.finished and len(curve) == cfg.rounds and all(s.state != "joined" for s in status.sites):
            break
        time.sleep(1.0)
    wall = time.monotonic() - started
    request_shutdown(target, admin)
    assert status is not None
    return {
        "final_eval_loss": curve[-1]["eval_loss"],
        "wan_bytes": status.wan_bytes_in + status.wan_bytes_out,
        "wan_bytes_up": status.wan_bytes_in,
        "wan_bytes_down": status.wan_bytes_out,
        "tokens": tokens,
        "hashes_agree": all(p["hashes_agree"] for p in curve),
        "wall_seconds": wall,
        "outer": {"optimizer": cfg.outer.optimizer, "lr": cfg.outer.lr, "momentum": cfg.outer.momentum},
        "codec": {"uplink": cfg.compression.uplink, "downlink": cfg.compression.downlink},
        "curve": curve,
    }


def run_baseline(cfg: RunConfig, ranks_per_site: int, run_dir: Path) -> dict[str, Any]:
    """The synchronous baseline over all ranks, relaying its progress lines."""
    config_path = run_dir / "config.json"
    config_path.write_text(cfg.to_json())
    out = run_dir / "baseline.json"
    args = ["--config", str(config_path), "--ranks-per-site", str(ranks_per_site), "--out", str(out)]
    cmd = worker_command("geodiloco.app.baseline", len(cfg.sites) * ranks_per_site, args)
    with open(run_dir / "baseline.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, env=worker_env())
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line.decode(errors="replace"))
            sys.stdout.flush()
        if proc.wait() != 0:
            raise RuntimeError(f"the baseline failed:\n{_tail(run_dir / 'baseline.log')}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def summary_table(summary: dict[str, Any]) -> str:
    d, b = summary["diloco"], summary.get("baseline")
    rows = [("", "DiLoCo", "sync DP (baseline)")]
    rows.append(
        ("final eval loss", f"{d['final_eval_loss']:.4f}", f"{b['final_eval_loss']:.4f}" if b else "-")
    )
    rows.append(("WAN bytes", human_bytes(d["wan_bytes"]), human_bytes(b["wan_bytes"]) if b else "-"))
    rows.append(("tokens", f"{d['tokens']:,}", f"{b['tokens']:,}" if b else "-"))
    rows.append(("wall time", f"{d['wall_seconds']:.0f}s", f"{b['wall_seconds']:.0f}s" if b else "-"))
    width = [max(len(r[i]) for r in rows) + 2 for i in range(3)]
    lines = ["".join(cell.ljust(width[i]) for i, cell in enumerate(row)).rstrip() for row in rows]
    if b:
        lines.append(
            f"\nloss ratio DiLoCo/baseline: {d['final_eval_loss'] / b['final_eval_loss']:.3f}   "
            f"WAN bytes baseline/DiLoCo: {b['wan_bytes'] / d['wan_bytes']:.0f}x   "
            f"replica hashes agree every round: {'yes' if d['hashes_agree'] else 'NO'}"
        )
    return "\n".join(lines)


def run_demo(opts: DemoOptions) -> dict[str, Any]:
    cfg = demo_config(opts)
    started = time.monotonic()
    run_dir = opts.run_dir or Path(tempfile.mkdtemp(prefix="geodiloco-demo-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"geodiloco demo: {len(cfg.sites)} sites x {opts.ranks_per_site} ranks, "
        f"H={cfg.inner.steps_per_round}, {cfg.rounds} rounds, "
        f"outer {cfg.outer.optimizer} lr {cfg.outer.lr} momentum {cfg.outer.momentum}, "
        f"codec {cfg.compression.uplink}",
        flush=True,
    )
    summary: dict[str, Any] = {
        "sites": len(cfg.sites),
        "ranks_per_site": opts.ranks_per_site,
        "inner_steps": cfg.inner.steps_per_round,
        "rounds": cfg.rounds,
        "run_dir": str(run_dir),
    }
    summary["diloco"] = run_diloco(cfg, opts, run_dir)
    summary["tokens"] = summary["diloco"]["tokens"]  # as the data builder counts them (tokens())
    if opts.baseline:
        summary["baseline"] = run_baseline(cfg, opts.ranks_per_site, run_dir)
    summary["wall_seconds"] = time.monotonic() - started
    print("\n" + summary_table(summary), flush=True)
    text = json.dumps(summary, indent=2)
    (run_dir / "summary.json").write_text(text)
    if opts.json_path is not None:
        opts.json_path.parent.mkdir(parents=True, exist_ok=True)
        opts.json_path.write_text(text)
        print(f"summary written to {opts.json_path}")
    return summary
