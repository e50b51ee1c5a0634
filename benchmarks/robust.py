"""One poisoning site of four (issue 40): the default aggregation rule against the plain mean, on
the chaos benchmark's workload, with real processes (a coordinator, one torchrun site per site
behind its WAN proxy; ``benchmarks/chaos.py``'s supervisor).

Per rule (the default ``aggregation.rule`` and ``mean``) and per attack of the fault plan's
``poison`` (placed on the last site from round 0, every rank of it):

- ``sign_flip``: its pseudo-gradient times ``-SIGN_FACTOR``;
- ``noise``: Gaussian noise of norm ``HOSTILE_SHARE`` x ‖θ_0‖;
- ``constant``: every element ``HOSTILE_SHARE`` x ‖θ_0‖ / √N (the same norm),

all under ``limits.max_delta_norm_ratio`` (1 x ‖θ‖), so that the norm check alone lets them in. A
row (:func:`poison_rows`, exactly the keys ``rule``, ``attack``, ``final_eval_loss``,
``honest_eval_loss``) gives the eval loss of the final θ (the run directory's committed
parameters, on the whole eval set) of the poisoned run, and of the same rule's run without the
poisoning site (the other sites alone). The CLI adds, per rule, the honest run with every site
(``honest_all``): what the rule costs when nobody attacks.

    python benchmarks/robust.py [--json PATH] [--sites 4] [--rounds 16] [--keep DIR] [--smoke]

``--smoke``: 2 rounds, the sign flip only, and every run in this process (:func:`local_run`:
the in-process link, sites as threads) so that it takes seconds; the figures in the docs come
from the process runs. ``benchmarks/secagg.py`` imports :func:`poison_rows`.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch
from chaos import Settings, Soak

from geodiloco.builders import build_data, build_loss, build_model, build_optimizer
from geodiloco.config import AggregationConfig, RunConfig
from geodiloco.coordinator.replay import committed_parameters
from geodiloco.faults import FAULT_PLAN_ENV, Fault, FaultPlan
from geodiloco.faults import poison as poison_hook
from geodiloco.fragment_plan import FragmentPlan
from geodiloco.params import flatten_parameters, load_flat_parameters
from geodiloco.site.outer_sync import OuterSync
from geodiloco.testing.local_link import LocalCoordinator
from geodiloco.workload.steps import evaluate_batches, inner_step

DEFAULT = AggregationConfig().rule
RULES = (DEFAULT, "mean")
ATTACKS = ("sign_flip", "noise", "constant")
SIGN_FACTOR = 4.0
HOSTILE_SHARE = 0.5  # of ‖θ_0‖: noise and constant stay under limits.max_delta_norm_ratio 1
ROW = ("rule", "attack", "final_eval_loss", "honest_eval_loss")


@dataclasses.dataclass(kw_only=True, slots=True)
class Robust(Settings):
    """The chaos benchmark's run with a rule and no slow link."""

    rule: str = DEFAULT
    slow_link: bool = False
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)  # dotted keys: values

    def run_config(self) -> RunConfig:
        base = Settings.run_config(self).to_dict()
        base["run_id"] = "robust-bench"
        base["aggregation"] = {"rule": self.rule}
        for key, value in self.overrides.items():
            *parents, leaf = key.split(".")
            node = base
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        return RunConfig.from_dict(base)


def site_names(count: int) -> tuple[str, ...]:
    return tuple(f"site-{i + 1}" for i in range(count))


def poison(attack: str, site: str, cfg: RunConfig) -> Fault:
    """The attack, sized from θ_0 (the same on every site: the model builder is seeded)."""
    if attack == "sign_flip":
        return Fault(action="poison", site=site, round=0, at="push", mode=attack, factor=SIGN_FACTOR)
    theta = flatten_parameters(build_model(cfg))
    norm = HOSTILE_SHARE * float(theta.norm())
    if attack == "noise":
        return Fault(action="poison", site=site, round=0, at="push", mode=attack, norm=norm)
    value = norm / math.sqrt(theta.numel())
    return Fault(action="poison", site=site, round=0, at="push", mode="constant", value=value)


def eval_loss(cfg: RunConfig, theta: torch.Tensor) -> float:
    """The eval loss of θ on the whole eval set."""
    model = build_model(cfg)
    load_flat_parameters(model, theta)
    total, count = evaluate_batches(model, build_data(cfg).eval_batches(0, 1), build_loss(cfg))
    return total / count


def process_run(settings: Robust, faults: list[Fault], workdir: Path) -> tuple[torch.Tensor, bool]:
    """The run with real processes; its final θ, and whether it lost no round, every hash agreed
    and every window was trained once."""
    soak = Soak(settings, workdir, faults)
    result = soak.run()
    clean = (
        result["rounds_lost"] == 0 and result["hash_mismatches"] == 0 and result["ledger_audit"] == "clean"
    )
    return committed_parameters(soak.run_dir).theta, clean


def local_run(settings: Robust, faults: list[Fault], workdir: Path) -> tuple[torch.Tensor, bool]:
    """The same run in this process (``--smoke``): the round controllers behind the in-process
    link, each site a thread with the reference model, optimizer and data, the plan's poison
    applied by the site's outer loop as the daemon applies it; no gRPC, no processes."""
    cfg = settings.run_config()
    plan = workdir / "plan.json"
    FaultPlan(faults=faults).write(plan)
    os.environ[FAULT_PLAN_ENV] = str(plan)
    model = build_model(cfg)
    coordinator = LocalCoordinator(
        cfg, flatten_parameters(model), build_data(cfg).shard_sizes, FragmentPlan.of_model(model, 1)
    )
    try:
        with coordinator:
            threads = [threading.Thread(target=local_site, args=(coordinator, n, cfg)) for n in cfg.sites]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            history = coordinator.controller.primary.history
            clean = len(history) == cfg.rounds and all(h.hashes_agree for h in history)
            return coordinator.controller.theta(), clean
    finally:
        os.environ.pop(FAULT_PLAN_ENV, None)


