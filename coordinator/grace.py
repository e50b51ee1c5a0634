"""The grace window: how long a round waits, after its first contribution, for the others.

A fixed ``round_timeout_s`` is a guess about links and models nobody has measured yet. With
``grace.adaptive`` the window follows the arrivals of the last ``grace.rounds`` rounds instead:
each contribution's lag behind its round's first one (late ones too: that is how the window
learns it was too short), the ``grace.quantile`` of those lags, times ``1 + grace.margin``, plus
``grace.floor_s``, never past ``round_timeout_s``. Sites that keep arriving together shrink it;
a site that falls behind and arrives late widens it for the rounds after.

Waiting is worth it only while it is short against the round: a site whose lag is beyond the
*bound* (``grace.max_share`` of the sites' training time, from a round's opening to its first
contribution, the median of recent rounds; at least ``grace.floor_s``; by default 0.5 in
rounds by time and none in step rounds, where a slower site is late by design and waiting for
it keeps its whole contribution in its round) would make every other site idle that long per
round. Its lag does not widen the window, the window never exceeds the
bound, and once its pushes came beyond it in two rounds in a row, the round is not held open
for that site at all until a push of it comes within the bound again: it closes on the others
(at least the quorum), and the straggler's push is merged late (``outer.max_staleness``).
Plain values: the round controller feeds it arrival times and asks for the window and for
whom not to wait.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass, field

from geodiloco.config import GraceConfig

# rounds in a row with a push beyond the bound that make a site a straggler: one is a hiccup (a
# restart, a partition), which the window's quantile is for; a slow link is late every round
STRAGGLER_AFTER = 2


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear between order statistics, as numpy's default)."""
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = math.floor(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)


@dataclass(frozen=True, slots=True)
class Arrival:
    """A contribution's lag behind the first of its round (0 for the first)."""

    site: str
    after_s: float


@dataclass(slots=True)
class GraceWindow:
    """Recent rounds' arrivals and the window they give."""

    cfg: GraceConfig
    timeout_s: float  # round_timeout_s: the bound, and the window until arrivals are measured
    by_time: bool = False  # inner.round_seconds > 0: grace.max_share's default is on
    rounds: deque[list[float]] = field(init=False)  # lags after the first arrival, per round
    trained: deque[float] = field(init=False)  # per round, from its opening to its first arrival
    pending: list[Arrival] = field(default_factory=list)  # late lags, counted with the next round
    waited_for: list[Arrival] = field(default_factory=list)  # the last round's, after its quorum
    beyond: dict[str, int] = field(default_factory=dict)  # rounds in a row beyond the bound, per site
    judged: set[str] = field(default_factory=set)  # sites found beyond it in the open round
    missed: set[str] = field(default_factory=set)  # waited for past the bound by the last round
    stragglers: set[str] = field(default_factory=set)  # not waited for

    def __post_init__(self) -> None:
        self.rounds = deque(maxlen=self.cfg.rounds)
        self.trained = deque(maxlen=self.cfg.rounds)

    @property
    def bounded(self) -> bool:
        """Whether the bound applies: on, and the sites' training time measured."""
        return self.cfg.adaptive and self.cfg.share(self.by_time) > 0 and bool(self.trained)

    @property
    def bound_s(self) -> float:
        """The longest wait worth the others' time (``timeout_s`` until training is measured)."""
        if not self.bounded:
            return self.timeout_s
        share = self.cfg.share(self.by_time) * quantile(list(self.trained), 0.5)
        return min(self.timeout_s, max(self.cfg.floor_s, share))

    @property
    def window_s(self) -> float:
        """The current round's grace window, in seconds after its first contribution."""
        lags = [lag for lags in self.rounds for lag in lags]
        if not self.cfg.adaptive or not self.rounds:
            return self.timeout_s
        measured = quantile(lags, self.cfg.quantile) if lags else 0.0
        return min(self.bound_s, measured * (1 + self.cfg.margin) + self.cfg.floor_s)

    def late(self, site: str, after_s: float) -> None:
        """``site``'s push came ``after_s`` after its round's first one, once the round had closed:
        judged at once, so that the open round holds on for it again, or no longer does."""
        self.pending.append(Arrival(site, after_s))
        bound = self._bound()
        if after_s > bound and site in self.missed:  # its round counted it already
            self.missed.discard(site)
            return
        self._judge(site, after_s, bound)

    def closed(
        self,
        arrivals: list[Arrival],
        quorum: int,
        trained_s: float | None = None,
        missing: Collection[str] = (),
        open_s: float = 0.0,
    ) -> None:
        """A round committed with these arrivals (in order): measure them, and remember which
        contributions the round stayed open for after it had its quorum. ``trained_s``: from
        the round's opening to its first arrival (None: not a measure of training, e.g. the
        run's first round, which includes the start-up). ``missing``: the sites it waited for
        that did not come in the ``open_s`` it stayed open after its first arrival (past the
        bound: beyond it, as a site whose push never comes, e.g. over a link too slow for it)."""
        if trained_s is not None:
            self.trained.append(max(trained_s, 0.0))
        bound = self._bound()
        for a in arrivals:  # beyond the bound only where the round waited for its quorum
            self._judge(a.site, a.after_s, bound)
        self.missed = {site for site in missing if open_s > bound}  # else it may yet come within
        for site in self.missed:
            self._judge(site, open_s, bound)
        lags = [a.after_s for a in arrivals[1:] + self.pending]
        self.pending, self.judged = [], set()
        self.rounds.append([lag for lag in lags if lag <= bound])
        self.waited_for = list(arrivals[quorum:])

    def _bound(self) -> float:
        return self.bound_s if self.bounded else math.inf

    def _judge(self, site: str, after_s: float, bound: float) -> None:
        """Within the bound, ``site`` is waited for; beyond it, in a second round in a row (pushes
        of one round count once), no longer."""
        if after_s <= bound:
            self.beyond.pop(site, None)
            self.stragglers.discard(site)
        elif site not in self.judged:
            self.judged.add(site)
            self.beyond[site] = self.beyond.get(site, 0) + 1
            if self.beyond[site] >= STRAGGLER_AFTER:
                self.stragglers.add(site)

    def restore(self, lags: list[float], trained_s: float | None) -> None:
        """A round's measures as its record kept them (a restarted coordinator)."""
        self.rounds.append(lags)
        if trained_s is not None:
            self.trained.append(trained_s)
