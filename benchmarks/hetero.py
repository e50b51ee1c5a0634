"""Sites of different speeds (issue 41): 3 sites on the chaos benchmark's workload, site-3 made
2x slower by a fault plan's ``slow``, side by side in one invocation:

- ``a`` step rounds as before (``steps_per_round`` steps, late pushes dropped, fixed deadline);
- ``b`` rounds by time (``inner.round_seconds``: the fast sites' median time from a commit to
  their next push in ``a``, their round less its exchange)
  with late merging (``outer.max_staleness`` 2) and the adaptive grace window, the exchange
  overlapping three quarters of each site's window (``outer.overlap_steps`` = 3/4 of the cap
  ``inner.steps_per_round``: a site pushes a quarter into its window, trains the rest of it and
  mixes the round's update in at its end; the push, the commit and the pull, which took 0.1 to
  0.3 s on the loaded 2-core machine against windows of 0.3 to 0.7 s, hide behind those steps),
  and a quorum of one (``min_sites`` 1: a round commits on whoever is in when its window
  closes; with the default, two of three, the chaos plan's kills of a fast site stopped the
  run until it was back, as site-3 behind its slow link contributes almost nothing);
- ``c`` ``b`` under the chaos plan of ``benchmarks/chaos.py``.

The same token budget: ``a``'s committed tokens. ``b`` and ``c`` get more rounds than should
spend it and are read at the budget: ``final_eval_loss`` and ``wall_s`` are interpolated,
linearly in committed tokens, between the two rounds around it. Per mode, as JSON (``--json
PATH``), exactly these keys per row:

- ``goodput``: tokens in committed updates / tokens the sites computed, over the whole run. The
  sites' own logs count what they computed (a line per push: "pushing N tokens"; a site killed
  before it pushes loses steps that no line counts, which the chaos plan never does: it kills
  sites at their push or pull);
- ``fast_idle_share``: the time the outer sync held the two fast sites' training (their own
  logs: a line per round; push, wait for the commit, pull), over the rounds after the first
  (which waits for every site to start), / the time from the first commit to the last;
- ``late_merged``, ``late_dropped``: pushes merged into a later round, dropped as late;
- ``wall_s``: from the first commit (every site joined and trained its first round) to the
  commit that reached the token budget; the start-up before it (seconds of imports and a dry
  step, the same work in every mode) moved by up to 12 s between modes on a loaded machine;
- ``final_eval_loss``: the eval loss at the budget (rounds whose reports cover the whole eval set);
- ``eval_loss_at_equal_wall``: the last eval loss each mode had at the ``wall_s`` of the fastest
  mode (its initial loss, θ_0's, when it had none yet);
- ``hashes_agree``, ``ledger_audit_clean``: every site's hash, the round log's chain, and every
  data window consumed once.

``details`` holds per mode what the figures came from: rounds committed and lost, tokens
committed and computed, whether it reached the budget, and from the coordinator's log the fast
sites' time from their push's acceptance to the commit (the idle share as measured before the
overlap: with τ > 0 the sites train through it) with the part of it after the round's last
acceptance (the commit itself, or a grace window waiting for a site that never pushed in time).

    python benchmarks/hetero.py [--json PATH] [--rounds 24] [--steps 16] [--keep DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import re
import statistics
import sys
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from chaos import SITES, SLOW_SITE, Settings, Soak

from geodiloco.builders import build_data, build_loss, build_model
from geodiloco.config import RunConfig
from geodiloco.faults import Fault
from geodiloco.testing.audits import ledger_problems
from geodiloco.workload.steps import evaluate_batches

FAST = [s for s in SITES if s != SLOW_SITE]
SLOWDOWN = 2.0
MARGIN = 2.0  # b and c get this many times the rounds that should spend a's budget (the window
# follows a's timing, and the load moves between the modes: 1.3 fell short)
LINE = re.compile(r"^(\S+ \S+) .*round (\d+)(?:: accepted (\S+) \(| committed)")
PUSH = re.compile(r"round \d+: pushing (\d+) tokens")
HELD = re.compile(r"round (\d+) closed: (\d+) steps, the outer sync held them (\S+)s")


@dataclasses.dataclass(kw_only=True, slots=True)
class Mode(Settings):
    """The chaos benchmark's run with one mode's rounds."""

    round_seconds: float = 0.0
    late: bool = False
    overlap: int = 0
    min_sites: int = 0  # 0: the default quorum, half of the sites rounded up

    def run_config(self) -> RunConfig:
        base = Settings.run_config(self).to_dict()
        base["inner"]["round_seconds"] = self.round_seconds
        if self.round_seconds:  # the cap: the windows reserved per round
            base["inner"]["steps_per_round"] = 4 * self.steps_per_round
        base["outer"]["max_staleness"] = 2 if self.late else 0
        base["outer"]["overlap_steps"] = self.overlap
        base["min_sites"] = self.min_sites
        base["grace"] = {"adaptive": self.late}
        return RunConfig.from_dict(base)


def stamp(text: str) -> float:
    """A log line's time (its first 23 characters)."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def times(log: Path) -> tuple[dict[int, float], dict[tuple[int, str], float]]:
    """Commit times per round and acceptance times per (round, site), from a coordinator log
    (a round accepted again after a coordinator restart: its last acceptance)."""
    commits: dict[int, float] = {}
    accepted: dict[tuple[int, str], float] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if m is None:
            continue
        at = stamp(m.group(1))
        if m.group(3):
            accepted[(int(m.group(2)), m.group(3))] = at
        else:
            commits.setdefault(int(m.group(2)), at)
    return commits, accepted


