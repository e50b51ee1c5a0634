"""The grace window: how long a round waits, after its first contribution, for the others.

A fixed ``round_timeout_s`` is a guess about links and models nobody has measured yet. With
``grace.adaptive`` the window follows the arrivals of the last ``grace.rounds`` rounds instead:
each contribution's lag behind its round's first one (late ones too: that is how the window
learns it was too short), the ``grace.quantile`` of those lags, times ``1 + grace.margin``, plus
``grace.floor_s``, never past ``round_timeout_s``. Sites that keep arriving together shrink it;
a site that falls behind and arrives late widens it for the rounds after. Plain values: the
round controller feeds it arrival times and reads the window.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from geodiloco.config import GraceConfig


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
    rounds: deque[list[float]] = field(init=False)  # lags after the first arrival, per round
    pending: list[float] = field(default_factory=list)  # late lags, counted with the next round
    waited_for: list[Arrival] = field(default_factory=list)  # the last round's, after its quorum

    def __post_init__(self) -> None:
        self.rounds = deque(maxlen=self.cfg.rounds)

    @property
    def window_s(self) -> float:
        """The current round's grace window, in seconds after its first contribution."""
        lags = [lag for lags in self.rounds for lag in lags]
        if not self.cfg.adaptive or not self.rounds:
            return self.timeout_s
        measured = quantile(lags, self.cfg.quantile) if lags else 0.0
        return min(self.timeout_s, measured * (1 + self.cfg.margin) + self.cfg.floor_s)

    def late(self, after_s: float) -> None:
        """A push that came ``after_s`` after its round's first one, once the round had closed."""
        self.pending.append(after_s)

    def closed(self, arrivals: list[Arrival], quorum: int) -> None:
        """A round committed with these arrivals (in order): measure them, and remember which
        contributions the round stayed open for after it had its quorum."""
        lags = [a.after_s for a in arrivals[1:]] + self.pending
        self.pending = []
        self.rounds.append(lags)
        self.waited_for = list(arrivals[quorum:])
