"""Sites of different speeds (issue 41): 3 sites on the chaos benchmark's workload, site-3 made
2x slower by a fault plan's ``slow``, side by side in one invocation:

- ``a`` step rounds as before (``steps_per_round`` steps, late pushes dropped, fixed deadline);
- ``b`` rounds by time (``inner.round_seconds``, calibrated to the fast sites' round in ``a``)
  with late merging (``outer.max_staleness`` 2) and the adaptive grace window;
- ``c`` ``b`` under the chaos plan of ``benchmarks/chaos.py``.

``b`` and ``c`` get as many rounds as spend ``a``'s token budget (the slow site trains half as
many steps per round). Per mode, as JSON (``--json PATH``): ``goodput`` (tokens in committed
updates / tokens the sites computed, a dropped push counted at its site's mean tokens per push),
``fast_idle_share`` (the fast sites' time between their push being accepted and the round's
commit / their wall time, from the coordinator's log), ``late_merged``, ``late_dropped``,
``wall_s``, ``final_eval_loss``, ``eval_loss_at_equal_wall`` (the eval loss of the last round
each mode had committed at the wall time the fastest mode finished), ``hashes_agree``,
``ledger_audit_clean``.

    python benchmarks/hetero.py [--json PATH] [--rounds 24] [--keep DIR] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
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

from geodiloco.config import RunConfig
from geodiloco.faults import Fault
from geodiloco.testing.audits import ledger_problems

FAST = [s for s in SITES if s != SLOW_SITE]
SLOWDOWN = 2.0
LINE = re.compile(r"^(\S+ \S+) .*round (\d+)(?:: accepted (\S+) \(| committed)")


@dataclasses.dataclass(kw_only=True, slots=True)
class Mode(Settings):
    """The chaos benchmark's run with one mode's rounds."""

    round_seconds: float = 0.0
    late: bool = False

    def run_config(self) -> RunConfig:
        base = Settings.run_config(self).to_dict()
        base["inner"]["round_seconds"] = self.round_seconds
        if self.round_seconds:  # the cap: the windows reserved per round
            base["inner"]["steps_per_round"] = 4 * self.steps_per_round
        base["outer"]["max_staleness"] = 2 if self.late else 0
        base["grace"] = {"adaptive": self.late}
        return RunConfig.from_dict(base)


def times(log: Path) -> tuple[dict[int, float], dict[tuple[int, str], float]]:
    """Commit times per round and acceptance times per (round, site), from a coordinator log."""
    commits: dict[int, float] = {}
    accepted: dict[tuple[int, str], float] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if m is None:
            continue
        at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if m.group(3):
            accepted[(int(m.group(2)), m.group(3))] = at
        else:
            commits.setdefault(int(m.group(2)), at)
    return commits, accepted


def run_mode(name: str, mode: Mode, faults: list[Fault], workdir: Path) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    slow = Fault(action="slow", site=SLOW_SITE, round=0, factor=SLOWDOWN)
    soak = Soak(mode, workdir, [slow, *faults])
    result = soak.run()
    log = [json.loads(line) for line in (soak.run_dir / "rounds.jsonl").read_text().split("\n")[:-1]]
    status = soak.status
    committed = sum(r["tokens"] for r in log)
    pushes = sum(s.accepted + s.late_merged for s in status.sites)
    dropped = sum(s.late for s in status.sites)
    computed = committed + dropped * committed / max(pushes, 1)
    commits, accepted = times(workdir / "coordinator.log")
    idle = sum(commits[r] - t for (r, site), t in accepted.items() if site in FAST and r in commits)
    curve = [
        (soak.commits[h.round] - soak.started, h.eval_loss) for h in status.history if h.round in soak.commits
    ]
    return {
        "mode": name,
        "goodput": committed / computed if computed else math.nan,
        "fast_idle_share": idle / (len(FAST) * result["wall_s"]),
        "late_merged": sum(s.late_merged for s in status.sites),
        "late_dropped": dropped,
        "wall_s": result["wall_s"],
        "final_eval_loss": result["final_eval_loss"],
        "hashes_agree": result["hash_mismatches"] == 0 and all(h.hashes_agree for h in status.history),
        "ledger_audit_clean": not ledger_problems(log, soak.cfg),
        "rounds": len(log),
        "tokens": committed,
        "_curve": curve,
    }


def round_seconds_of(workdir: Path) -> float:
    """The fast sites' median time from a commit to their next push: a fast site's round."""
    commits, accepted = times(workdir / "coordinator.log")
    lags = [t - commits[r - 1] for (r, site), t in accepted.items() if site in FAST and r - 1 in commits]
    return statistics.median(lags) if lags else 1.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--rounds", type=int, default=24, help="rounds of mode a (default 24)")
    parser.add_argument("--keep", type=Path, help="keep the processes' logs in this directory")
    parser.add_argument("--smoke", action="store_true", help="4 rounds of a, the chaos smoke plan")
    args = parser.parse_args()
    rounds = 4 if args.smoke else args.rounds
    step_rounds = Mode(rounds=rounds, smoke=args.smoke, slow_link=False)
    with tempfile.TemporaryDirectory(prefix="geodiloco-hetero-") as scratch:
        root = args.keep or Path(scratch)
        a = run_mode("a", step_rounds, [], root / "a")
        seconds = round_seconds_of(root / "a")
        # the same token budget: the fast sites train a's steps per round, the slow one half
        budget = math.ceil(rounds * len(SITES) / (len(FAST) + 1 / SLOWDOWN))
        by_time = dataclasses.replace(step_rounds, rounds=budget, round_seconds=round(seconds, 3), late=True)
        b = run_mode("b", by_time, [], root / "b")
        chaos = Settings(rounds=budget, smoke=args.smoke).faults()
        c = run_mode("c", dataclasses.replace(by_time, slow_link=True), chaos, root / "c")
    rows = [a, b, c]
    equal = min(r["wall_s"] for r in rows)
    for r in rows:
        seen = [loss for t, loss in r.pop("_curve") if t <= equal]
        r["eval_loss_at_equal_wall"] = seen[-1] if seen else math.nan
    results = {"round_seconds": by_time.round_seconds, "slowdown": SLOWDOWN, "rows": rows}
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
