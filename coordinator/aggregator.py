"""Token-weighted averaging of the sites' pseudo-gradients for one round.

A contribution is folded into the round's sum only once it is whole and checked, so a broken
push never touches the mean. The sum is one fp32 vector reused from round to round: the
coordinator's memory does not grow with the number of sites. A whole contribution covers every
element, so the round's first one writes the sum rather than adding to it: the vector is never
zeroed, and the round close divides it by :attr:`WeightedMean.divisor` span by span.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch


class Contribution(Protocol):
    """One site's whole, decoded-on-demand pseudo-gradient for a round."""

    @property
    def sumsq(self) -> float:
        """Σ Δ² over its elements (inf or NaN when a value is not finite)."""
        ...

    def fold_into(self, total: torch.Tensor, weight: float, first: bool) -> None:
        """total += weight · Δ, chunk by chunk; total = weight · Δ when ``first`` (the round's first
        contribution: ``total`` holds the last round's leftovers)."""
        ...


SQUARES_BLOCK = 1 << 20  # float64 scratch per piece: 8 MiB, whatever the model


def sum_of_squares(values: torch.Tensor) -> float:
    """Σ x²: finite for any finite fp32 values, inf or NaN exactly when one is not.

    An fp32 dot product first (60x faster than a float64 norm; its rounding is far below what
    the norm check needs); only when that is not finite, the exact float64 sum decides whether a
    value was not finite or the squares merely overflowed fp32."""
    flat = values.reshape(-1)
    if flat.dtype == torch.float32:
        fast = float(torch.dot(flat, flat)) if flat.numel() else 0.0
        if math.isfinite(fast):
            return fast
    return sum(
        float(torch.linalg.vector_norm(flat[a : a + SQUARES_BLOCK], dtype=torch.float64)) ** 2
        for a in range(0, flat.numel(), SQUARES_BLOCK)
    )


class TensorContribution:
    """A pseudo-gradient already decoded into one canonical vector (tests, tools)."""

    def __init__(self, delta: torch.Tensor) -> None:
        self.delta = delta
        self.sumsq = sum_of_squares(delta)

    def fold_into(self, total: torch.Tensor, weight: float, first: bool) -> None:
        if first:
            torch.mul(self.delta, weight, out=total)
        else:
            total.add_(self.delta, alpha=weight)


class WeightedMean:
    """Σ w_k Δ_k / Σ w_k, accumulated as contributions arrive (w_k = tokens trained on)."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self._total: torch.Tensor | None = None  # made at the first fold: a restart need not wait for it
        self.weight = 0
        self.contributors: list[str] = []
        self.tokens: dict[str, int] = {}

    @property
    def total(self) -> torch.Tensor:
        if self._total is None:
            self._total = torch.zeros(self.numel, dtype=torch.float32)
        return self._total

    def add(self, site: str, delta: torch.Tensor, tokens: int) -> None:
        self.fold(site, TensorContribution(delta), tokens)

    def fold(self, site: str, contribution: Contribution, tokens: int) -> None:
        if tokens <= 0:
            raise ValueError("a contribution needs a positive token count")
        contribution.fold_into(self.total, float(tokens), first=not self.contributors)
        self.weight += tokens
        self.contributors.append(site)
        self.tokens[site] = tokens

    def ready(self) -> None:
        """The round's contributions are all in (nothing to do: the sum is complete)."""

    def prepare(self, start: int, numel: int) -> None:
        """Nothing: the sum of ``[start, start + numel)`` is complete as folded."""

    def set_aside(self) -> dict[str, float]:
        """Nothing is dropped or scaled down by the mean."""
        return {}

    def mean(self) -> torch.Tensor:
        """The average, computed in place: the sum is gone afterwards (call :meth:`reset`)."""
        return self.mean_span(0, self.numel)

    def mean_span(self, start: int, numel: int) -> torch.Tensor:
        """The average over elements ``[start, start + numel)``, computed in place in the sum."""
        return self.total[start : start + numel].div_(self.divisor)

    @property
    def divisor(self) -> int:
        """What the sum is divided by to give the mean: the total weight (ValueError when none)."""
        if not self.weight:
            raise ValueError("no contributions to average")
        return self.weight

    def reset(self) -> None:
        """Empty for the next round, keeping the buffer (its next first fold overwrites it)."""
        self.weight = 0
        self.contributors = []
        self.tokens = {}
