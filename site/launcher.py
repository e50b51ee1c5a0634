"""`geodiloco site run`: start the site's ranks with torchrun and supervise them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from geodiloco.lifecycle import StopRequest
from geodiloco.security.tls import TlsFiles


def worker_command(module: str, nproc: int, args: list[str]) -> list[str]:
    """A torchrun command line for ``nproc`` local ranks running ``python -m module args``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
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


def run_torchrun(module: str, nproc: int, args: list[str]) -> int:
    """Run to completion; the first SIGTERM asks the ranks to leave (ops: geodiloco.lifecycle),
    SIGINT and a second SIGTERM go on to torchrun (which stops the ranks)."""
    stop = StopRequest()  # ops
    proc = subprocess.Popen(worker_command(module, nproc, args), env={**worker_env(), **stop.env()})

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
) -> int:
    """Start the site's ranks; file paths (never secrets) travel on their command line."""
    args = ["--coordinator", coordinator, "--site", site, *(extra or [])]
    if tls is not None:
        args += ["--tls", str(tls.cert), str(tls.key), str(tls.ca)]
    if secret is not None:
        args += ["--secret", str(secret)]
    return run_torchrun("geodiloco.site.worker", nproc, args)