def local_site(coordinator: LocalCoordinator, name: str, cfg: RunConfig) -> None:
    sync = OuterSync.over(coordinator.link(name))
    model = sync.attach(build_model(cfg))
    sync.tamper = functools.partial(poison_hook, name, 0)
    optimizer, data, loss_fn = build_optimizer(model, cfg), build_data(cfg), build_loss(cfg)
    try:
        while not sync.finished:
            batch = data.batch(sync.data, sync.steps_in_round, 0, 1)
            inner_step(model, optimizer, cfg.inner, sync.lr_step, *batch, loss_fn=loss_fn)
            if sync.step(tokens=data.tokens(batch)):
                sync.report(0.0, 0, 0.0, 0.0)
    finally:
        sync.close()


class Runs:
    """The runs of one invocation, each run once: (rule, sites, attack or "") -> final eval loss."""

    def __init__(self, root: Path, rounds: int, smoke: bool, overrides: dict[str, Any] | None = None) -> None:
        self.root, self.rounds, self.smoke = root, rounds, smoke
        self.overrides = dict(overrides or {})
        self.losses: dict[tuple[str, int, str], float] = {}
        self.clean: dict[tuple[str, int, str], bool] = {}

    def loss(self, rule: str, sites: int, attack: str = "") -> float:
        key = (rule, sites, attack)
        if key not in self.losses:
            settings = Robust(
                rounds=self.rounds,
                rule=rule,
                sites=site_names(sites),
                smoke=self.smoke,
                overrides=self.overrides,
            )
            cfg = settings.run_config()
            faults = [poison(attack, settings.sites[-1], cfg)] if attack else []
            workdir = self.root / f"{rule}-{sites}-{attack or 'honest'}"
            workdir.mkdir(parents=True, exist_ok=True)
            theta, self.clean[key] = (local_run if self.smoke else process_run)(settings, faults, workdir)
            self.losses[key] = eval_loss(cfg, theta)
            print(f"{workdir.name}: final eval loss {self.losses[key]:.4f}", file=sys.stderr)
        return self.losses[key]


def poison_rows(
    sites: int,
    smoke: bool,
    rounds: int | None = None,
    runs: Runs | None = None,
    root: Path | None = None,
    overrides: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """One row per rule (the default, then ``mean``) and attack: ``sites`` sites of which the last
    poisons, and ``honest_eval_loss`` of the same rule's run with the other ``sites - 1`` alone.
    ``overrides``: run-config values by dotted key (e.g. ``{"compression.uplink": "q8"}``) for
    every run; ``root`` keeps the runs' files there."""
    if runs is None:
        with tempfile.TemporaryDirectory(prefix="geodiloco-robust-") as scratch:
            made = Runs(root or Path(scratch), rounds or (2 if smoke else 16), smoke, overrides)
            return poison_rows(sites, smoke, rounds, made)
    attacks = ATTACKS[:1] if smoke else ATTACKS
    return [
        {
            "rule": rule,
            "attack": attack,
            "final_eval_loss": runs.loss(rule, sites, attack),
            "honest_eval_loss": runs.loss(rule, sites - 1),
        }
        for rule in RULES
        for attack in attacks
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--sites", type=int, default=4, help="sites, the last of which poisons (default 4)")
    parser.add_argument("--rounds", type=int, default=16, help="rounds of each run (default 16)")
    parser.add_argument("--keep", type=Path, help="keep the processes' logs in this directory")
    parser.add_argument("--smoke", action="store_true", help="2 rounds, the sign flip only")
    args = parser.parse_args()
    rounds = 2 if args.smoke else args.rounds
    with tempfile.TemporaryDirectory(prefix="geodiloco-robust-") as scratch:
        runs = Runs(args.keep or Path(scratch), rounds, args.smoke)
        rows = poison_rows(args.sites, args.smoke, rounds, runs)
        honest_all = {rule: runs.loss(rule, args.sites) for rule in RULES}
    results = {
        "sites": args.sites,
        "rounds": rounds,
        "steps_per_round": Robust().steps_per_round,
        "default_rule": DEFAULT,
        "attacks": {"sign_flip_factor": SIGN_FACTOR, "hostile_share_of_theta_norm": HOSTILE_SHARE},
        "poison": rows,
        # per row: its final eval loss against its honest run's, - 1
        "poison_vs_honest": [r["final_eval_loss"] / r["honest_eval_loss"] - 1 for r in rows],
        "honest_all": honest_all,
        "honest_default_vs_mean": honest_all[DEFAULT] / honest_all["mean"] - 1,
        "runs_clean": all(runs.clean.values()),
    }
    print(json.dumps(results, indent=2))
    for row, vs in zip(rows, results["poison_vs_honest"], strict=True):
        print(
            f"{row['rule']:>14} {row['attack']:>9}: {row['final_eval_loss']:.4f} against "
            f"{row['honest_eval_loss']:.4f} without the poisoning site ({vs:+.2%})",
            file=sys.stderr,
        )
    print(
        f"honest, {args.sites} sites: {DEFAULT} {honest_all[DEFAULT]:.4f}, mean {honest_all['mean']:.4f} "
        f"({results['honest_default_vs_mean']:+.2%})",
        file=sys.stderr,
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    sys.exit(0)


if __name__ == "__main__":
    main()
