"""Copies of codec bytes between the host and one device, each on a stream this module names.

The outer sync moves compressed bytes only: codes and scales go up after quantising on the
device, and come down to be decoded there. On CUDA a :class:`Staging` owns a side stream and
pinned host buffers: a copy runs on the side stream (never on the training stream, which goes
on with its steps), from or into a pinned buffer (so it is a DMA, asynchronous to the host), and
the work that reads a copied tensor is queued on the side stream after it (:meth:`side`); the
training stream waits for that work only where it reads the result (:meth:`fence`). Where CUDA
is not (the CPU; pinning memory needs CUDA), the same calls are plain copies on the calling
thread, so the code that uses them is the same and runs in CPU tests. Each buffer is reused
only once the copy from it has finished (an event per buffer).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_RING = 4  # pinned buffers for host-to-device copies in flight at once (a pulled stream's chunks)
_thread = threading.local()


class Staging:
    """Host↔``device`` copies of bytes on an explicit stream (see the module). ``resident``:
    decode and apply on ``device`` (True on CUDA); a CPU test sets it to run the same path
    with plain copies."""

    def __init__(self, device: torch.device, resident: bool | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.resident = self.cuda if resident is None else resident
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self._up: torch.Tensor | None = None  # pinned: the last device-to-host copy
        self._down: list[tuple[torch.Tensor, torch.cuda.Event]] = []  # pinned, with their copies' events
        self._next = 0

    @contextlib.contextmanager
    def side(self) -> Iterator[None]:
        """Queue the work inside on the side stream (on the CPU: run it here, as it comes)."""
        if self.stream is None:
            yield
            return
        with torch.cuda.stream(self.stream):
            yield

    def after_current(self) -> None:
        """Make the side stream wait for what the calling thread's stream has queued so far
        (e.g. the Δ that the work on the side stream reads)."""
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def fence(self) -> None:
        """Make the calling thread's stream wait for the side stream's work queued so far
        (before it reads what that work wrote); the host does not wait."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def synchronize(self) -> None:
        """Wait on the host for the side stream's work (before reading its results as numbers)."""
        if self.stream is not None:
            self.stream.synchronize()

    def to_host(self, raw: torch.Tensor) -> torch.Tensor:
        """``raw`` (bytes on the device) on the host: copied on the side stream, after the work
        that made it, into a pinned buffer, waiting for that copy only. The result is valid until
        the next :meth:`to_host` (the caller frames it first). A host tensor comes back as it is."""
        if raw.device.type == "cpu":
            return raw
        if self.stream is None:
            return raw.cpu()
        self.after_current()
        if self._up is None or self._up.numel() < raw.numel():
            self._up = torch.empty(raw.numel(), dtype=torch.uint8, pin_memory=True)
        host = self._up[: raw.numel()]
        with torch.cuda.stream(self.stream):
            host.copy_(raw.view(-1).view(torch.uint8), non_blocking=True)
            raw.record_stream(self.stream)  # its memory is not reused before the copy has read it
        self.stream.synchronize()
        return host

    def to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (a CPU tensor) on the device: staged in a pinned buffer and copied on the side
        stream without the host waiting; read it under :meth:`side` (queued after the copy), or
        after :meth:`fence`. On the CPU, ``host`` itself."""
        if host.device == self.device:
            return host
        if self.stream is None:
            return host.to(self.device)
        data = host.contiguous().view(-1).view(torch.uint8)
        pinned, done = self._buffer(data.numel())
        staged = pinned[: data.numel()]
        staged.copy_(data)  # host to pinned host: what a DMA needs
        with torch.cuda.stream(self.stream):
            out = torch.empty(data.numel(), dtype=torch.uint8, device=self.device)
            out.copy_(staged, non_blocking=True)
            done.record(self.stream)
        return out.view(host.dtype).view(host.shape)

    def _buffer(self, nbytes: int) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The next pinned buffer of the ring, once the copy that last read it has finished."""
        if len(self._down) < _RING:
            self._down.append((torch.empty(0, dtype=torch.uint8), torch.cuda.Event()))
        i, self._next = self._next, (self._next + 1) % _RING
        buf, done = self._down[i]
        done.synchronize()  # a copy still reading it (a fresh event counts as done)
        if buf.numel() < nbytes:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            self._down[i] = (buf, done)
        return buf, done


def thread_staging(device: torch.device) -> Staging:
    """This thread's staging for ``device`` (its pinned buffers are the thread's own, as the
    encoder that fills them is)."""
    cache: dict[torch.device, Staging] | None = getattr(_thread, "by_device", None)
    if cache is None:
        cache = _thread.by_device = {}
    staging = cache.get(device)
    if staging is None:
        staging = cache[device] = Staging(device)
    return staging
