"""A streaming site whose membership lapsed while its round was still open (a coordinator that
restarted before the site's push reached it) pushes that fragment round again after rejoining,
rather than taking the fragment's state: with every site waited for, taking the state would
leave the round without it while it waits on its other fragments (a wait cycle)."""

from __future__ import annotations

from typing import Any

import torch

from geodiloco.exchange import PushPart
from geodiloco.site.link import Resync
from geodiloco.testing.configs import streaming_config
from geodiloco.testing.local_link import LocalCoordinator
from geodiloco.testing.local_runs import coordinator_for, global_snapshot, run_sites


class ForgetsTheSite:
    """A link whose push of one fragment round finds the site forgotten by the coordinator (as
    after a restart): every fragment drops its membership, and the push is refused."""

    def __init__(self, coordinator: LocalCoordinator, link: Any, fragment: int, round_: int) -> None:
        self.coordinator, self.link, self.at, self.fired = coordinator, link, (fragment, round_), 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.link, name)

    def push(self, part: PushPart, *, timeout_s: float) -> None:
        if (part.fragment, part.round) == self.at and not self.fired:
            self.fired += 1

            async def forget() -> None:
                for c in self.coordinator.controller.fragments:
                    c.sites[self.link.site].state = "absent"

            self.coordinator.call(forget())
            raise Resync("FAILED_PRECONDITION site has not joined (state: absent); call Join")
        self.link.push(part, timeout_s=timeout_s)


def test_a_forgotten_site_pushes_its_open_fragment_round_again() -> None:
    cfg = streaming_config(
        fragments=2, overlap=1, min_sites=2, round_timeout_s=600.0
    )  # every round waits for both
    with coordinator_for(cfg) as coordinator:
        forgetful = ForgetsTheSite(coordinator, coordinator.link("site-b"), 0, 1)
        real_link = coordinator.link
        coordinator.link = lambda name: forgetful if name == "site-b" else real_link(name)  # type: ignore[method-assign]
        out = run_sites(coordinator)  # a wait cycle would never finish (asserted there)
        assert forgetful.fired == 1
        for c in coordinator.controller.fragments:
            assert all(h.contributors == ["site-a", "site-b"] and h.hashes_agree for h in c.history)
        theta = coordinator.controller.theta()
        assert all(torch.equal(global_snapshot(site["sync"]), theta) for site in out.values())
