"""Elias-Fano coding of a sorted set of indices: about ``2 + log2(n / k)`` bits per index.

Each index is split into ``l`` low bits, stored packed, and a high part, stored in unary as
one set bit per index in a bit vector of ``k + (n - 1) >> l + 1`` bits. The size depends only
on ``n`` and ``k``, so a receiver knows it before reading a byte. A C kernel codes host index
sets (compression/_kernels.c, the same bytes); the torch code is the fallback and the device path.
"""

from __future__ import annotations

import torch

from geodiloco.compression.bits import pack_bits, packed_size, unpack_bits
from geodiloco.compression.codec_error import CodecError

try:
    from geodiloco.compression import _kernels
except ImportError:  # pragma: no cover - only where no C compiler was available at install
    _kernels = None  # type: ignore[assignment]

KERNEL_UNIVERSE = 1 << 56  # the kernels' bit reader takes up to 56 low bits at a time


def _low_bits(universe: int, count: int) -> int:
    return max(0, (universe // count).bit_length() - 1) if count else 0


def _high_bits(universe: int, count: int) -> int:
    return count + ((universe - 1) >> _low_bits(universe, count)) + 1 if count else 0


def encoded_size(universe: int, count: int) -> int:
    """Bytes for ``count`` distinct indices below ``universe``."""
    return packed_size(count, _low_bits(universe, count)) + packed_size(_high_bits(universe, count), 1)


def encode(indices: torch.Tensor, universe: int) -> torch.Tensor:
    """Strictly increasing int64 indices in ``[0, universe)`` -> uint8 tensor."""
    count = indices.numel()
    if count == 0:
        return torch.empty(0, dtype=torch.uint8)
    if _kernels is not None and _host(indices) and count <= universe < KERNEL_UNIVERSE:
        out = torch.empty(encoded_size(universe, count), dtype=torch.uint8, device=indices.device)
        if not _kernels.elias_fano_encode(indices.contiguous().numpy(), universe, out.numpy()):
            raise CodecError(f"index set: the indices are not strictly increasing within [0, {universe})")
        return out
    low = _low_bits(universe, count)
    high = torch.zeros(_high_bits(universe, count), dtype=torch.uint8)
    high[(indices >> low) + torch.arange(count)] = 1
    parts = [pack_bits(indices & ((1 << low) - 1), low)] if low else []
    return torch.cat([*parts, pack_bits(high, 1)])


def decode(raw: torch.Tensor, universe: int, count: int) -> torch.Tensor:
    """Inverse of :func:`encode`; refuses anything that is not ``count`` increasing indices."""
    if raw.numel() != encoded_size(universe, count):
        raise CodecError(f"index set: {raw.numel()} bytes, expected {encoded_size(universe, count)}")
    if count == 0:
        return torch.zeros(0, dtype=torch.int64)
    if _kernels is not None and raw.device.type == "cpu" and count <= universe < KERNEL_UNIVERSE:
        return _decode_fused(raw, universe, count)
    low = _low_bits(universe, count)
    split = packed_size(count, low)
    ones = torch.nonzero(unpack_bits(raw[split:], 1, _high_bits(universe, count))).view(-1)
    if ones.numel() != count:
        raise CodecError(f"index set: {ones.numel()} entries in the high part, expected {count}")
    indices = (ones - torch.arange(count)) << low
    if low:
        indices |= unpack_bits(raw[:split], low, count).to(torch.int64)
    if count > 1 and not bool((indices[1:] > indices[:-1]).all()):
        raise CodecError("index set: indices are not strictly increasing")
    if int(indices[-1]) >= universe:
        raise CodecError(f"index set: index {int(indices[-1])} is outside [0, {universe})")
    return indices


def _host(indices: torch.Tensor) -> bool:
    return indices.device.type == "cpu" and indices.dtype == torch.int64


def _decode_fused(raw: torch.Tensor, universe: int, count: int) -> torch.Tensor:
    """:func:`decode` by the C kernel: the same indices, and the same refusals."""
    out = torch.empty(count, dtype=torch.int64, device=raw.device)
    status, detail = _kernels.elias_fano_decode(raw.contiguous().numpy(), universe, out.numpy())
    if status == 1:
        raise CodecError(f"index set: {detail} entries in the high part, expected {count}")
    if status == 2:
        raise CodecError("index set: indices are not strictly increasing")
    if status == 3:
        raise CodecError(f"index set: index {detail} is outside [0, {universe})")
    return out
