"""Per-fragment rounds on the coordinator's side: one round controller per fragment.

Each fragment of the canonical vector (the plan of :mod:`geodiloco.site.fragments`) is its own
DiLoCo run: its own θ (the fragment's vector), rounds, deadline, outer-optimizer momentum,
downlink error feedback, committed updates and hash chain; a late push of one fragment is
dropped and counted by that fragment alone. Chunks and hashes speak fragment-local positions.

The data ledger is settled by the last fragment, the one merged at the end of every round
(step H), so a site's windows are consumed exactly once per round of H steps: the other
fragments' controllers keep ledgers of their own that no site reads (this in-process form
only; the gRPC coordinator will keep one ledger beside its fragments).
"""

from __future__ import annotations

import torch

from geodiloco.config import RunConfig
from geodiloco.coordinator.rounds import RoundController, SiteRecord
from geodiloco.site.fragments import FragmentPlan
from geodiloco.workload.data import DataRange


class FragmentedController:
    """The round controllers of a run's fragments."""

    def __init__(
        self, cfg: RunConfig, initial: torch.Tensor, shard_sizes: list[int], plan: FragmentPlan
    ) -> None:
        if plan.count != cfg.outer.fragments:
            raise ValueError(f"the plan has {plan.count} fragments, outer.fragments is {cfg.outer.fragments}")
        self.cfg = cfg
        self.plan = plan
        self.num_params = initial.numel()
        flat = initial.detach().to(torch.float32).reshape(-1)
        self.fragments = [RoundController(cfg, plan.gather(p, flat), shard_sizes) for p in range(plan.count)]

    @property
    def ledger(self) -> RoundController:
        """The fragment whose rounds settle the data ledger (merged at the end of each round)."""
        return self.fragments[-1]

    @property
    def round(self) -> int:
        return self.ledger.round

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.fragments)

    def theta(self) -> torch.Tensor:
        """The global parameters, assembled from the fragments in canonical order."""
        flat = torch.empty(self.num_params, dtype=torch.float32)
        for p, c in enumerate(self.fragments):
            self.plan.scatter(p, c.theta, flat)
        return flat

    async def join(self, name: str, run_id: str, world_size: int) -> SiteRecord:
        """Admit a site to every fragment's rounds; the ledger fragment's record is the site's."""
        for c in self.fragments:
            record = await c.join(name, run_id, world_size)
        return record

    def heartbeat(self, name: str, run_id: str) -> None:
        for c in self.fragments:
            c.member(name, run_id)

    def data_for(self, name: str) -> list[DataRange]:
        return self.ledger.data_for(name)

    async def leave(self, name: str, run_id: str, reason: str) -> None:
        for c in self.fragments:
            await c.leave(name, run_id, reason)

    async def tick(self) -> None:
        for c in self.fragments:
            await c.tick()
