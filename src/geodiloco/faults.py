"""Deterministic fault injection: faults placed by training position, not by wall clock.

A chaos test (or an operator rehearsing failures) writes a plan, a JSON file named by
``GEODILOCO_FAULT_PLAN`` in the sites' (and the coordinator's) environment. A fault is placed
``at`` one of four points of a round, so every fault lands at the same point of training in
every run:

- ``step``: before inner step ``step`` of ``round`` (the site's training loop, :func:`at`);
- ``push``: in the push of ``round``'s pseudo-gradient, once ``chunk`` chunks were sent;
- ``pull``: in the pull of the update closing ``round`` (or of a full state while the site is at
  ``round``), once ``chunk`` chunks arrived; ``chunk`` 0 is the moment the commit reaches the
  site, before it takes anything;
- ``commit``: in the coordinator, while it commits ``round`` (new state in memory, not yet durable).

Site points are reached by the rank a fault names (``site``, ``rank``); it fires when it first
reaches the fault's position (or, if a catch-up skipped it, the first position after it of the
same kind). Actions:

- ``kill``: SIGKILL the site (its torchrun and every rank), or with ``"target": "coordinator"``
  the coordinator (at a site point: the process ``coordinator_pid`` names; at ``commit``: itself);
- ``raise``: the coordinator dies by an uncaught exception (``commit`` only), as a bug would;
- ``partition``: cut the site's WAN link for ``seconds``;
- ``delay``: add ``delay_ms`` of one-way latency to the site's link for ``seconds``;
- ``drop``: reset every connection of the site's link;
- ``slow``: from its point on, every rank of the site computes ``factor`` times slower (each
  inner step is followed by a sleep of ``factor - 1`` times its own duration), as a site on
  older accelerators or shared with other jobs would; it stays in effect across the site's
  restarts (it is the site's hardware, not an event), and is recorded once when it first
  takes effect;
- ``poison``: from its round on (placed ``at`` "push"), every rank of the site replaces what it
  pushes, after error feedback and before encoding, by a hostile pseudo-gradient of ``mode``:
  ``sign_flip`` (Δ times ``-factor``), ``noise`` (Gaussian noise of L2 norm ``norm`` over each
  fragment, a different draw per round, fragment and rank) or ``constant`` (every element
  ``value``), as a broken or Byzantine site would (for robust aggregation, ``aggregation.rule``);
  like a slow, it is a state of the site and stays in effect across its restarts.

Link faults go to the site's ``geodiloco wan`` proxy through its control port (``links`` in the
plan). Each fault fires once per plan, even across restarts of the site or the coordinator:
before acting, the process claims it by creating ``<plan>.fired/<index>.json`` (which records
where it fired; a ``slow``, the point where it first took effect). A supervisor that restarts
the coordinator rewrites the plan with its new ``coordinator_pid`` (read when a kill fires,
never cached).

Example plan::

    {"links": {"site-2": "127.0.0.1:7002"}, "coordinator_pid": 4242,
     "faults": [{"action": "kill", "site": "site-1", "rank": 1, "round": 2, "step": 3},
                {"action": "kill", "site": "site-3", "round": 5, "at": "push", "chunk": 2,
                 "target": "coordinator"},
                {"action": "raise", "round": 8, "at": "commit", "target": "coordinator"},
                {"action": "partition", "site": "site-2", "round": 6, "step": 1, "seconds": 10}]}
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger("geodiloco.faults")

FAULT_PLAN_ENV = "GEODILOCO_FAULT_PLAN"
ACTIONS = ("kill", "raise", "partition", "delay", "drop", "slow", "poison")
POISON_MODES = ("sign_flip", "noise", "constant")
TARGETS = ("site", "coordinator")
POINTS = ("step", "push", "pull", "commit")
LINK_ACTIONS = ("partition", "delay", "drop")  # sent to the site's WAN proxy
CONTROL_TIMEOUT_S = 10.0
MAX_SLOWDOWN = 100.0


class FaultPlanError(ValueError):
    """A plan that cannot be used; the message names the field."""


class InjectedCrash(SystemExit):
    """A ``raise`` fault: an uncaught exception that ends the coordinator's process (a SystemExit,
    so that neither gRPC's handler nor asyncio's task machinery keeps the process alive)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One fault and the point of training where it fires."""

    action: str
    round: int
    site: str = ""  # whose training position places the fault (and whose link or process it hits)
    at: str = "step"  # the point of the round: step, push, pull or commit (see the module doc)
    step: int = 0  # at "step": the inner step within the round; fires before that step runs
    chunk: int = 0  # at "push" / "pull": fires once this many chunks have passed
    rank: int = 0  # the site's rank that fires it
    target: str = "site"  # kill only: the site itself, or the coordinator
    seconds: float = 0.0  # partition and delay: how long
    delay_ms: float = 0.0  # delay: extra one-way latency
    factor: float = 1.0  # slow: how many times slower every inner step becomes; poison sign_flip: Δ x -factor
    mode: str = ""  # poison: sign_flip, noise or constant
    norm: float = 0.0  # poison noise: the noise's L2 norm over a fragment
    value: float = 0.0  # poison constant: every element's value

    def __post_init__(self) -> None:
        def require(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise FaultPlanError(f"{name}: {message}")

        require(self.action in ACTIONS, "action", f"unknown {self.action!r}; accepted: {', '.join(ACTIONS)}")
        require(self.at in POINTS, "at", f"unknown {self.at!r}; accepted: {', '.join(POINTS)}")
        require(bool(self.site) or self.at == "commit", "site", "must name a site")
        for name in ("round", "step", "chunk", "rank"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 0, name, f"must be an integer >= 0, got {value!r}")
        require(self.target in TARGETS, "target", f"unknown {self.target!r}; accepted: {', '.join(TARGETS)}")
        require(
            self.target == "site" or self.action in ("kill", "raise"),
            "target",
            "only a kill or a raise may target the coordinator",
        )
        if self.at == "commit":  # fired by the coordinator, to itself
            require(self.action in ("kill", "raise"), "action", "at commit: only kill or raise")
            require(self.target == "coordinator", "target", 'at commit: must be "coordinator"')
        require(self.action != "raise" or self.at == "commit", "at", 'a raise fires only at "commit"')
        if self.action in ("partition", "delay"):
            require(self.seconds > 0, "seconds", f"a {self.action} needs a duration > 0, got {self.seconds}")
        if self.action == "delay":
            require(self.delay_ms > 0, "delay_ms", f"must be > 0, got {self.delay_ms}")
        if self.action == "slow":
            require(self.at == "step", "at", 'a slow takes effect at a "step"')
            require(
                isinstance(self.factor, (int, float)) and 1 < self.factor <= MAX_SLOWDOWN,
                "factor",
                f"a slow needs a factor in (1, {MAX_SLOWDOWN}], got {self.factor!r}",
            )
        elif self.action == "poison":
            self._check_poison(require)
        else:
            require(self.factor == 1.0, "factor", f"only a slow takes a factor, not a {self.action}")
        if self.action != "poison":
            require(not self.mode, "mode", f"only a poison takes a mode, not a {self.action}")
            for name in ("norm", "value"):
                require(
                    getattr(self, name) == 0.0, name, f"only a poison takes a {name}, not a {self.action}"
                )

    def _check_poison(self, require: Callable[[bool, str, str], None]) -> None:
        require(self.at == "push", "at", 'a poison acts on the pushes: place it at "push"')
        require(self.chunk == 0, "chunk", "a poison acts on whole pushes: chunk must be 0")
        modes = ", ".join(POISON_MODES)
        require(self.mode in POISON_MODES, "mode", f"unknown {self.mode!r}; accepted: {modes}")
        numeric = isinstance(self.factor, (int, float)) and math.isfinite(self.factor)
        if self.mode == "sign_flip":
            require(
                numeric and self.factor > 0, "factor", f"a sign_flip needs a factor > 0, got {self.factor!r}"
            )
        else:
            require(self.factor == 1.0, "factor", f"only a sign_flip poison takes a factor, not {self.mode}")
        finite_norm = isinstance(self.norm, (int, float)) and math.isfinite(self.norm)
        if self.mode == "noise":
            require(
                finite_norm and self.norm > 0, "norm", f"a noise poison needs a norm > 0, got {self.norm!r}"
            )
        else:
            require(self.norm == 0.0, "norm", f"only a noise poison takes a norm, not {self.mode}")
        finite_value = isinstance(self.value, (int, float)) and math.isfinite(self.value)
        if self.mode == "constant":
            require(
                finite_value and self.value != 0,
                "value",
                f"a constant poison needs a finite value != 0, got {self.value!r}",
            )
        else:
            require(self.value == 0.0, "value", f"only a constant poison takes a value, not {self.mode}")

    def poison(self, values: torch.Tensor, numel: int, seed: int) -> None:
        """Replace ``values`` (a rank's part of a fragment of ``numel`` elements) in place by this
        poison's hostile pseudo-gradient; ``seed`` draws the noise."""
        if self.mode == "sign_flip":
            values.mul_(-self.factor)
        elif self.mode == "constant":
            values.fill_(self.value)
        else:
            noise = torch.randn(values.shape, generator=torch.Generator().manual_seed(seed))
            values.copy_(noise.mul_(self.norm / math.sqrt(max(numel, 1))))

    @property
    def position(self) -> tuple[int, int]:
        """(round, step) at "step"; (round, chunk) at "push" and "pull"; (round, 0) at commit."""
        return (self.round, self.chunk if self.at in ("push", "pull") else self.step)

    def command(self) -> str:
        """The WAN proxy's control command for a link fault."""
        if self.action == "partition":
            return f"partition {self.seconds}"
        if self.action == "delay":
            return f"delay {self.delay_ms} {self.seconds}"
        return "drop"


@dataclass(kw_only=True, slots=True)
class FaultPlan:
    """Faults in the order given; ``links``: each site's WAN proxy control address."""

    faults: list[Fault] = field(default_factory=list)
    links: dict[str, str] = field(default_factory=dict)
    coordinator_pid: int = 0

    def __post_init__(self) -> None:
        for i, fault in enumerate(self.faults):
            if fault.action in LINK_ACTIONS and fault.site not in self.links:
                raise FaultPlanError(f"faults[{i}].site: a {fault.action} needs links[{fault.site!r}]")
            if fault.target == "coordinator" and fault.at != "commit" and self.coordinator_pid <= 0:
                raise FaultPlanError(f"faults[{i}].target: killing the coordinator needs coordinator_pid")

    @classmethod
    def from_dict(cls, data: Any) -> FaultPlan:
        if not isinstance(data, dict):
            raise FaultPlanError(f"plan: expected an object, got {data!r}")
        unknown = sorted(set(data) - {"faults", "links", "coordinator_pid"})
        if unknown:
            raise FaultPlanError(f"{unknown[0]}: unknown field; accepted: coordinator_pid, faults, links")
        faults = []
        for i, item in enumerate(data.get("faults", [])):
            try:
                faults.append(Fault(**item))
            except FaultPlanError as exc:
                raise FaultPlanError(f"faults[{i}].{exc}") from None
            except TypeError as exc:  # not an object, or an unknown or missing key
                raise FaultPlanError(f"faults[{i}]: {exc}") from None
        return cls(
            faults=faults, links=dict(data.get("links", {})), coordinator_pid=data.get("coordinator_pid", 0)
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def write(self, path: Path) -> None:
        path.write_text(self.to_json())


def load_plan(path: Path) -> FaultPlan:
    try:
        text = path.read_text()
    except OSError as exc:
        raise FaultPlanError(f"{FAULT_PLAN_ENV}={path}: {exc.strerror}") from None
    try:
        return FaultPlan.from_dict(json.loads(text))
    except json.JSONDecodeError as exc:
        raise FaultPlanError(f"{FAULT_PLAN_ENV}={path}: {exc}") from None


def fired_dir(plan_path: Path) -> Path:
    return plan_path.with_name(plan_path.name + ".fired")


def fired(plan_path: Path) -> dict[int, dict[str, Any]]:
    """What fired so far: plan index -> the record written when it fired."""
    records = {}
    for path in sorted(fired_dir(plan_path).glob("*.json")):
        records[int(path.stem)] = json.loads(path.read_text())
    return records


class FaultInjector:
    """The faults of one plan that one rank of one site fires (``site`` None: the coordinator's,
    those placed at commit)."""

    def __init__(self, plan_path: Path, site: str | None, rank: int = 0) -> None:
        self.path = plan_path
        self.plan = load_plan(plan_path)
        self.records = fired_dir(plan_path)
        self.records.mkdir(exist_ok=True)
        self.site, self.rank = site, rank
        faults = enumerate(self.plan.faults)
        states = ("slow", "poison")
        self.pending = [(i, f) for i, f in faults if f.action not in states and self._fires(f, site, rank)]
        # a slow or a poison is a state of the whole site: every rank keeps to it, the named rank records it
        self.slows = [(i, f) for i, f in enumerate(self.plan.faults) if f.action == "slow" and f.site == site]
        self.poisons = [
            (i, f) for i, f in enumerate(self.plan.faults) if f.action == "poison" and f.site == site
        ]
        self.sleep = time.sleep  # tests: what a slowed step waits with

    @staticmethod
    def _fires(fault: Fault, site: str | None, rank: int) -> bool:
        if site is None:
            return fault.at == "commit"
        return fault.at != "commit" and (fault.site, fault.rank) == (site, rank)

    def reached(self, round_: int, step: int, at: str = "step") -> None:
        """Fire the faults placed at or before this point (of the same kind) not fired yet;
        ``step`` is the inner step, or at "push" / "pull" the chunks passed so far."""
        due = [(i, f) for i, f in self.pending if f.at == at and f.position <= (round_, step)]
        for i, fault in due:
            self.pending.remove((i, fault))
            if self._claim(i, fault, round_, step):
                log.warning(
                    "fault plan: %s %s at round %d %s %d", fault.action, fault.target, round_, at, step
                )
                self._fire(fault)

    def slowdown(self, round_: int, step: int) -> float:
        """How many times slower this site computes at inner step ``step`` of ``round_``: the
        factor of the latest-placed slow in effect there, else 1."""
        effective = [(f.position, i, f) for i, f in self.slows if f.position <= (round_, step)]
        if not effective:
            return 1.0
        _, index, fault = max(effective)
        if fault.rank == self.rank and self._claim(index, fault, round_, step):
            log.warning("fault plan: slow x%g from round %d step %d", fault.factor, round_, step)
        return fault.factor

    def poisoning(self, round_: int) -> Fault | None:
        """The latest-placed poison in effect at ``round_``'s push, or None."""
        effective = [(f.round, i, f) for i, f in self.poisons if f.round <= round_]
        if not effective:
            return None
        _, index, fault = max(effective)
        if fault.rank == self.rank and self._claim(index, fault, round_, 0):
            log.warning("fault plan: poison (%s) from round %d", fault.mode, round_)
        return fault

    def stretch(self, round_: int, step: int, elapsed_s: float) -> float:
        """After inner step ``step`` of ``round_`` took ``elapsed_s``: wait out the rest of a slow
        step (``factor - 1`` times as long again); returns the seconds waited."""
        extra = (self.slowdown(round_, step) - 1.0) * max(elapsed_s, 0.0)
        if extra > 0:
            self.sleep(extra)
        return extra

    def _claim(self, index: int, fault: Fault, round_: int, step: int) -> bool:
        """Claim the fault for this run of the plan; False when it fired before (a restart)."""
        try:
            fd = os.open(self.records / f"{index}.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        record = {
            "fault": asdict(fault),
            "round": round_,
            "step": step,
            "pid": os.getpid(),
            "time": time.time(),
        }
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(record))
            out.flush()
            os.fsync(out.fileno())  # the claim must outlive the kill that follows
        return True

    def _fire(self, fault: Fault) -> None:
        if fault.action == "raise":
            raise InjectedCrash(f"fault plan: raise at commit of round {fault.round}")
        if fault.action == "kill":
            if fault.at == "commit":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault.target == "coordinator":  # its current pid: a supervisor rewrites the plan
                os.kill(load_plan(self.path).coordinator_pid, signal.SIGKILL)
                return
            if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: it goes, and its ranks with it
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        host, _, port = self.plan.links[fault.site].rpartition(":")
        with socket.create_connection((host, int(port)), timeout=CONTROL_TIMEOUT_S) as conn:
            conn.sendall((fault.command() + "\n").encode())
            answer = conn.makefile().readline().strip()
        if answer != "ok":
            raise FaultPlanError(f"the WAN proxy refused {fault.command()!r}: {answer}")


@functools.cache
def _injector(path: str, site: str | None, rank: int) -> FaultInjector:
    return FaultInjector(Path(path), site, rank)


def at(site: str, rank: int, round_: int, step: int, point: str = "step") -> None:
    """A site's hook (training loop: "step"; outer-sync client: "push", "pull" with ``step``
    the chunks passed): fire this rank's faults placed here; without a plan, nothing."""
    path = os.environ.get(FAULT_PLAN_ENV)
    if path:
        _injector(path, site, rank).reached(round_, step, point)


def stretch(site: str, rank: int, round_: int, step: int, elapsed_s: float) -> None:
    """A site's hook after inner step ``step`` of ``round_`` took ``elapsed_s``: a plan's
    ``slow`` in effect there makes the step last ``factor`` times as long; without a plan, nothing."""
    path = os.environ.get(FAULT_PLAN_ENV)
    if path:
        _injector(path, site, rank).stretch(round_, step, elapsed_s)


def poison(site: str, rank: int, round_: int, fragment: int, values: torch.Tensor, numel: int) -> None:
    """A site's hook on what a rank pushes for ``fragment`` in ``round_`` (``values``, its part
    of the fragment's ``numel`` elements, after error feedback): a plan's poison in effect there
    replaces it in place; without a plan, nothing."""
    path = os.environ.get(FAULT_PLAN_ENV)
    if not path:
        return
    fault = _injector(path, site, rank).poisoning(round_)
    if fault is not None:
        fault.poison(values, numel, seed=(round_ * 1_000_003 + fragment) * 65_537 + rank)


def at_commit(round_: int) -> None:
    """The coordinator's hook while it commits ``round_``; without a plan, nothing."""
    path = os.environ.get(FAULT_PLAN_ENV)
    if path:
        _injector(path, None, 0).reached(round_, 0, "commit")
