"""Graceful stop of a site: SIGTERM ends training at the next step boundary, then Leave.

`geodiloco site run` is what systemd, Docker and Kubernetes signal. On the first SIGTERM it
does not pass the signal on to torchrun (whose agent would tear the ranks down); it creates a
stop file the ranks look for once per inner step (:class:`StopRequest`). A second SIGTERM, or
SIGINT, is passed on to torchrun as before. A rank that is signalled itself stops the same way.

The ranks agree with an all-reduce in :meth:`GracefulStop.requested`, so they all leave the
loop at the same step and no collective is left half done. An outer sync already under way
(push, wait for the commit, pull) is finished first; an unfinished round is abandoned (nothing
is pushed); then the site calls Leave, so the coordinator stops waiting for it at once instead
of when its lease runs out, and the ranks, torchrun and the launcher all exit 0.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from types import FrameType

log = logging.getLogger("geodiloco.site")

STOP_FILE_ENV = "GEODILOCO_STOP_FILE"


class StopRequest:
    """The launcher's half: a stop file in a private temporary folder, named to the ranks."""

    def __init__(self) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="geodiloco-stop-"))
        self.path = self._dir / "stop"

    def env(self) -> dict[str, str]:
        return {STOP_FILE_ENV: str(self.path)}

    def forward(self, signum: int, proc: subprocess.Popen[bytes]) -> None:
        """First SIGTERM: ask the ranks to leave; anything after it goes to torchrun."""
        if signum == signal.SIGTERM and not self.path.exists():
            log.warning("SIGTERM: the ranks leave after the current step (SIGTERM again to stop at once)")
            self.path.touch()
            return
        proc.send_signal(signum)

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


class GracefulStop:
    """The ranks' half: a signal to this rank, or the launcher's stop file."""

    def __init__(self, stop_file: Path | None = None) -> None:
        self.stop_file = stop_file
        self.signal: int | None = None
        self.stopping = False

    @classmethod
    def install(cls, signals: tuple[int, ...] = (signal.SIGTERM,)) -> GracefulStop:
        path = os.environ.get(STOP_FILE_ENV)
        stop = cls(Path(path) if path else None)
        for sig in signals:
            signal.signal(sig, stop._handle)
        return stop

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal is None:
            log.warning("%s received: leaving after the current step", signal.Signals(signum).name)
        self.signal = signum

    def _asked(self) -> bool:
        return self.signal is not None or (self.stop_file is not None and self.stop_file.exists())

    def requested(self) -> bool:
        """True on every rank once any rank was asked (a collective: call it on all ranks)."""
        # torch is imported here, not above: the launcher (StopRequest) never needs it
        import torch
        import torch.distributed as dist

        from geodiloco.distributed import control_group

        flag = torch.tensor([1 if self._asked() else 0], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:  # a CPU flag: the gloo control group
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control_group())
        if flag.item() and not self.stopping:
            log.info("stop requested: leaving the run")
        self.stopping = bool(flag.item())
        return self.stopping

    @property
    def reason(self) -> str:
        """What the site tells the coordinator when it leaves."""
        if not self.stopping:
            return "finished"
        if self.signal is not None:
            return f"stopped by {signal.Signals(self.signal).name}"
        return "stopped by SIGTERM to the site daemon"
