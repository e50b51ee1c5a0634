"""Graceful stop of a site: SIGTERM (or SIGINT) ends training at the next step boundary.

The signal only sets a flag. The training loop asks :meth:`GracefulStop.requested` once per
inner step; the ranks agree with an all-reduce, so they all leave the loop at the same step
and no collective is left half done. An outer sync that is already under way (push, wait for
the commit, pull) is finished first; an unfinished round is abandoned (nothing is pushed), and
the site then calls Leave, so the coordinator stops waiting for it at once instead of when
its lease runs out. torchrun gives ranks 30 s after its SIGTERM before it kills them.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import torch
import torch.distributed as dist

log = logging.getLogger("geodiloco.site")


class GracefulStop:
    def __init__(self) -> None:
        self.signal: int | None = None
        self.stopping = False

    @classmethod
    def install(cls, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> GracefulStop:
        stop = cls()
        for sig in signals:
            signal.signal(sig, stop._handle)
        return stop

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.signal is None:
            log.warning("%s received: leaving after the current step", signal.Signals(signum).name)
        self.signal = signum

    def requested(self) -> bool:
        """True on every rank once any rank was signalled (a collective: call it on all ranks)."""
        flag = torch.tensor([0 if self.signal is None else 1], dtype=torch.int32)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.stopping = bool(flag.item())
        return self.stopping

    @property
    def reason(self) -> str:
        """What the site tells the coordinator when it leaves."""
        if not self.stopping:
            return "finished"
        if self.signal is None:
            return "stopped by a signal to another rank"
        return f"stopped by {signal.Signals(self.signal).name}"
