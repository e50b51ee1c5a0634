"""The nibble split of int8 codes in front of the entropy stage.

Quantised Gaussian-like data keeps almost all of its redundancy in the high nibble of each
int8 code; the low nibbles are close to uniform noise. So ``q8|zstd`` hands zstd only the high
nibbles (two per byte) and stores the low ones as they are: the frame comes out within ~0.3% of
zstd over whole codes, and zstd's Huffman stage, which bounds the pipeline's speed, has half
the bytes to code. Byte ``j`` of each half holds elements ``2j`` (low 4 bits) and ``2j + 1``
(high 4 bits); an odd last element pairs with zero. The C kernel and the torch code give the
same bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    from geodiloco.compression import _kernels
except ImportError:  # pragma: no cover - only where no C compiler was available at install
    _kernels = None  # type: ignore[assignment]


def half_size(numel: int) -> int:
    return (numel + 1) // 2


def split(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high nibbles, low nibbles) of the contiguous uint8 tensor ``codes``, two per byte."""
    m = half_size(codes.numel())
    if _kernels is not None:
        hi, lo = torch.empty(m, dtype=torch.uint8), torch.empty(m, dtype=torch.uint8)
        _kernels.split_nibbles(codes.numpy(), hi.numpy(), lo.numpy())
        return hi, lo
    pairs = F.pad(codes, (0, codes.numel() % 2)).view(-1, 2)
    a, b = pairs[:, 0], pairs[:, 1]
    return (a >> 4) | (b & 0xF0), (a & 0x0F) | (b << 4)


def join(hi: bytes | memoryview, lo: bytes | memoryview, out: torch.Tensor) -> None:
    """Write the codes whose nibbles are ``hi`` and ``lo`` into the contiguous uint8 ``out``."""
    if _kernels is not None:
        _kernels.join_nibbles(out.numpy(), hi, lo)
        return
    h = torch.frombuffer(bytearray(hi), dtype=torch.uint8) if len(hi) else torch.empty(0, dtype=torch.uint8)
    low = torch.frombuffer(bytearray(lo), dtype=torch.uint8) if len(lo) else torch.empty(0, dtype=torch.uint8)
    n = out.numel()
    pairs = n // 2
    out[0 : 2 * pairs : 2] = (low[:pairs] & 0x0F) | (h[:pairs] << 4)
    out[1 : 2 * pairs : 2] = (low[:pairs] >> 4) | (h[:pairs] & 0xF0)
    if n % 2:
        out[n - 1] = (low[pairs] & 0x0F) | (h[pairs] << 4)
