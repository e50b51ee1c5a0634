"""4-bit level-table quantisers: E2M1 (FP4, as in Streaming DiLoCo) and normal-float levels.

Each block of ``block`` elements is scaled by its absmax ``a`` and every element is rounded to
the nearest of 16 (or 15) fixed levels in [-1, 1]; decoding is a table lookup times ``a``.
Error <= a * (widest gap between adjacent levels) / 2. Layout: fp32 ``a`` per block, then
4-bit codes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from geodiloco.compression.base import as_blocks, n_blocks, reinterpret
from geodiloco.compression.bits import pack_bits, packed_size, unpack_bits
from geodiloco.compression.errors import CodecError

FP32_MAX = torch.finfo(torch.float32).max


def e2m1_levels() -> tuple[float, ...]:
    """The 15 distinct FP4 E2M1 values (±0 merged), scaled so that 6 maps to 1."""
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    return tuple(sorted({s * m / 6.0 for m in mags for s in (-1.0, 1.0)}))


def normal_float_levels() -> tuple[float, ...]:
    """16 levels at the midpoints of 16 equal-probability bins of a standard normal, max = 1."""
    p = (torch.arange(16, dtype=torch.float64) + 0.5) / 16
    z = torch.distributions.Normal(0.0, 1.0).icdf(p)
    return tuple(float(v) for v in z / z.max())


@dataclass(frozen=True, slots=True)
class LevelQuantizer:
    """Absmax-scaled rounding to a fixed table of at most 16 levels; 4 bits + 32 per block."""

    name: str
    levels: tuple[float, ...]
    block: int = 128

    def __post_init__(self) -> None:
        if not 1 <= self.block <= 1 << 20:
            raise CodecError(f"{self.name} block size must be in [1, {1 << 20}], got {self.block}")

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.block}"

    def encoded_size(self, numel: int) -> int:
        return 4 * n_blocks(numel, self.block) + packed_size(numel, 4)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        numel, nb = x.numel(), n_blocks(x.numel(), self.block)
        out = torch.empty(self.encoded_size(numel), dtype=torch.uint8)
        if numel == 0:
            return out
        xb = as_blocks(x, self.block)
        absmax = xb.abs().amax(dim=1)
        if not bool(torch.isfinite(absmax).all()):
            raise CodecError("tensor contains NaN or Inf")
        out[: 4 * nb].view(torch.float32).copy_(absmax)
        inv = torch.where(absmax > 0, 1.0 / absmax, torch.zeros_like(absmax))
        y = (xb * inv[:, None]).clamp_(-1.0, 1.0).view(-1)[:numel]
        table = torch.tensor(self.levels, dtype=torch.float32)
        codes = torch.bucketize(y, (table[1:] + table[:-1]) / 2)
        out[4 * nb :].copy_(pack_bits(codes.to(torch.uint8), 4))
        return out

    def decode(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        if raw.numel() != self.encoded_size(numel):
            raise CodecError(f"{self.spec}: {raw.numel()} bytes, expected {self.encoded_size(numel)}")
        nb = n_blocks(numel, self.block)
        absmax = reinterpret(raw[: 4 * nb], torch.float32)
        if nb and not bool(((absmax >= 0) & (absmax <= FP32_MAX)).all()):
            raise CodecError(f"{self.spec}: a block scale is negative or not finite")
        codes = unpack_bits(raw[4 * nb :], 4, numel).long()
        if numel and int(codes.max()) >= len(self.levels):
            raise CodecError(f"{self.spec}: a code exceeds the {len(self.levels)} levels")
        values = torch.tensor(self.levels, dtype=torch.float32)[codes]
        return (as_blocks(values, self.block) * absmax[:, None]).view(-1)[:numel].contiguous()

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return torch.zeros(0)
        table = torch.tensor(self.levels, dtype=torch.float64)
        half_gap = float((table[1:] - table[:-1]).max()) / 2
        absmax = as_blocks(x, self.block).abs().amax(dim=1)
        return (absmax * half_gap * (1 + 1e-5)).repeat_interleave(self.block)[: x.numel()] + 1e-30
