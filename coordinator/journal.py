"""`RUN_DIR/events.jsonl`: what each site did in each round, as the coordinator saw it.

One JSON object per line (``event`` is ``push``, ``pull``, ``report`` or ``lease_expired``,
with wall-clock times ``t0``/``t1`` in seconds since the epoch). The round log
(``rounds.jsonl``) says what was committed; this journal says how each site got there, and is
what `geodiloco report` draws its loss curves, byte counts and round timeline from.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("geodiloco.coordinator")

EVENTS_FILE = "events.jsonl"


class Journal:
    """Appends events to ``run_dir/events.jsonl``; without a run directory it records nothing."""

    def __init__(self, run_dir: Path | None) -> None:
        self.path = run_dir / EVENTS_FILE if run_dir is not None else None
        self._broken = False

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None or self._broken:
            return
        line = json.dumps({"event": event, "t": round(time.time(), 6), **fields})
        try:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        except OSError:  # telemetry only: a full disk must not stop the run (the state write will)
            log.warning("cannot append to %s; the journal stops here", self.path, exc_info=True)
            self._broken = True
