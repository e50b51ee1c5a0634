"""The run directory read back for `geodiloco report`: rounds and journal joined per site."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from geodiloco.app.runlog import RunLogError, load_run
from geodiloco.coordinator.fragment_rounds import fragment_dir
from geodiloco.coordinator.rundir import PLAN_FILE
from geodiloco.fragment_plan import FragmentPlan


def _write(path: Path, lines: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _round(r: int, contributors: list[str]) -> dict[str, Any]:
    tokens = 100 * len(contributors)
    return {"round": r, "contributors": contributors, "tokens": tokens, "state_hash": "ab" * 32}


def _push(site: str, r: int, t0: float, t1: float, size: int, outcome: str = "accepted") -> dict[str, Any]:
    return {
        "event": "push",
        "t": t1,
        "site": site,
        "round": r,
        "t0": t0,
        "t1": t1,
        "bytes": size,
        "outcome": outcome,
    }


def _pull(site: str, r: int, t0: float, ready: float, t1: float, size: int) -> dict[str, Any]:
    return {"event": "pull", "t": t1, "site": site, "round": r, "kind": "update", "t0": t0,
            "t_ready": ready, "t1": t1, "bytes": size}  # fmt: skip


def _report(site: str, r: int, loss_sum: float, compute_s: float) -> dict[str, Any]:
    return {"event": "report", "t": 0.0, "site": site, "round": r, "eval_loss_sum": loss_sum, "eval_count": 2,
            "train_loss": 3.0, "tokens": 100, "compute_s": compute_s}  # fmt: skip


def test_spans_bytes_and_losses_per_site_and_round(tmp_path: Path) -> None:
    run = tmp_path / "coordinator"  # a demo's layout: RUN_DIR/coordinator
    run.mkdir()
    _write(run / "rounds.jsonl", [_round(0, ["a", "b"]), _round(1, ["a"])])
    t = 1000.0
    events = [
        _push("a", 0, t + 4, t + 5, 40),
        _push("b", 0, t + 5.5, t + 6, 42),
        _pull("a", 0, t + 5, t + 6, t + 7, 30),
        _report("a", 0, 6.0, compute_s=3.0),
        _report("b", 0, 10.0, compute_s=0.5),
        _push("b", 0, t + 9, t + 9, 42, outcome="late"),
        {"event": "lease_expired", "t": t + 20, "site": "b", "round": 1},
        _push("a", 1, t + 20.5, t + 21, 21),
        _push("a", 1, t + 20, t + 20.5, 20, outcome="part"),  # a rank's share, streamed first
        _report("a", 1, 4.0, compute_s=10.0),
    ]
    _write(run / "events.jsonl", events)
    log = load_run(tmp_path)
    a, b = log.sites["a"], log.sites["b"]
    assert log.bytes_up == {0: 40 + 42 + 42, 1: 41} and log.bytes_down == {0: 30}
    assert (a.bytes_up, a.bytes_down, b.bytes_up) == (81, 30, 84)
    assert a.tokens == [100, 200] and a.eval_loss == [3.0, 2.0] and b.eval_loss == [5.0]
    assert log.global_tokens == [200, 300] and log.global_eval_loss == [4.0, 2.0]
    assert b.outcomes == {"accepted": 1, "late": 1} and b.lease_expiries == 1
    assert a.outcomes == {"accepted": 2, "part": 1}
    # the origin is the earliest compute start: a's round 0 began 3 s before its push at t+4
    assert (a.seconds("compute"), a.seconds("transfer"), a.seconds("waiting")) == (13.0, 3.0, 1.0)
    assert min(s.start for site in log.sites.values() for s in site.spans) == 0.0
    compute_a = sorted(s.start for s in a.spans if s.kind == "compute")
    assert compute_a == [0.0, 20.0 - 10.0 - 1.0]


def test_what_is_not_a_run_directory_is_named(tmp_path: Path) -> None:
    with pytest.raises(RunLogError, match=r"no rounds\.jsonl here"):
        load_run(tmp_path)
    (tmp_path / "rounds.jsonl").write_text("")
    with pytest.raises(RunLogError, match="no committed round yet"):
        load_run(tmp_path)
    _write(tmp_path / "rounds.jsonl", [_round(0, ["a"])])
    with pytest.raises(RunLogError, match=r"events\.jsonl: not found"):
        load_run(tmp_path)


def test_a_streaming_runs_rounds_are_its_last_fragments(tmp_path: Path) -> None:
    """P > 1: each fragment keeps its round log in RUN_DIR/fragment-p/; the run's rounds are the
    last fragment's (it settles the data), the events journal is the run's own."""
    plan = FragmentPlan(((0,), (1,)), (10, 10))
    (tmp_path / PLAN_FILE).write_text(plan.to_json())
    for p, contributors in enumerate((["a"], ["a", "b"])):
        fragment_dir(tmp_path, p).mkdir()
        _write(fragment_dir(tmp_path, p) / "rounds.jsonl", [_round(0, contributors)])
    events = [_push("a", 0, 1.0, 2.0, 40), _push("b", 0, 1.0, 2.5, 42), _report("a", 0, 6.0, compute_s=1.0)]
    _write(tmp_path / "events.jsonl", events)
    log = load_run(tmp_path)
    assert log.global_tokens == [200]  # the last fragment's round: both sites' tokens
    assert log.bytes_up == {0: 82} and sorted(log.sites) == ["a", "b"]
    (tmp_path / PLAN_FILE).write_text("{}")
    with pytest.raises(RunLogError, match="not a fragment plan"):
        load_run(tmp_path)
