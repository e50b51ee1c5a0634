"""Robust aggregation, per fragment: norm clipping, coordinate-wise trimmed mean and median,
and the mean of the contributions near the median (``filtered_mean``, the default).

The token-weighted mean (:class:`~geodiloco.coordinator.aggregator.WeightedMean`) folds each
contribution into one sum as it arrives. The robust rules need every contribution of the round
at once (a coordinate's median, the round's median norm), so :class:`HeldContributions` keeps
each one decoded, as fp32, in a memory-mapped unlinked file (4 bytes per parameter per
contribution on disk; the page cache, not the heap, holds them), and computes the rule at the
round's close span by span, in the commit's worker threads: a block of every contribution at a
time (contributions x ``BLOCK`` values), whatever the model. ``filtered_mean`` makes one pass
more, for each contribution's distance from the coordinate-wise median.

Why ``filtered_mean`` is the default (``benchmarks/robust.py``, docs/robustness.md): with one
poisoning site of four, a trimmed mean or median drops the poison at each coordinate but also
the honest value at the other end, so its result leans towards the poison (a sign flip cost
3% of the final loss there); and with nobody attacking it averages two of four values (0.4%).
Dropping whole contributions that are far from the median, and averaging the rest with their
weights, leaves the honest sites' exact mean under those attacks, and the plain mean when no
contribution stands out. One kept is within ``filter_multiple`` x the median distance of the
median, so what it can pull is bounded by the honest sites' own spread.

Weights are the ledger's (late merges' discounted for staleness). A trimmed or median rule drops
values by their rank, not their weight; what is kept is averaged with its weights. With fewer
contributions than a rule needs to outvote one site (``2 x trim + 1``; median and filtered mean
3), the round falls back to ``clip``, which bounds any one site's pull to ``clip_multiple`` x
the median norm but cannot tell which of two sites is wrong (with two sites and a multiple of 2
it never clips: twice the median of two norms is their sum).

Secure aggregation lets the coordinator see only the sum: of these rules only the mean works
with it, and clip when each site clips itself to a published bound before masking; trimmed mean,
median and filtered mean need every site's values and do not.
"""

from __future__ import annotations

import math
import mmap
import statistics
import tempfile
from pathlib import Path

import torch

from geodiloco.config import AggregationConfig
from geodiloco.coordinator.aggregator import Contribution, TensorContribution, WeightedMean
from geodiloco.coordinator.rounds_pool import WORKERS

BLOCK = 1 << 16  # values per contribution in one step of a rule (sort and gather scratch: ~1 MB each)
SAMPLED = 1 << 18  # coordinates at least on which filtered_mean measures distances (all of a smaller model)


def clip_scales(sumsqs: list[float], multiple: float) -> list[float]:
    """Each contribution's factor so that its norm is at most ``multiple`` x the median norm."""
    norms = [math.sqrt(s) for s in sumsqs]
    bound = multiple * statistics.median(norms) if norms else 0.0
    return [1.0 if n <= bound or n == 0.0 else bound / n for n in norms]


def effective_rule(rule: str, count: int, trim: int) -> str:
    """The rule a round of ``count`` contributions uses: ``clip`` where ``rule`` cannot outvote
    one site among them."""
    if rule == "trimmed_mean" and count < 2 * trim + 1:
        return "clip"
    if rule in ("median", "filtered_mean") and count < 3:
        return "clip"
    return rule