def computed_tokens(workdir: Path) -> int:
    """The tokens every site pushed or tried to push, from their own logs (all restarts)."""
    return sum(
        int(m.group(1))
        for name in SITES
        for m in PUSH.finditer((workdir / f"{name}.log").read_text(errors="replace"))
    )


def held_seconds(workdir: Path, site: str, rounds: range) -> float:
    """The seconds the outer sync held ``site``'s training in ``rounds``, from its log (all
    restarts; a round trained again after a restart: both times)."""
    text = (workdir / f"{site}.log").read_text(errors="replace")
    return sum(float(m.group(3)) for m in HELD.finditer(text) if int(m.group(1)) in rounds)


def eval_losses(run_dir: Path) -> dict[int, float]:
    """Per round, the eval loss of the sites' reports, where they cover the whole eval set."""
    reports: dict[tuple[int, str], tuple[float, int]] = {}
    path = run_dir / "reports.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        reports[(r["round"], r["site"])] = (r["eval_loss_sum"], r["eval_count"])
    rounds: dict[int, list[tuple[float, int]]] = {}
    for (round_, _), value in reports.items():
        rounds.setdefault(round_, []).append(value)
    full = max((sum(c for _, c in v) for v in rounds.values()), default=0)
    return {r: sum(s for s, _ in v) / full for r, v in sorted(rounds.items()) if sum(c for _, c in v) == full}


def initial_eval_loss(cfg: RunConfig) -> float:
    """θ_0's eval loss on the whole eval set (every mode starts there)."""
    total, count = evaluate_batches(build_model(cfg), build_data(cfg).eval_batches(0, 1), build_loss(cfg))
    return total / count


def at_tokens(points: list[tuple[int, float]], budget: int) -> float:
    """The value at ``budget`` tokens, linear between the points around it (the last beyond)."""
    for (t0, v0), (t1, v1) in itertools.pairwise(points):
        if t0 <= budget <= t1:
            return v0 if t1 == t0 else v0 + (v1 - v0) * (budget - t0) / (t1 - t0)
    return points[-1][1]


def run_mode(name: str, mode: Mode, faults: list[Fault], workdir: Path) -> dict[str, Any]:
    """Run one mode; its figures over the whole run, and its curve to read at the budget."""
    workdir.mkdir(parents=True, exist_ok=True)
    slow = Fault(action="slow", site=SLOW_SITE, round=0, factor=SLOWDOWN)
    soak = Soak(mode, workdir, [slow, *faults])
    result = soak.run()
    entries = [json.loads(line) for line in (soak.run_dir / "rounds.jsonl").read_text().split("\n")[:-1]]
    log = list({e["round"]: e for e in entries}.values())  # a round logged again after a restart: once
    status = soak.status
    commits, accepted = times(workdir / "coordinator.log")
    first, last = min(commits), max(commits)
    idle = sum(held_seconds(workdir, site, range(first + 1, last + 1)) for site in FAST)
    waits = [(r, t) for (r, site), t in accepted.items() if site in FAST and r in commits and r > first]
    accepted_to_commit = sum(commits[r] - t for r, t in waits)
    # of which the commit itself: from the round's last acceptance to its commit
    last_in = {r: max(t for (q, _), t in accepted.items() if q == r) for r, _ in waits}
    committing = sum(commits[r] - last_in[r] for r, _ in waits)
    span = len(FAST) * max(commits[last] - commits[first], 1e-9)
    losses = eval_losses(soak.run_dir)
    cumulative, tokens, curve = 0, [], []
    log.sort(key=lambda e: e["round"])
    for e in log:
        cumulative += e["tokens"]
        at = soak.commits[e["round"]] - soak.commits[log[0]["round"]]
        tokens.append((cumulative, at))
        if e["round"] in losses:
            curve.append((cumulative, at, losses[e["round"]]))
    computed = computed_tokens(workdir)
    return {
        "mode": name,
        "goodput": cumulative / computed if computed else math.nan,
        "fast_idle_share": idle / span,
        "late_merged": sum(s.late_merged for s in status.sites),
        "late_dropped": sum(s.late for s in status.sites),
        "hashes_agree": result["hash_mismatches"] == 0 and all(h.hashes_agree for h in status.history),
        "ledger_audit_clean": not ledger_problems(log, soak.cfg),
        "_details": {
            "rounds": len(log),
            "rounds_lost": result["rounds_lost"],
            "tokens_committed": cumulative,
            "tokens_computed": computed,
            "fast_accepted_to_commit_share": accepted_to_commit / span,
            "fast_idle_committing_share": committing / span,
        },
        "_tokens": tokens,
        "_curve": curve,
    }


