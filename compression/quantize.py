"""Tensor stages: lossless fp32 and blockwise absmax int8."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from geodiloco.compression.errors import CodecError


def require_finite(x: torch.Tensor) -> None:
    """Refuse NaN/Inf: a non-finite pseudo-gradient would poison every replica."""
    if not bool(torch.isfinite(x).all()):
        raise CodecError("tensor contains NaN or Inf")


@dataclass(frozen=True, slots=True)
class Fp32:
    """Raw little-endian fp32: lossless, used for full-state transfer."""

    name = "fp32"

    def bits_per_param(self, numel: int) -> float:
        return 32.0

    def encoded_size(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: torch.Tensor) -> bytes:
        require_finite(x)
        return x.detach().to(torch.float32).contiguous().numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        if len(data) != 4 * numel:
            raise CodecError(f"fp32 payload is {len(data)} bytes, expected {4 * numel}")
        out = torch.frombuffer(bytearray(data), dtype=torch.float32)
        require_finite(out)
        return out


@dataclass(frozen=True, slots=True)
class BlockwiseInt8:
    """Per-block absmax scaling to int8.

    Each block of ``block`` elements stores one fp32 scale; every element is off by at most
    half a quantisation step, ``absmax(block) / 254``. Layout: scales, then int8 values.
    """

    block: int = 128
    name = "q8"

    def bits_per_param(self, numel: int) -> float:
        return 8.0 * self.encoded_size(numel) / max(numel, 1)

    def n_blocks(self, numel: int) -> int:
        return -(-numel // self.block)

    def encoded_size(self, numel: int) -> int:
        return 4 * self.n_blocks(numel) + numel

    def encode(self, x: torch.Tensor) -> bytes:
        x = x.detach().to(torch.float32).reshape(-1)
        require_finite(x)
        numel = x.numel()
        padded = torch.nn.functional.pad(x, (0, self.n_blocks(numel) * self.block - numel))
        blocks = padded.view(-1, self.block)
        scale = blocks.abs().amax(dim=1) / 127.0
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(blocks / safe[:, None]).clamp_(-127, 127).to(torch.int8)
        return scale.numpy().tobytes() + q.reshape(-1)[:numel].numpy().tobytes()

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        expected = self.encoded_size(numel)
        if len(data) != expected:
            raise CodecError(f"q8 payload is {len(data)} bytes, expected {expected} for {numel}")
        nb = self.n_blocks(numel)
        buf = bytearray(data)
        scale = torch.frombuffer(buf, dtype=torch.float32, count=nb)
        if not bool(torch.isfinite(scale).all()) or bool((scale < 0).any()):
            raise CodecError("q8 payload has a negative or non-finite block scale")
        q = torch.frombuffer(buf, dtype=torch.int8, offset=4 * nb, count=numel)
        pad = nb * self.block - numel
        values = torch.nn.functional.pad(q.to(torch.float32), (0, pad)).view(nb, self.block)
        return (values * scale[:, None]).reshape(-1)[:numel].contiguous()
