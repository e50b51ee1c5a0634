"""Audits of a run's records: what every test of a whole run checks at its end."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from geodiloco.config import RunConfig
from geodiloco.coordinator.edge.server import data_shard_sizes
from geodiloco.coordinator.ledger import ConsumedRecord, check_exactly_once
from geodiloco.workload.data import DataRange


def eval_losses(log: str) -> list[float]:
    """The eval slice losses a site's log reports, one per round; each must be finite."""
    losses = [
        float(line.rsplit("eval slice loss ", 1)[1]) for line in log.splitlines() if "eval slice loss" in line
    ]
    assert all(math.isfinite(v) for v in losses), losses
    return losses


def ledger_problems(round_log: list[dict[str, Any]], cfg: RunConfig) -> list[str]:
    """Audit a coordinator's round log: every data window consumed exactly once, no gaps."""
    records = [
        ConsumedRecord(entry["round"], site, DataRange(shard, start, end, epoch))
        for entry in round_log
        for site, shard, start, end, epoch in entry["data"]
    ]
    assert records, "the round log records no data"
    # windows held for a late push or returned (a round by time trained less) at the last commit
    pending = (round_log[-1].get("pending") or {}) if round_log else {}
    behind = [DataRange(*d) for _, _, ranges in pending.get("held", []) for d in ranges]
    behind += [DataRange(*d) for d in pending.get("returned", [])]
    return check_exactly_once(records, data_shard_sizes(cfg), behind)


def round_log(run_dir: Path) -> list[dict[str, Any]]:
    """The coordinator's committed rounds, as written to its run directory so far (a line still
    being written, without its newline, is left out)."""
    path = run_dir / "rounds.jsonl"
    complete = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(line) for line in complete]
