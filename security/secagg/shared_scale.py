"""Shared-scale int8 quantisation: every site codes a block with the same step, so the sum of
the sites' integer codes, times that step, is the sum of their (weighted) values.

Steps are quarter-octaves, step = 2^(q/4) with q an int16 per block: a site proposes, per block,
the smallest q whose grid ±127·step holds its block; the coordinator publishes the largest
proposal of each block (:func:`agree`), 2 bytes per block each way. A quarter-octave grid loses
at most 19% of resolution to rounding the step up, against the plain codec's exact absmax step;
the exponent leaks only ⌈4·log2⌉ of a site's block absmax (docs/security.md). Steps come from a
four-entry table and an exact power-of-two scaling, so every machine computes the same floats.
"""

from __future__ import annotations

import numpy as np
import torch

from geodiloco.security.secagg.ring import CODE_MAX
from geodiloco.security.secagg.secagg_errors import InvalidField

ZERO = -32768  # an all-zero block: step 0, codes 0
Q_MIN, Q_MAX = -4 * 126, 4 * 120  # normal fp32 steps, and grids far below fp32's largest value
_MANTISSA = np.array([2.0 ** (i / 4) for i in range(4)], dtype=np.float32)


def n_blocks(numel: int, block: int) -> int:
    return (numel + block - 1) // block


def steps(q: np.ndarray) -> np.ndarray:
    """The fp32 step of each block's exponent (0 for :data:`ZERO`)."""
    q32 = q.astype(np.int32)
    out = np.ldexp(_MANTISSA[q32 % 4], q32 // 4).astype(np.float32)
    out[q32 == ZERO] = 0.0
    return out


def _blocks(x: torch.Tensor, start: int, block: int) -> tuple[int, torch.Tensor]:
    """(first block, x laid in rows of whole absolute blocks, zero-padded at both ends)."""
    first, lead = divmod(start, block)
    rows = n_blocks(lead + x.numel(), block)
    padded = torch.zeros(rows * block, dtype=torch.float32)
    padded[lead : lead + x.numel()] = x.reshape(-1)
    return first, padded.view(rows, block)


def propose(x: torch.Tensor, start: int, block: int) -> tuple[int, np.ndarray]:
    """(first block, int16 exponents) of the blocks that elements [start, start + numel) touch:
    the smallest q per block with 127·2^(q/4) >= the block's absmax."""
    first, rows = _blocks(x, start, block)
    absmax = rows.abs().amax(dim=1).double().numpy()
    if not np.isfinite(absmax).all():
        raise InvalidField("delta", "contains NaN or Inf")
    with np.errstate(divide="ignore"):
        q = np.ceil(4 * np.log2(absmax / CODE_MAX))
    q = np.clip(np.nan_to_num(q, neginf=Q_MIN), Q_MIN, Q_MAX).astype(np.int16)
    short = steps(q).astype(np.float64) * CODE_MAX < absmax  # log2's rounding, one quarter at most
    q[short & (q < Q_MAX)] += 1
    q[absmax == 0] = ZERO
    return first, q


def merge(into: np.ndarray, first: int, q: np.ndarray) -> None:
    """Fold one shard's proposal into a site's (or the round's) per-block maximum."""
    view = into[first : first + q.size]
    np.maximum(view, q, out=view)


def quantise(x: torch.Tensor, start: int, block: int, q: np.ndarray) -> np.ndarray:
    """int8 codes of elements [start, start + numel) on the agreed grid ``q`` (all blocks),
    clamped to ±127: a value beyond the agreed grid is cut to it, which bounds any one site."""
    first, rows = _blocks(x, start, block)
    if first + rows.shape[0] > q.size:
        raise InvalidField("start", f"elements beyond the {q.size} agreed blocks")
    step = torch.from_numpy(steps(q[first : first + rows.shape[0]]))
    inv = torch.where(step > 0, 1.0 / step, torch.zeros_like(step))
    codes = rows.mul_(inv[:, None]).round_().clamp_(-CODE_MAX, CODE_MAX).to(torch.int8).view(-1)
    lead = start - first * block
    return codes[lead : lead + x.numel()].numpy()


def dequantise(total: np.ndarray, block: int, q: np.ndarray, weight: float) -> torch.Tensor:
    """The weighted mean from the sum of codes (any integer dtype) of the whole vector:
    Σ codes · step / weight."""
    if weight <= 0:
        raise InvalidField("weight", f"must be > 0, got {weight}")
    _, rows = _blocks(torch.from_numpy(total.astype(np.float32)), 0, block)
    step = torch.from_numpy(steps(q[: rows.shape[0]]))
    return rows.mul_(step[:, None]).div_(weight).view(-1)[: total.size]