def kept_by_distance(squared: list[float], multiple: float) -> list[float]:
    """1 for each contribution kept, 0 for one dropped, from their squared distances to the
    coordinate-wise median: farther than ``multiple`` x the median distance, at most the
    farthest ``(count - 1) // 2`` of them (a majority stays)."""
    distances = [math.sqrt(d) for d in squared]
    bound = multiple * statistics.median(distances)
    outliers = sorted((i for i, d in enumerate(distances) if d > bound), key=lambda i: -distances[i])
    dropped = set(outliers[: (len(distances) - 1) // 2])
    return [0.0 if i in dropped else 1.0 for i in range(len(distances))]


def combine(
    values: torch.Tensor, weights: list[int], rule: str, trim: int = 1, scales: list[float] | None = None
) -> torch.Tensor:
    """One block of the rule: ``values`` is contributions x elements (fp32), ``weights`` their
    positive integer weights; returns the aggregate per element (fp32). ``scales`` (clip): each
    contribution's factor."""
    k = values.shape[0]
    w = torch.tensor(weights, dtype=torch.float64)
    if rule in ("mean", "clip", "filtered_mean"):
        factors = w / w.sum()
        if rule == "clip":
            factors = factors * torch.tensor(scales or [1.0] * k, dtype=torch.float64)
        if rule == "filtered_mean":  # scales: 1 kept, 0 dropped; the kept weigh as a whole
            kept = w * torch.tensor(scales or [1.0] * k, dtype=torch.float64)
            factors = kept / kept.sum()
        return (values * factors.to(torch.float32)[:, None]).sum(0)
    ordered, order = torch.sort(values, dim=0, stable=True)
    ranked = w[order]  # each sorted value's weight (exact: integers in float64)
    if rule == "trimmed_mean":
        kept, kept_w = ordered[trim : k - trim], ranked[trim : k - trim]
        return ((kept.double() * kept_w).sum(0) / kept_w.sum(0)).to(torch.float32)
    if rule == "median":
        cumulative = ranked.cumsum(0)
        half = float(w.sum()) / 2
        j = (cumulative < half).sum(0, keepdim=True)  # the first value whose cumulative weight reaches half
        low = ordered.gather(0, j)[0]
        on_edge = cumulative.gather(0, j)[0] == half  # exactly half below: the middle of two values
        high = ordered.gather(0, (j + 1).clamp(max=k - 1))[0]
        return torch.where(on_edge, (low + high) / 2, low)
    raise ValueError(f"unknown aggregation rule {rule!r}")


class HeldContributions:
    """A round's contributions, each kept whole until the close, then combined by a robust rule.

    The same face as :class:`WeightedMean` to the round controller: :meth:`fold` as they come,
    :meth:`ready` when the round closes, :meth:`prepare` per span in the commit's workers (it
    writes the rule's aggregate into :attr:`total`), :meth:`reset` after. Beside the held copies
    it folds the weighted sum as :class:`WeightedMean` does: where ``clip`` or ``filtered_mean``
    changes nothing in a round (no norm beyond the bound, no contribution dropped: an honest
    round), the round commits that sum, bit for bit what ``mean`` commits, with no pass more."""

    def __init__(self, numel: int, cfg: AggregationConfig, spill_dir: Path | None = None) -> None:
        self.numel = numel
        self.cfg = cfg
        self.spill_dir = spill_dir
        self._maps: list[mmap.mmap] = []  # one per contribution, reused from round to round
        self._buffers: list[torch.Tensor] = []  # their fp32 views
        self.sum = WeightedMean(numel)  # Σ w_k Δ_k, folded as they come
        self.sumsqs: list[float] = []
        self.weights: list[int] = []
        self.rule = cfg.rule  # this round's, once ready
        self.scales: list[float] | None = None
        self.passthrough = False  # the round commits the weighted sum (nothing clipped or dropped)

    @property
    def contributors(self) -> list[str]:
        return self.sum.contributors

    @property
    def tokens(self) -> dict[str, int]:
        return self.sum.tokens

    @property
    def weight(self) -> int:
        return self.sum.weight

    @property
    def total(self) -> torch.Tensor:
        return self.sum.total

    def _buffer(self, index: int) -> torch.Tensor:
        while len(self._buffers) <= index:
            with tempfile.TemporaryFile(dir=self.spill_dir) as spill:  # unlinked; the mapping stays
                spill.truncate(self.numel * 4)
                mapped = mmap.mmap(spill.fileno(), self.numel * 4)
            self._maps.append(mapped)
            self._buffers.append(torch.frombuffer(mapped, dtype=torch.float32))
        return self._buffers[index]

    def _release(self, index: int, start: int, numel: int) -> None:
        """Unmap a range of a held copy from this process once read or written: the page cache
        keeps it (and the disk, under pressure), so the coordinator's resident memory stays at
        contributions x span, not contributions x model."""
        first = start * 4 // mmap.PAGESIZE * mmap.PAGESIZE
        self._maps[index].madvise(mmap.MADV_DONTNEED, first, (start + numel) * 4 - first)

    def add(self, site: str, delta: torch.Tensor, tokens: int) -> None:
        self.fold(site, TensorContribution(delta), tokens)

    def fold(self, site: str, contribution: Contribution, tokens: int) -> None:
        """Keep ``contribution`` (decoded, weight 1) for the close and fold it into the weighted
        sum (worker thread)."""
        if tokens <= 0:
            raise ValueError("a contribution needs a positive token count")
        index = len(self.contributors)
        buffer = self._buffer(index)
        contribution.fold_into(buffer, 1.0, first=True)
        self._release(index, 0, self.numel)
        self.sum.fold(site, contribution, tokens)
        self.weights.append(tokens)
        self.sumsqs.append(contribution.sumsq)

    def ready(self) -> None:
        """The round's contributions are all in: fix its rule, and clip's scales or which ones
        filtered_mean keeps (a first pass over the spans for their distances, in the workers)."""
        self.rule = effective_rule(self.cfg.rule, len(self.contributors), self.cfg.trim)
        self.scales = None
        if self.rule == "clip":
            self.scales = clip_scales(self.sumsqs, self.cfg.clip_multiple)
        elif self.rule == "filtered_mean":
            spans = [(a, min(BLOCK, self.numel - a)) for a in range(0, self.numel, BLOCK)]
            squared = torch.zeros(len(self.contributors), dtype=torch.float64)
            for part in WORKERS.map(lambda span: self._distances(*span), spans):
                squared += part
            self.scales = kept_by_distance(squared.tolist(), self.cfg.filter_multiple)
        self.passthrough = self.scales is not None and all(f == 1.0 for f in self.scales)

    def set_aside(self) -> dict[str, float]:
        """After :meth:`ready`: the contributions this round's rule dropped (0) or scaled down
        (their factor), by contributor."""
        scales = self.scales or []
        return {name: round(f, 4) for name, f in zip(self.contributors, scales, strict=False) if f < 1.0}

    def _held(self, start: int, numel: int) -> torch.Tensor:
        """Every held copy's values of a span (contributions x numel), then unmapped."""
        values = torch.stack([h[start : start + numel] for h in self._buffers[: len(self.contributors)]])
        for index in range(len(self.contributors)):
            self._release(index, start, numel)
        return values

    def _distances(self, start: int, numel: int) -> torch.Tensor:
        """Each contribution's Σ (Δ - the coordinate-wise median)² over the block's sample: its
        first 1 / ``stride`` (the median is a sort per coordinate; a contiguous sample reads only
        its own pages of the held copies)."""
        values = self._held(start, max(1, numel // self.stride))
        return (values - combine(values, self.weights, "median")).double().square().sum(1)

    @property
    def stride(self) -> int:
        """1 / the share of each block's coordinates filtered_mean measures the distances on: at
        least ``SAMPLED`` coordinates in all, a power of two up to ``BLOCK``."""
        return max(1, min(BLOCK, 1 << max(0, (self.numel // SAMPLED).bit_length() - 1)))

    def prepare(self, start: int, numel: int) -> None:
        """Write the rule's aggregate of elements ``[start, start + numel)`` into :attr:`total`
        (nothing to do where the round commits the weighted sum)."""
        if self.passthrough:
            return
        out = self.total
        for a in range(start, start + numel, BLOCK):
            b = min(a + BLOCK, start + numel)
            out[a:b] = combine(self._held(a, b - a), self.weights, self.rule, self.cfg.trim, self.scales)

    def mean(self) -> torch.Tensor:
        """The whole aggregate (tests, tools)."""
        self.ready()
        self.prepare(0, self.numel)
        return self.total.div_(self.divisor)

    @property
    def divisor(self) -> int:
        """The weight where the round commits the weighted sum, else 1 (the aggregate is written)."""
        divisor = self.sum.divisor  # ValueError when nothing was folded
        return divisor if self.passthrough else 1

    def reset(self) -> None:
        """Empty for the next round, keeping the files (the next round overwrites them)."""
        self.sum.reset()
        self.weights, self.sumsqs = [], []
        self.rule, self.scales, self.passthrough = self.cfg.rule, None, False


def build_aggregate(
    cfg: AggregationConfig, numel: int, spill_dir: Path | None
) -> WeightedMean | HeldContributions:
    """The round's aggregate for ``cfg.rule``: the mean folds as contributions come, the others hold them."""
    return WeightedMean(numel) if cfg.rule == "mean" else HeldContributions(numel, cfg, spill_dir)