def at_budget(row: dict[str, Any], budget: int) -> None:
    """``wall_s`` and ``final_eval_loss`` where the mode's committed tokens reach ``budget``."""
    tokens, curve = row.pop("_tokens"), row["_curve"]
    row["wall_s"] = at_tokens([(t, at) for t, at in tokens], budget)
    row["final_eval_loss"] = at_tokens([(t, loss) for t, _, loss in curve], budget) if curve else math.nan
    row["_details"]["reached_budget"] = tokens[-1][0] >= budget
    if tokens[0][0] >= budget:  # wall_s is 0: the first commit, where it counts from, had them all
        print(f"mode {row['mode']}: its first round reached the budget {budget}: wall_s 0", file=sys.stderr)
    if tokens[-1][0] < budget:
        print(f"mode {row['mode']}: {tokens[-1][0]} tokens, short of the budget {budget}", file=sys.stderr)


def round_seconds_of(workdir: Path) -> float:
    """The fast sites' median time from a commit to their next push in ``a``: a fast site's round
    less its exchange, which a window by time overlaps with training."""
    commits, accepted = times(workdir / "coordinator.log")
    lags = [t - commits[r - 1] for (r, site), t in accepted.items() if site in FAST and r - 1 in commits]
    return statistics.median(lags) if lags else 1.0


ROW = (
    "mode",
    "goodput",
    "fast_idle_share",
    "late_merged",
    "late_dropped",
    "wall_s",
    "final_eval_loss",
    "eval_loss_at_equal_wall",
    "hashes_agree",
    "ledger_audit_clean",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--rounds", type=int, default=24, help="rounds of mode a (default 24)")
    parser.add_argument("--steps", type=int, default=16, help="steps per round of mode a (default 16)")
    parser.add_argument("--keep", type=Path, help="keep the processes' logs in this directory")
    parser.add_argument("--smoke", action="store_true", help="4 rounds of 4 steps, the chaos smoke plan")
    args = parser.parse_args()
    rounds, steps = (4, 4) if args.smoke else (args.rounds, args.steps)
    step_rounds = Mode(rounds=rounds, steps_per_round=steps, smoke=args.smoke, slow_link=False)
    with tempfile.TemporaryDirectory(prefix="geodiloco-hetero-") as scratch:
        root = args.keep or Path(scratch)
        a = run_mode("a", step_rounds, [], root / "a")
        budget = a["_details"]["tokens_committed"]
        seconds = round(round_seconds_of(root / "a"), 3)
        # the fast sites train about a's steps per round, the slow one half as many
        more = math.ceil(MARGIN * rounds * len(SITES) / (len(FAST) + 1 / SLOWDOWN))
        overlap = 3 * steps  # 3/4 of each site's window overlaps the exchange (of the cap, 4 x steps)
        by_time = dataclasses.replace(
            step_rounds, rounds=more, round_seconds=seconds, late=True, overlap=overlap, min_sites=1
        )
        b = run_mode("b", by_time, [], root / "b")
        chaos = Settings(rounds=more, smoke=args.smoke).faults()
        c = run_mode("c", dataclasses.replace(by_time, slow_link=True), chaos, root / "c")
    rows = [a, b, c]
    for r in rows:
        at_budget(r, budget)
    equal = min(r["wall_s"] for r in rows)
    initial = initial_eval_loss(step_rounds.run_config())
    details = {}
    for r in rows:
        seen = [loss for _, at, loss in r.pop("_curve") if at <= equal]
        r["eval_loss_at_equal_wall"] = seen[-1] if seen else initial
        details[r["mode"]] = r.pop("_details")
    results = {
        "round_seconds": seconds,
        "steps_per_round": steps,
        "overlap_steps": overlap,
        "slowdown": SLOWDOWN,
        "token_budget": budget,
        "initial_eval_loss": initial,
        "rows": [{k: r[k] for k in ROW} for r in rows],
        "details": details,
    }
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
