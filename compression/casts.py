"""Value codecs that store every element: fp32 (lossless), fp16 and bf16 casts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from geodiloco.compression.base import reinterpret, require_finite
from geodiloco.compression.codec_error import CodecError

FP16_MAX = 65504.0


@dataclass(frozen=True, slots=True)
class Fp32:
    """Raw little-endian fp32: 32 bits/param, exact; used for full-state transfer."""

    spec = "fp32"

    def encoded_size(self, numel: int) -> int:
        return 4 * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        require_finite(x)
        return x.contiguous().view(torch.uint8)

    def decode(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        out = reinterpret(raw, torch.float32)
        require_finite(out, "fp32 payload")
        return out

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(x)


@dataclass(frozen=True, slots=True)
class Fp16:
    """IEEE half: 16 bits/param, relative error 2^-11 (absolute 2^-25 near zero).

    Values beyond the fp16 range (65504) are refused rather than turned into Inf.
    """

    spec = "fp16"

    def encoded_size(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        require_finite(x)
        if x.numel() and float(x.abs().amax()) > FP16_MAX:
            raise CodecError(f"fp16: a value exceeds the fp16 range (|x| > {FP16_MAX})")
        return x.to(torch.float16).view(torch.uint8)

    def decode(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        out = reinterpret(raw, torch.float16).to(torch.float32)
        require_finite(out, "fp16 payload")
        return out

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs() * 2.0**-11 + 2.0**-25


@dataclass(frozen=True, slots=True)
class Bf16:
    """bfloat16: 16 bits/param, relative error 2^-8, the full fp32 exponent range."""

    spec = "bf16"

    def encoded_size(self, numel: int) -> int:
        return 2 * numel

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        require_finite(x)
        out = x.to(torch.bfloat16)
        require_finite(out, "bf16 cast (overflow)")
        return out.view(torch.uint8)

    def decode(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        out = reinterpret(raw, torch.bfloat16).to(torch.float32)
        require_finite(out, "bf16 payload")
        return out

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        return x.abs() * 2.0**-8 + 1e-38
