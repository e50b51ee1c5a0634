"""What every value codec offers, and the small tensor helpers they share."""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from geodiloco.compression.codec_error import CodecError


class ValueCodec(Protocol):
    """Maps a flat fp32 tensor to a fixed number of bytes and back."""

    @property
    def spec(self) -> str:
        """The canonical spec string, e.g. ``q4:128``."""
        ...

    def encoded_size(self, numel: int) -> int:
        """Bytes of the encoding of ``numel`` elements (independent of their values)."""
        ...

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Flat finite fp32 tensor -> uint8 tensor of ``encoded_size`` bytes."""
        ...

    def decode(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        """uint8 tensor of ``encoded_size`` bytes -> flat fp32 tensor; raises CodecError."""
        ...

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Per-element upper bound on ``|x - decode(encode(x))|``."""
        ...


def require_finite(x: torch.Tensor, what: str = "tensor") -> None:
    """Refuse NaN/Inf: a non-finite pseudo-gradient would poison every replica."""
    if x.numel() and not bool(torch.isfinite(x).all()):
        raise CodecError(f"{what} contains NaN or Inf")


def reinterpret(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View a uint8 slice as ``dtype``, copying only when the slice is misaligned."""
    if raw.numel() == 0:
        return torch.empty(0, dtype=dtype, device=raw.device)
    if raw.storage_offset() % dtype.itemsize:
        raw = raw.clone()
    return raw.view(dtype)


def as_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` as rows of ``block`` elements, zero-padded at the end (a view when it divides)."""
    pad = (-x.numel()) % block
    return (F.pad(x, (0, pad)) if pad else x).view(-1, block)


def n_blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def block_rows(x: torch.Tensor, block: int) -> list[tuple[int, torch.Tensor]]:
    """``x`` as (first block index, rows) parts: the whole blocks as a view, then the zero-padded tail.

    Avoids copying the whole tensor just to pad its last block.
    """
    full = x.numel() // block
    parts = [(0, x[: full * block].view(full, block))] if full else []
    if x.numel() > full * block:
        parts.append((full, F.pad(x[full * block :], (0, (full + 1) * block - x.numel())).view(1, block)))
    return parts
