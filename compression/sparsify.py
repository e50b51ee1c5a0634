"""Top-k sparsification: keep the largest-magnitude fraction of a tensor, per tensor or per block.

Dropped elements decode to zero (error = their magnitude); error feedback at the sender carries
them into the next round. The kept indices are Elias-Fano coded (:mod:`.indices`), and their
values go through the pipeline's value codec. The number kept depends only on the size, so the
encoding of a given size always has the same length.

Which elements are kept is a rule, not an accident of the sort: in each block the ``k`` largest
magnitudes, and of those equal to the k-th largest, the ones at the lowest positions. A C kernel
selects on host fp32 tensors (compression/_kernels.c, a radix select per block, no sort); the
torch code here is the fallback and the device path, and both keep the same elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from geodiloco.compression import indices
from geodiloco.compression.base import n_blocks, require_finite
from geodiloco.compression.codec_error import CodecError

try:
    from geodiloco.compression import _kernels
except ImportError:  # pragma: no cover - only where no C compiler was available at install
    _kernels = None  # type: ignore[assignment]

KERNEL_BLOCK = 1 << 31  # the kernel's positions within a block are int32


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

    def _per_block(self, block: int) -> int:
        return min(block, max(1, math.ceil(self.fraction * block)))

    def count(self, numel: int) -> int:
        if not self.block:
            return min(numel, math.ceil(self.fraction * numel))
        per_block = self._per_block(self.block)
        full, tail = divmod(numel, self.block)
        return full * per_block + min(per_block, tail)

    def index_size(self, numel: int) -> int:
        return indices.encoded_size(numel, self.count(numel))

    def select(self, x: torch.Tensor) -> torch.Tensor:
        """Sorted indices of the kept elements."""
        return self.select_values(x)[0]

    def select_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sorted indices of the kept elements, and their values (on ``x``'s device)."""
        x = x.detach().reshape(-1)
        numel = x.numel()
        if numel == 0:
            return torch.zeros(0, dtype=torch.int64, device=x.device), x[:0]
        block = self.block or numel  # per tensor: one block of the whole
        if (
            _kernels is not None
            and x.device.type == "cpu"
            and x.dtype == torch.float32
            and block < KERNEL_BLOCK
        ):
            k = self.count(numel)
            kept = torch.empty(k, dtype=torch.int64, device=x.device)
            values = torch.empty(k, dtype=torch.float32, device=x.device)
            if not _kernels.topk(
                x.contiguous().numpy(), block, self._per_block(block), kept.numpy(), values.numpy()
            ):
                raise CodecError("tensor contains NaN or Inf")
            return kept, values
        kept = self._select_torch(x, block)
        return kept, x[kept]

    def residual(self, x: torch.Tensor, kept: torch.Tensor, decoded: torch.Tensor, out: torch.Tensor) -> None:
        """``out`` = x − (zeros but ``decoded`` at ``kept``): error feedback's residual of a top-k
        code without its dense decoded tensor (one C pass on the host; x − 0 is x, so the same
        bits as the dense subtraction). ``x`` and ``out`` are host fp32 of one size."""
        if out.numel() != x.numel():
            raise ValueError(f"residual has {out.numel()} elements, the tensor {x.numel()}")
        if _kernels is not None and out.is_contiguous() and decoded.dtype == torch.float32:
            src = x.contiguous()
            if not _kernels.sparse_residual(
                src.numpy(), kept.numpy(), decoded.contiguous().numpy(), out.numpy()
            ):
                raise CodecError("residual: a kept index is outside the tensor")
            return
        out.copy_(x)
        out[kept] = x[kept] - decoded

    def _select_torch(self, x: torch.Tensor, block: int) -> torch.Tensor:
        require_finite(x)
        numel, k = x.numel(), self._per_block(block)
        nb = n_blocks(numel, block)
        # Padding ranks below every real element, so a short last block keeps its own first.
        mags = F.pad(x.abs(), (0, nb * block - numel), value=-1.0).view(nb, block)
        kth = torch.topk(mags, k, dim=1).values[:, -1:]  # its value is exact whatever topk's ties
        above = mags > kth
        tied = mags == kth
        keep = above | (tied & (tied.cumsum(dim=1) <= k - above.sum(dim=1, keepdim=True)))
        flat = torch.nonzero(keep.view(-1)).view(-1)
        return flat[flat < numel]
