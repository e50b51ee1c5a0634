"""The sites' hash reports and eval losses, appended durably as they arrive.

A report comes after the round it describes has committed, so the round's snapshot does not
hold it; without this log a coordinator restarted before the next commit would forget which
sites proved their hash (and the run's last round would never show its loss). One JSON line
per report, fsynced before the site is answered; on restart the lines are applied again
(applying a report twice changes nothing).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from geodiloco.coordinator.journal import JsonLines
from geodiloco.coordinator.refusals import CorruptStateError
from geodiloco.coordinator.rundir import REPORT_LOG as REPORT_LOG


@dataclass(frozen=True, slots=True)
class HashReport:
    round: int
    site: str
    hash_ok: bool
    eval_loss_sum: float
    eval_count: int
    train_loss: float


def report_log(path: Path) -> JsonLines:
    """The reports journal: durable (fsynced before the site is answered)."""
    return JsonLines(path, durable=True)


def append_report(path: Path, report: HashReport) -> None:
    """One line, whole and fsynced, or an ``OSError`` and nothing written."""
    report_log(path).append(asdict(report))


def read_reports(path: Path) -> list[HashReport]:
    """Every report in the log, a torn last line (a crash mid-append) truncated away first."""
    reports = []
    for i, line in enumerate(report_log(path).open()):
        try:
            reports.append(HashReport(**line))
        except TypeError:
            raise CorruptStateError(f"{path}: line {i + 1} is not a report: {str(line)[:80]!r}") from None
    return reports
