"""The sites' hash reports and eval losses, appended durably as they arrive.

A report comes after the round it describes has committed, so the round's snapshot does not
hold it; without this log a coordinator restarted before the next commit would forget which
sites proved their hash (and the run's last round would never show its loss). One JSON line
per report, fsynced before the site is answered; on restart the lines are applied again
(applying a report twice changes nothing).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from geodiloco.coordinator.durable import CorruptStateError

log = logging.getLogger("geodiloco.coordinator")

REPORT_LOG = "reports.jsonl"


@dataclass(frozen=True, slots=True)
class HashReport:
    round: int
    site: str
    hash_ok: bool
    eval_loss_sum: float
    eval_count: int
    train_loss: float


def append_report(path: Path, report: HashReport) -> None:
    """One line, written and fsynced in a single append (a crash leaves at most a torn last line)."""
    line = (json.dumps(asdict(report)) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)


def read_reports(path: Path) -> list[HashReport]:
    """Every complete report in the log; a torn last line (a crash mid-append) is skipped."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    reports = []
    for i, line in enumerate(lines):
        try:
            reports.append(HashReport(**json.loads(line)))
        except (ValueError, TypeError):
            if i == len(lines) - 1:
                log.warning("%s: skipping a torn last line (a crash while it was written)", path)
                continue
            raise CorruptStateError(f"{path}: line {i + 1} is not a report: {line[:80]!r}") from None
    return reports
