"""Top-k sparsification: keep the largest-magnitude fraction of a tensor, per tensor or per block.

Dropped elements decode to zero (error = their magnitude); error feedback at the sender carries
them into the next round. The kept indices are Elias-Fano coded (:mod:`.indices`), and their
values go through the pipeline's value codec. The number kept depends only on the size, so the
encoding of a given size always has the same length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from geodiloco.compression import indices
from geodiloco.compression.base import n_blocks, require_finite
from geodiloco.compression.codec_error import CodecError


@dataclass(frozen=True, slots=True)
class TopK:
    """Keep ``ceil(fraction * n)`` elements overall, or per block of ``block`` when ``block`` > 0."""

    fraction: float
    block: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise CodecError(f"topk fraction must be in (0, 1], got {self.fraction}")
        if not 0 <= self.block <= 1 << 20:
            raise CodecError(f"topk block must be 0 (per tensor) or in [1, {1 << 20}], got {self.block}")

    @property
    def spec(self) -> str:
        return f"topk:{self.fraction:g}" + (f":{self.block}" if self.block else "")

    def count(self, numel: int) -> int:
        if not self.block:
            return min(numel, math.ceil(self.fraction * numel))
        per_block = min(self.block, max(1, math.ceil(self.fraction * self.block)))
        full, tail = divmod(numel, self.block)
        return full * per_block + min(per_block, tail)

    def index_size(self, numel: int) -> int:
        return indices.encoded_size(numel, self.count(numel))

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """Sorted indices of the kept elements."""
        require_finite(x)
        numel, k = x.numel(), self.count(x.numel())
        if k == 0:
            return torch.zeros(0, dtype=torch.int64)
        if not self.block:
            return torch.topk(x.abs(), k, sorted=False).indices.sort().values
        per_block = min(self.block, max(1, math.ceil(self.fraction * self.block)))
        nb = n_blocks(numel, self.block)
        # Padding ranks below every real element, so a short last block keeps its own first.
        mags = F.pad(x.abs(), (0, nb * self.block - numel), value=-1.0).view(nb, self.block)
        local = torch.topk(mags, per_block, dim=1, sorted=False).indices.sort(dim=1).values
        flat = (local + torch.arange(nb)[:, None] * self.block).view(-1)
        return flat[flat < numel]
