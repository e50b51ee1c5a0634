"""Per-fragment rounds on the coordinator's side: one round controller per fragment.

Each fragment of the canonical vector (the plan of :mod:`geodiloco.fragment_plan`) is its own
DiLoCo run: its own θ (the fragment's vector), rounds, deadline, outer-optimizer momentum,
downlink error feedback, committed updates and hash chain; a late push of one fragment is
dropped and counted by that fragment alone. Chunks and hashes speak fragment-local positions.

The data ledger is settled by the last fragment, the *primary* one, merged at the end of every
round (step H), so a site's windows are consumed exactly once per round of H steps: the other
fragments' controllers keep ledgers of their own that no site reads, and their pushes carry no
data (the primary's contributors are the ones whose data counts). Membership is the run's:
joins, heartbeats, leaves and streams in flight reach every fragment alike.

Durable state: with ``outer.fragments`` 1 the run directory is exactly that of one round
controller. With P > 1 fragment p keeps its snapshot, update log, round log (hash chain) and
reports in ``RUN_DIR/fragment-p/``, and the plan is kept in ``RUN_DIR/fragments.json``,
written last on the first start: a run directory with it resumes every fragment, without
building the model.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from geodiloco.config import RunConfig
from geodiloco.coordinator.refusals import CorruptStateError, InvalidArgument
from geodiloco.coordinator.rounds import RoundController, SiteRecord
from geodiloco.coordinator.rundir import PLAN_FILE, check_run_config
from geodiloco.fragment_plan import FragmentPlan
from geodiloco.params import flatten_parameters
from geodiloco.security.sealing import Sealer
from geodiloco.workload.data import DataRange

log = logging.getLogger("geodiloco.coordinator")


def fragment_dir(run_dir: Path, fragment: int) -> Path:
    """Where fragment ``fragment`` of a run of P > 1 fragments keeps its durable state."""
    return run_dir / f"fragment-{fragment}"


def resumes(run_dir: Path | None) -> bool:
    """Whether ``run_dir`` holds a fragmented run to resume."""
    return run_dir is not None and (run_dir / PLAN_FILE).exists()


def read_plan(run_dir: Path) -> FragmentPlan:
    path = run_dir / PLAN_FILE
    try:
        return FragmentPlan.from_json(path.read_text())
    except ValueError as exc:
        raise CorruptStateError(f"{path}: {exc}") from None


def _write_plan(run_dir: Path, plan: FragmentPlan) -> None:
    """Atomically: the plan, whole, or the previous state of the directory (no plan)."""
    path = run_dir / PLAN_FILE
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(plan.to_json() + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FragmentedController:
    """The round controllers of a run's fragments."""

    def __init__(
        self,
        cfg: RunConfig,
        plan: FragmentPlan,
        fragments: list[RoundController],
        run_dir: Path | None = None,
    ) -> None:
        if len(fragments) != plan.count:
            raise ValueError(f"the plan has {plan.count} fragments, {len(fragments)} controllers")
        self.cfg = cfg
        self.plan = plan
        self.fragments = fragments
        self.run_dir = run_dir  # the run's; each fragment's own is its controller's
        self.num_params = sum(plan.sizes)

    @classmethod
    def create(
        cls,
        cfg: RunConfig,
        initial: torch.Tensor,
        shard_sizes: list[int],
        plan: FragmentPlan,
        run_dir: Path | None = None,
        sealer: Sealer | None = None,
    ) -> FragmentedController:
        """A run starting from θ_0 = ``initial``; with ``run_dir``, durable there (a fragment whose
        snapshot is already there, from a first start cut short, resumes from it)."""
        if plan.count != cfg.outer.fragments:
            raise ValueError(f"the plan has {plan.count} fragments, outer.fragments is {cfg.outer.fragments}")
        flat = initial.detach().to(torch.float32).reshape(-1)
        if flat.numel() != sum(plan.sizes):
            raise ValueError(f"the plan covers {sum(plan.sizes)} parameters, θ_0 has {flat.numel()}")
        if run_dir is not None and plan.count > 1:
            run_dir.mkdir(parents=True, exist_ok=True)
            check_run_config(run_dir, cfg)
        controllers = [
            RoundController(cfg, plan.gather(p, flat), shard_sizes, cls._dir(run_dir, plan.count, p), sealer)
            for p in range(plan.count)
        ]
        return cls(cfg, plan, controllers, run_dir)

    @classmethod
    def resume(
        cls, cfg: RunConfig, shard_sizes: list[int] | None, run_dir: Path, sealer: Sealer | None = None
    ) -> FragmentedController:
        """The run kept in ``run_dir`` (see :func:`resumes`), every fragment from its own state."""
        check_run_config(run_dir, cfg)
        plan = read_plan(run_dir)
        if plan.count != cfg.outer.fragments:
            raise CorruptStateError(
                f"outer.fragments: {plan.count} when the run in {run_dir} started, {cfg.outer.fragments} "
                "now; a resumed run keeps its fragments: restore outer.fragments"
            )
        controllers = [
            RoundController(cfg, None, shard_sizes, fragment_dir(run_dir, p), sealer)
            for p in range(plan.count)
        ]
        return cls(cfg, plan, controllers, run_dir)

    @classmethod
    def single(cls, controller: RoundController) -> FragmentedController:
        """A run of one fragment: ``controller`` itself, its run directory as it is (also what a
        server given one controller keeps, whatever its config says: Join then answers one)."""
        n = controller.num_params
        return cls(controller.cfg, FragmentPlan(((0,),), (n,)), [controller], controller.run_dir)

    @staticmethod
    def _dir(run_dir: Path | None, count: int, p: int) -> Path | None:
        if run_dir is None or count == 1:
            return run_dir  # one fragment: today's layout, exactly
        return fragment_dir(run_dir, p)

    async def persist_start(self) -> None:
        """First start: every fragment's θ_0 on disk, then the plan (which marks the run as one to
        resume), so a restart reads them instead of rebuilding the model."""
        for c in self.fragments:
            await c.checkpoint()
        if self.run_dir is not None and self.count > 1:
            _write_plan(self.run_dir, self.plan)

    @property
    def count(self) -> int:
        return len(self.fragments)

    @property
    def primary(self) -> RoundController:
        """The fragment whose rounds settle the data ledger (merged at the end of each round)."""
        return self.fragments[-1]

    def fragment(self, index: int) -> RoundController:
        """Fragment ``index`` of a request: an untrusted count, checked before anything is read."""
        if not 0 <= index < self.count:
            raise InvalidArgument(
                f"fragment {index} does not exist; this run has {self.count} (0-{self.count - 1})"
            )
        return self.fragments[index]

    def settles_data(self, index: int) -> bool:
        return index == self.count - 1

    @property
    def round(self) -> int:
        return self.primary.round

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.fragments)

    @property
    def sites(self) -> dict[str, SiteRecord]:
        return self.primary.sites

    def theta(self) -> torch.Tensor:
        """The global parameters, assembled from the fragments in canonical order."""
        flat = torch.empty(self.num_params, dtype=torch.float32)
        for p, c in enumerate(self.fragments):
            self.plan.scatter(p, c.theta, flat)
        return flat

    async def join(self, name: str, run_id: str, world_size: int) -> SiteRecord:
        """Admit a site to every fragment's rounds; the primary fragment's record is the site's."""
        for c in self.fragments:
            record = await c.join(name, run_id, world_size)
        return record

    def member(self, name: str, run_id: str) -> SiteRecord:
        """A heartbeat: the site's lease renewed in every fragment (refused unless joined)."""
        for c in self.fragments:
            record = c.member(name, run_id)
        return record

    @contextlib.contextmanager
    def transferring(self, name: str) -> Iterator[None]:
        """A stream of ``name`` in flight keeps its lease in every fragment, not only its own."""
        with contextlib.ExitStack() as stack:
            for c in self.fragments:
                stack.enter_context(c.transferring(name))
            yield

    def data_for(self, name: str) -> list[DataRange]:
        return self.primary.data_for(name)

    async def leave(self, name: str, run_id: str, reason: str) -> None:
        for c in self.fragments:
            await c.leave(name, run_id, reason)

    async def tick(self) -> None:
        for c in self.fragments:
            await c.tick()

    async def settle(self) -> None:
        for c in self.fragments:
            await c.settle()

    async def checkpoint(self) -> None:
        for c in self.fragments:
            await c.checkpoint()

    def all_sites_done(self) -> bool:
        return all(c.all_sites_done() for c in self.fragments)

    def late(self, name: str) -> int:
        """The site's pushes dropped as late, over every fragment."""
        return sum(c.sites[name].late for c in self.fragments if name in c.sites)


async def open_fragments(
    cfg: RunConfig,
    run_dir: Path | None,
    sealer: Sealer | None,
    shard_sizes: Callable[[], list[int]],
    build_model: Callable[[], nn.Module],
) -> FragmentedController:
    """The fragments of a run of P > 1: resumed from ``run_dir``, or started from the model
    ``build_model`` makes (θ_0 and the plan), made durable before any site is served."""
    if resumes(run_dir):
        assert run_dir is not None
        run = FragmentedController.resume(cfg, None, run_dir, sealer)  # the ledger is the snapshot's
    else:
        model = build_model()
        plan = FragmentPlan.of_model(model, cfg.outer.fragments)
        initial = flatten_parameters(model)
        run = FragmentedController.create(cfg, initial, shard_sizes(), plan, run_dir, sealer)
        await run.persist_start()
    log.info(
        "streaming: %d fragments of %s parameters, at rounds %s",
        run.count,
        "/".join(str(run.plan.numel(p)) for p in range(run.count)),
        "/".join(str(c.round) for c in run.fragments),
    )
    return run
