"""A coordinator's run directory read back: committed rounds and what each site did in them.

``rounds.jsonl`` (written at each commit) and ``events.jsonl`` (the coordinator's journal of
pushes, pulls, reports and lease expiries) are joined here into per-round and per-site series,
which `geodiloco report` plots and summarises.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from geodiloco.coordinator.journal import read_lines
from geodiloco.coordinator.refusals import CorruptStateError
from geodiloco.coordinator.rundir import EVENTS_FILE, PLAN_FILE, ROUND_LOG

CONTRIBUTING = ("accepted", "part")  # push outcomes that carried a contribution's bytes


class RunLogError(ValueError):
    """The directory is not a run directory, or its logs cannot be read."""


@dataclass(slots=True)
class Span:
    """Part of a site's round on the coordinator's clock (seconds since the first thing seen)."""

    kind: str  # compute, transfer or waiting
    start: float
    seconds: float


@dataclass(slots=True)
class SiteSeries:
    name: str
    tokens: list[int] = field(default_factory=list)  # cumulative, at each reported round
    eval_loss: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    spans: list[Span] = field(default_factory=list)
    bytes_up: int = 0
    bytes_down: int = 0
    outcomes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    lease_expiries: int = 0

    def seconds(self, kind: str) -> float:
        return sum(s.seconds for s in self.spans if s.kind == kind)


@dataclass(slots=True)
class RunLog:
    directory: Path
    rounds: list[dict[str, Any]]
    sites: dict[str, SiteSeries]
    global_tokens: list[int]  # cumulative committed tokens at each round with eval reports
    global_eval_loss: list[float]
    bytes_up: dict[int, int]  # per round: pseudo-gradient streams received
    bytes_down: dict[int, int]  # per round: update (or full-state) streams sent


def find_run_dir(path: Path) -> Path:
    """``path`` itself, or the ``coordinator/`` folder of a demo's run directory."""
    for candidate in (path, path / "coordinator"):
        if (candidate / ROUND_LOG).is_file() or (candidate / PLAN_FILE).is_file():
            return candidate
    raise RunLogError(f"{path}: no {ROUND_LOG} here or in {path / 'coordinator'}; is it a run directory?")


def round_log(directory: Path) -> Path:
    """The run's round log; a streaming run's (P > 1 fragments) is its last fragment's, whose
    rounds settle the data ledger and end each round of H steps."""
    if not (directory / PLAN_FILE).is_file():
        return directory / ROUND_LOG
    from geodiloco.coordinator.fragment_rounds import fragment_dir, read_plan  # torch: streaming runs only

    try:
        count = read_plan(directory).count
    except CorruptStateError as exc:
        raise RunLogError(str(exc)) from None
    return fragment_dir(directory, count - 1) / ROUND_LOG


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """A journal's whole lines (a line still being written is left out)."""
    try:
        return read_lines(path)
    except CorruptStateError as exc:
        raise RunLogError(str(exc)) from None


def load_run(path: Path) -> RunLog:
    directory = find_run_dir(path)
    log = round_log(directory)
    if not log.is_file():
        raise RunLogError(f"{log}: not found; no round committed yet?")
    rounds = _read_jsonl(log)
    if not rounds:
        raise RunLogError(f"{log}: no committed round yet")
    events_path = directory / EVENTS_FILE
    if not events_path.is_file():
        raise RunLogError(f"{events_path}: not found (written by coordinators since the operations release)")
    events = _read_jsonl(events_path)
    return _assemble(directory, rounds, events)


def _assemble(directory: Path, rounds: list[dict[str, Any]], events: list[dict[str, Any]]) -> RunLog:
    names = sorted(
        {c for r in rounds for c in r["contributors"]} | {e["site"] for e in events if e.get("site")}
    )
    sites = {name: SiteSeries(name) for name in names}
    # when each site's contribution to a round began to stream (sites that push per rank send
    # several parts; the one that completes it is "accepted", the others "part")
    push_started: dict[tuple[str, int], float] = {}
    for e in events:
        if e["event"] == "push" and e["outcome"] in CONTRIBUTING:
            key = (e["site"], e["round"])
            push_started[key] = min(e["t0"], push_started.get(key, e["t0"]))
    bytes_up: dict[int, int] = defaultdict(int)
    bytes_down: dict[int, int] = defaultdict(int)
    loss_sums: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for e in events:
        site = sites.get(e.get("site", ""))
        if site is None:
            continue
        kind = e["event"]
        if kind == "push":
            site.outcomes[e["outcome"]] += 1
            site.bytes_up += e["bytes"]
            bytes_up[e["round"]] += e["bytes"]
            if e["outcome"] in CONTRIBUTING:
                site.spans.append(Span("transfer", e["t0"], e["t1"] - e["t0"]))
        elif kind == "pull":
            site.bytes_down += e["bytes"]
            bytes_down[e["round"]] += e["bytes"]
            site.spans.append(Span("waiting", e["t0"], e["t_ready"] - e["t0"]))
            site.spans.append(Span("transfer", e["t_ready"], e["t1"] - e["t_ready"]))
        elif kind == "report":
            began = push_started.get((site.name, e["round"]))
            if began is not None and e["compute_s"] > 0:
                site.spans.append(Span("compute", began - e["compute_s"], e["compute_s"]))
            if e["eval_count"]:
                site.rounds.append(e["round"])
                site.tokens.append((site.tokens[-1] if site.tokens else 0) + e["tokens"])
                site.eval_loss.append(e["eval_loss_sum"] / e["eval_count"])
                loss_sums[e["round"]][0] += e["eval_loss_sum"]
                loss_sums[e["round"]][1] += e["eval_count"]
        elif kind == "lease_expired":
            site.lease_expiries += 1
    origin = min((s.start for site in sites.values() for s in site.spans), default=0.0)
    for site in sites.values():  # wall-clock times become seconds since the first span began
        for span in site.spans:
            span.start -= origin
    cumulative, total = [], 0
    for r in rounds:
        total += r["tokens"]
        cumulative.append(total)
    reported = [r for r in sorted(loss_sums) if r < len(rounds) and loss_sums[r][1]]
    return RunLog(
        directory,
        rounds,
        sites,
        [cumulative[r] for r in reported],
        [loss_sums[r][0] / loss_sums[r][1] for r in reported],
        dict(bytes_up),
        dict(bytes_down),
    )
