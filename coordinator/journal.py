"""The run directory's append-only JSON-lines journals, and one policy for all of them.

``rounds.jsonl`` (committed rounds), ``reports.jsonl`` (the sites' hash reports) and
``events.jsonl`` (what each site did, for `geodiloco report`) are all one JSON object per line.
Their one policy:

- a line is whole only with its newline; the bytes after the last newline are a torn tail (a
  crash or a full disk while it was written). The writer, holding the run directory's lock,
  truncates it when it opens the journal, so the next append never glues a whole line onto a
  torn one; readers skip it;
- an append writes every byte of its lines (``os.write`` may write fewer) or, when it cannot
  (a full disk), cuts the file back to where it was and raises: no torn line is left behind;
- a journal that promises durability (reports) is fsynced before the append returns.

A complete line that is not a JSON object is damage, not a crash, and is refused with its line
number.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from geodiloco.coordinator.refusals import CorruptStateError
from geodiloco.coordinator.rundir import EVENTS_FILE as EVENTS_FILE

log = logging.getLogger("geodiloco.coordinator")

_TAIL_BLOCK = 1 << 16


class JsonLines:
    """One append-only journal: ``open`` (repair and read) once, then ``append``."""

    def __init__(self, path: Path, *, durable: bool) -> None:
        self.path = path
        self.durable = durable

    def repair(self) -> None:
        """Truncate a torn tail (the writer's side; call before the first append)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return
        complete = _complete_length(self.path, size)
        if complete < size:
            log.warning("%s: dropping a torn last line (%d bytes)", self.path, size - complete)
            os.truncate(self.path, complete)

    def open(self) -> list[dict[str, Any]]:
        """Repair, then every record in the journal."""
        self.repair()
        return read_lines(self.path)

    def append(self, *records: dict[str, Any]) -> None:
        """Write ``records`` whole (or nothing, and raise ``OSError``)."""
        data = b"".join((json.dumps(r) + "\n").encode() for r in records)
        if not data:
            return
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            start = os.fstat(fd).st_size
            try:
                _write_all(fd, data)
                if self.durable:
                    os.fsync(fd)
            except OSError:
                os.ftruncate(fd, start)  # leave no torn line for the next append to glue onto
                raise
        finally:
            os.close(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:  # never expected from a regular file, but never loop forever
            raise OSError(f"wrote nothing of the {len(view)} bytes left")
        view = view[written:]


def _complete_length(path: Path, size: int) -> int:
    """The length of ``path`` up to and including its last newline (0 when it has none)."""
    with open(path, "rb") as f:
        end = size
        while end > 0:
            start = max(0, end - _TAIL_BLOCK)
            f.seek(start)
            block = f.read(end - start)
            at = block.rfind(b"\n")
            if at >= 0:
                return start + at + 1
            end = start
    return 0


def read_lines(path: Path) -> list[dict[str, Any]]:
    """Every whole record of a journal (a torn tail is left out, not repaired: readers hold no
    lock). Empty when the file does not exist."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    lines = data[: data.rfind(b"\n") + 1].splitlines()
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if not isinstance(record, dict):
            raise CorruptStateError(f"{path}:{number}: not JSON (not a whole record): {line[:80]!r}")
        records.append(record)
    return records


class Journal:
    """The events journal, ``RUN_DIR/events.jsonl``: telemetry, so a failed append (a full
    disk) stops the journal but never the run (the next state write will, if the disk stays
    full). Without a run directory it records nothing.

    Events: ``push``, ``pull``, ``report`` or ``lease_expired``, with wall-clock times
    ``t0``/``t1`` in seconds since the epoch. The round log says what was committed; this
    journal says how each site got there.

    Appends are written by a thread of their own, in order: a file append can wait tens of
    milliseconds on a disk busy with a commit's fsync, which the event loop must not."""

    def __init__(self, run_dir: Path | None) -> None:
        self._lines = JsonLines(run_dir / EVENTS_FILE, durable=False) if run_dir is not None else None
        self._broken = False
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        if self._lines is not None:
            self._lines.repair()

    @property
    def path(self) -> Path | None:
        return self._lines.path if self._lines is not None else None

    def write(self, event: str, **fields: Any) -> None:
        if self._lines is None or self._broken:
            return
        if self._writer is None:
            self._writer = threading.Thread(target=self._write_queued, name="journal", daemon=True)
            self._writer.start()
        self._queue.put({"event": event, "t": round(time.time(), 6), **fields})

    def close(self) -> None:
        """Write every event queued so far, then stop the writer (a graceful stop)."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()
            self._writer = None

    def _write_queued(self) -> None:
        assert self._lines is not None
        while True:
            records = [self._queue.get()]
            while not self._queue.empty():  # what queued meanwhile goes in the same append
                records.append(self._queue.get())
            stop = None in records
            if not self._broken:
                try:
                    self._lines.append(*(r for r in records if r is not None))
                except OSError:
                    log.warning(
                        "cannot append to %s; the journal stops here", self._lines.path, exc_info=True
                    )
                    self._broken = True
            if stop:
                return
