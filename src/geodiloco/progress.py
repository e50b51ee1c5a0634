"""Progress of long work: a redrawn bar on a terminal, a plain line now and then otherwise.

Log files and `kubectl logs` get one readable line every ``every_s`` seconds (and at the end)
instead of thousands of carriage returns; a person at a terminal gets a bar.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

BAR_WIDTH = 30
REDRAW_S = 0.1


class Progress:
    """``update(done)`` as work advances, ``close()`` at the end (also as a context manager)."""

    def __init__(
        self,
        label: str,
        total: int,
        *,
        stream: TextIO | None = None,
        every_s: float = 10.0,
        tty: bool | None = None,
    ) -> None:
        if total <= 0:
            raise ValueError(f"total must be positive, got {total}")
        self.label = label
        self.total = total
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = every_s
        self.done = 0
        self.note = ""
        self.started = time.monotonic()
        self._last_shown = float("-inf")
        self._shown: tuple[int, str] | None = None
        self._closed = False

    def update(self, done: int, note: str = "") -> None:
        self.done, self.note = min(done, self.total), note
        now = time.monotonic()
        if self.done >= self.total or now - self._last_shown >= (REDRAW_S if self.tty else self.every_s):
            self._show(now)

    def advance(self, steps: int = 1, note: str = "") -> None:
        self.update(self.done + steps, note)

    def line(self) -> str:
        """The text shown now: label, bar (terminal only), count, percentage, elapsed, note."""
        frac = self.done / self.total
        elapsed = time.monotonic() - self.started
        bar = ""
        if self.tty:
            filled = int(frac * BAR_WIDTH)
            bar = " [" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"
        text = f"{self.label}{bar} {self.done}/{self.total} ({frac:.0%}) {elapsed:.0f}s"
        return text + (f"  {self.note}" if self.note else "")

    def _show(self, now: float) -> None:
        self._last_shown, self._shown = now, (self.done, self.note)
        if self.tty:
            self.stream.write("\r\x1b[2K" + self.line())
        else:
            self.stream.write(self.line() + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._shown != (self.done, self.note):
            self._show(time.monotonic())
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
