"""Packing of fixed-width unsigned codes into bytes (little-endian bit order), vectorised."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def packed_size(count: int, width: int) -> int:
    """Bytes that ``count`` codes of ``width`` bits occupy."""
    return -(-count * width // 8)


def pack_bits(codes: torch.Tensor, width: int) -> torch.Tensor:
    """Pack codes in ``[0, 2**width)`` into a uint8 tensor of ``packed_size`` bytes."""
    if not 1 <= width <= 32:
        raise ValueError(f"bit width must be in [1, 32], got {width}")
    count = codes.numel()
    if width == 8:
        return codes.reshape(-1).to(torch.uint8)
    if 8 % width == 0:
        per = 8 // width
        c = F.pad(codes.reshape(-1).to(torch.uint8), (0, (-count) % per)).view(-1, per)
        out = c[:, 0].clone()
        for j in range(1, per):  # over bit positions within a byte, not over elements
            out |= c[:, j] << (width * j)
        return out
    shifts = torch.arange(width, dtype=torch.int64)
    bits = ((codes.reshape(-1).to(torch.int64)[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)
    bits = F.pad(bits, (0, (-bits.numel()) % 8)).view(-1, 8)
    return (bits << torch.arange(8, dtype=torch.uint8)).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: ``count`` codes as int64 (uint8 when ``width`` divides 8)."""
    if packed.numel() != packed_size(count, width):
        raise ValueError(f"{packed.numel()} bytes cannot hold exactly {count} codes of {width} bits")
    if width == 8:
        return packed[:count]
    if 8 % width == 0:
        shifts = torch.arange(0, 8, width, dtype=torch.uint8, device=packed.device)
        return ((packed[:, None] >> shifts) & ((1 << width) - 1)).reshape(-1)[:count]
    bits = ((packed[:, None] >> torch.arange(8, dtype=torch.uint8, device=packed.device)) & 1).reshape(-1)
    weights = torch.arange(width, dtype=torch.int64, device=packed.device)
    return (bits[: count * width].view(count, width).to(torch.int64) << weights).sum(dim=1)
