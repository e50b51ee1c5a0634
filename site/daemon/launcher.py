"""`geodiloco site run`: start this node's ranks of a site with torchrun and supervise them.

A site on one machine uses torchrun's ``--standalone`` rendezvous. A site that spans N machines
runs ``geodiloco site run --nnodes N --node-rank I --rdzv-endpoint HOST:PORT`` on each; torchrun's
c10d rendezvous (a TCP store on node 0, at HOST:PORT) forms one process group of every node's
ranks, and global rank 0, wherever it lands, owns the site's calls to the coordinator. There is
no elastic restart inside a site (``--max-restarts=0``): a lost node fails the whole site, which
comes back as a whole (rejoins the run and catches up) when its nodes are started again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from geodiloco.lifecycle import StopRequest
from geodiloco.security.tls import TlsFiles

REFUSAL_FILE_ENV = "GEODILOCO_REFUSAL_FILE"  # where a node's ranks write a Join refusal (site.worker)
EXIT_REFUSED = 78  # EX_CONFIG: restarting the site unchanged cannot help


class NodesError(ValueError):
    """A multi-node setting that cannot form a site (names the flag)."""


@dataclass(frozen=True, slots=True)
class Nodes:
    """The machines one site spans and where they meet."""

    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None  # HOST:PORT of node 0's rendezvous store
    rdzv_id: str = "geodiloco"  # names the site's rendezvous (the site's name)

    def __post_init__(self) -> None:
        if self.nnodes < 1:
            raise NodesError(f"nnodes: {self.nnodes} must be at least 1")
        if not 0 <= self.node_rank < self.nnodes:
            raise NodesError(f"node-rank: {self.node_rank} must be in [0, {self.nnodes})")
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise NodesError("rdzv-endpoint: a site on several nodes needs HOST:PORT of node 0")
        if self.rdzv_endpoint is not None:
            host, colon, port = self.rdzv_endpoint.rpartition(":")
            if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise NodesError(f"rdzv-endpoint: {self.rdzv_endpoint!r} is not HOST:PORT")

    def torchrun_args(self) -> list[str]:
        if self.rdzv_endpoint is None:
            return ["--standalone"]
        # node 0 hosts the store; the others dial it (the default guesses by hostname, which
        # cannot tell two nodes apart on one machine, or behind a Service name)
        is_host = "true" if self.node_rank == 0 else "false"
        return [
            f"--nnodes={self.nnodes}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={self.rdzv_endpoint}",
            f"--rdzv-id={self.rdzv_id}",
            f"--rdzv-conf=is_host={is_host}",
        ]


def worker_command(module: str, nproc: int, args: list[str], nodes: Nodes | None = None) -> list[str]:
    """A torchrun command line for ``nproc`` local ranks running ``python -m module args``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *(nodes or Nodes()).torchrun_args(),
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "-m",
        module,
        *args,
    ]


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too, said explicitly
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run_torchrun(
    module: str, nproc: int, args: list[str], nodes: Nodes | None = None, env: dict[str, str] | None = None
) -> int:
    """Run to completion; the first SIGTERM asks the ranks to leave (ops: geodiloco.lifecycle),
    SIGINT and a second SIGTERM go on to torchrun (which stops the ranks)."""
    stop = StopRequest()  # ops
    proc = subprocess.Popen(
        worker_command(module, nproc, args, nodes), env={**worker_env(), **stop.env(), **(env or {})}
    )

    def forward(signum: int, _frame: object) -> None:
        stop.forward(signum, proc)  # ops

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait()
    finally:
        stop.close()  # ops
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_site(
    coordinator: str,
    site: str,
    nproc: int,
    tls: TlsFiles | None,
    secret: Path | None,
    extra: list[str] | None = None,
    nodes: Nodes | None = None,
) -> int:
    """Start this node's ranks; file paths (never secrets) travel on their command line."""
    args = ["--coordinator", coordinator, "--site", site, *(extra or [])]
    if tls is not None:
        args += ["--tls", str(tls.cert), str(tls.key), str(tls.ca)]
    if secret is not None:
        args += ["--secret", str(secret)]
    # a Join refusal: rank 0 passes it to every node's ranks (the rendezvous store), each node's
    # local rank 0 prints it once and its ranks write it here, every rank leaves quietly (no
    # tracebacks, no torchrun failure box) and every node's launcher exits EXIT_REFUSED
    with tempfile.TemporaryDirectory(prefix="geodiloco-site-") as scratch:
        refusal = Path(scratch) / "refused"
        code = run_torchrun(
            "geodiloco.site.daemon.worker", nproc, args, nodes, {REFUSAL_FILE_ENV: str(refusal)}
        )
        return EXIT_REFUSED if refusal.exists() else code
