"""Level-table quantisers: E2M1 (FP4, as in Streaming DiLoCo), normal-float levels, and
2-bit Lloyd-Max levels for a Gaussian.

Each block of ``block`` elements is scaled by a statistic ``s`` and every element is rounded to
the nearest of a few fixed levels; decoding is a table lookup times ``s``. With the absmax as
``s`` the levels lie in [-1, 1] and the error is <= s * (widest gap between levels) / 2. With
the RMS as ``s`` (``lm2``) the levels are the mean-squared-error optimum for a Gaussian, an
element beyond the outer level is off by its excess, which error feedback carries, and there is
no zero level (an exact zero decodes to -0.453·s). With the mean magnitude as ``s`` and the
levels ±1 (``sign``), each element is its sign times its block's mean magnitude: the 1-bit code
whose scale minimises the squared error, for the values top-k keeps (all far from zero), at half
the bits of ``q2``. Layout: fp32 ``s`` per block, then the packed codes.

A mean magnitude is a float64 sum in a fixed order (:func:`tree_sum`), so that the C kernel of
the sign code (compression/_kernels.c), which codes host tensors, gives the same bytes as the
torch code here, the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from geodiloco.compression.base import as_blocks, n_blocks, reinterpret
from geodiloco.compression.bits import pack_bits, packed_size, unpack_bits
from geodiloco.compression.codec_error import CodecError

try:
    from geodiloco.compression import _kernels
except ImportError:  # pragma: no cover - only where no C compiler was available at install
    _kernels = None  # type: ignore[assignment]

FP32_MAX = torch.finfo(torch.float32).max
SIGN_LEVELS = (-1.0, 1.0)


def tree_sum(rows: torch.Tensor) -> torch.Tensor:
    """The sum of each row, as a binary tree: neighbours in pairs, then pairs of pairs, over the
    row zero-padded to a power of two. torch's own sum orders its terms by the machine's vector
    width; this order is fixed, and the C kernel sums in it too."""
    width = 1 << (rows.shape[1] - 1).bit_length()
    s = F.pad(rows, (0, width - rows.shape[1]))
    while s.shape[1] > 1:
        s = s[:, 0::2] + s[:, 1::2]
    return s[:, 0]


def e2m1_levels() -> tuple[float, ...]:
    """The 15 distinct FP4 E2M1 values (±0 merged), scaled so that 6 maps to 1."""
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    return tuple(sorted({s * m / 6.0 for m in mags for s in (-1.0, 1.0)}))


def normal_float_levels() -> tuple[float, ...]:
    """16 levels at the midpoints of 16 equal-probability bins of a standard normal, max = 1."""
    p = (torch.arange(16, dtype=torch.float64) + 0.5) / 16
    z = torch.distributions.Normal(0.0, 1.0).icdf(p)
    return tuple(float(v) for v in z / z.max())


def gaussian_two_bit_levels() -> tuple[float, ...]:
    """The 4-level Lloyd-Max quantiser of a unit Gaussian: on Gaussian data a mean squared error
    of 0.117 of the variance, against 0.31 for ``q2``'s ±a/3, ±a on each 128-element block's
    absmax (0.077 against 0.108 on uniform data)."""
    return (-1.5104, -0.4528, 0.4528, 1.5104)


@dataclass(frozen=True, slots=True)
class LevelQuantizer:
    """Rounding to a fixed table of at most ``2**bits`` levels, per block scaled by its absmax,
    its root mean square or its mean magnitude (``scale``); ``bits`` + 32 bits per block."""

    name: str
    levels: tuple[float, ...]
    block: int = 128
    bits: int = 4
    scale: Literal["absmax", "rms", "mean_abs"] = "absmax"

    def __post_init__(self) -> None:
        if not 1 <= self.block <= 1 << 20:
            raise CodecError(f"{self.name} block size must be in [1, {1 << 20}], got {self.block}")
        if len(self.levels) > 1 << self.bits:
            raise CodecError(f"{self.name}: {len(self.levels)} levels do not fit in {self.bits} bits")

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.block}"

    def encoded_size(self, numel: int) -> int:
        return 4 * n_blocks(numel, self.block) + packed_size(numel, self.bits)

    @property
    def max_scale(self) -> float:
        """The largest scale whose outer level is still a finite fp32 (with room for rounding)."""
        if self.scale != "rms":  # levels within [-1, 1]; a mean magnitude is at most the absmax
            return FP32_MAX
        return FP32_MAX / max(abs(v) for v in self.levels) * (1 - 2**-20)

    def _scales(self, xb: torch.Tensor, numel: int) -> torch.Tensor:
        if self.scale == "absmax":
            return xb.abs().amax(dim=1)
        counts = torch.full((xb.shape[0],), float(self.block), dtype=torch.float64, device=xb.device)
        counts[-1] = numel - (xb.shape[0] - 1) * self.block  # the zero padding is not data
        if self.scale == "mean_abs":
            return (tree_sum(xb.to(torch.float64).abs()) / counts).to(torch.float32)
        rms = (xb.to(torch.float64).square().sum(dim=1) / counts).sqrt()
        return rms.clamp_(max=self.max_scale).to(torch.float32)

    @property
    def fused(self) -> bool:
        """Whether the C kernels code this codec on the host (the sign code)."""
        return (
            _kernels is not None
            and self.scale == "mean_abs"
            and self.bits == 1
            and self.levels == SIGN_LEVELS
        )

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and x.device.type == "cpu" and x.dtype == torch.float32:
            out = torch.empty(self.encoded_size(x.numel()), dtype=torch.uint8, device=x.device)
            if not _kernels.sign_encode(x.detach().contiguous().numpy(), self.block, out.numpy()):
                raise CodecError("tensor contains NaN or Inf")
            return out
        return self._encode(x)[0]

    @property
    def device_ready(self) -> bool:
        """Whether :meth:`encode_on_device` applies: an RMS or a mean magnitude is a float64 sum
        whose order, and so whose last bit, differs between devices; an absmax is exact everywhere."""
        return self.scale == "absmax"

    def encode_on_device(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(The encoding as uint8, the values every receiver decodes from it), both on ``x``'s
        device; the same bytes as on the host."""
        if not self.device_ready:
            raise CodecError(f"{self.spec}: levels scaled by an RMS or a mean are coded on the host")
        out, codes, scale = self._encode(x)
        if codes is None:
            return out, torch.empty(0, dtype=torch.float32, device=x.device)
        values = self._table(x.device)[codes.long()]
        return out, (as_blocks(values, self.block) * scale[:, None]).view(-1)[: x.numel()].contiguous()

    def _table(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.levels, dtype=torch.float32, device=device)

    def _encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """The encoding, the codes and the block scales, on ``x``'s device."""
        numel, nb, device = x.numel(), n_blocks(x.numel(), self.block), x.device
        out = torch.empty(self.encoded_size(numel), dtype=torch.uint8, device=device)
        scale = out[: 4 * nb].view(torch.float32)
        if numel == 0:
            return out, None, scale
        xb = as_blocks(x, self.block)
        if not bool(torch.isfinite(xb).all()):
            raise CodecError("tensor contains NaN or Inf")
        scale.copy_(self._scales(xb, numel))
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        y = (xb * inv[:, None]).view(-1)[:numel]
        if self.scale == "absmax":
            y = y.clamp(-1.0, 1.0)
        table = self._table(device)
        bounds = (table[1:] + table[:-1]) / 2
        # one boundary (sign): a comparison gives bucketize's codes (y <= b: 0), 0.7 ms against 12 on 2^20
        codes = y > bounds[0] if bounds.numel() == 1 else torch.bucketize(y, bounds)
        out[4 * nb :].copy_(pack_bits(codes.to(torch.uint8), self.bits))
        return out, codes, scale

    def decode(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        if self.fused and raw.device.type == "cpu":
            out = torch.empty(numel, dtype=torch.float32, device=raw.device)
            self.scatter(raw, None, out)
            return out
        if raw.numel() != self.encoded_size(numel):
            raise CodecError(f"{self.spec}: {raw.numel()} bytes, expected {self.encoded_size(numel)}")
        nb = n_blocks(numel, self.block)
        scale = reinterpret(raw[: 4 * nb], torch.float32)
        if nb and not bool(((scale >= 0) & (scale <= self.max_scale)).all()):
            raise CodecError(f"{self.spec}: a block scale is negative, not finite or too large")
        codes = unpack_bits(raw[4 * nb :], self.bits, numel).long()
        if numel and int(codes.max()) >= len(self.levels):
            raise CodecError(f"{self.spec}: a code exceeds the {len(self.levels)} levels")
        values = torch.tensor(self.levels, dtype=torch.float32)[codes]
        return (as_blocks(values, self.block) * scale[:, None]).view(-1)[:numel].contiguous()

    def scatter(self, raw: torch.Tensor, kept: torch.Tensor | None, out: torch.Tensor) -> bool:
        """``out`` = :meth:`decode`'s values, or where ``kept`` (increasing indices) is given, zeros
        but those values at ``kept``: one C pass over the codes and the contiguous host fp32
        ``out``, for the sign code. False, nothing written, where the kernel does not apply.
        Refuses what :meth:`decode` refuses."""
        numel = out.numel() if kept is None else kept.numel()
        if not (
            self.fused and out.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous()
        ):
            return False
        if raw.numel() != self.encoded_size(numel):
            raise CodecError(f"{self.spec}: {raw.numel()} bytes, expected {self.encoded_size(numel)}")
        where = None if kept is None else kept.contiguous().numpy()
        if not _kernels.sign_decode(raw.contiguous().numpy(), numel, self.block, out.numpy(), where):
            what = "" if kept is None else ", or the kept indices are not increasing within the output"
            raise CodecError(f"{self.spec}: a block scale is negative, not finite or too large{what}")
        return True

    def add_and_hash(
        self,
        raw: torch.Tensor,
        kept: torch.Tensor,
        theta: torch.Tensor,
        first: int,
        residual: torch.Tensor | None,
    ) -> tuple[float, int, int] | None:
        """θ += (zeros but :meth:`decode`'s values at ``kept``, increasing indices), ``residual`` −=
        the same where given, with the new θ's Σ θ² and checksum sums as
        :func:`geodiloco.params.add_and_hash` computes them, in one C pass that never writes the
        dense values out: the same bits as decoding first. None, nothing written, where the kernel
        does not apply (not the sign code, not built, not contiguous host fp32). Refuses what
        decoding refuses."""
        tensors = [theta] if residual is None else [theta, residual]
        host = all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous() for t in tensors)
        if not (self.fused and theta.numel() and host):
            return None
        if raw.numel() != self.encoded_size(kept.numel()):
            raise CodecError(f"{self.spec}: {raw.numel()} bytes, expected {self.encoded_size(kept.numel())}")
        rest = None if residual is None else residual.numpy()
        done = _kernels.apply_sign(
            theta.numpy(),
            raw.contiguous().numpy(),
            kept.numel(),
            self.block,
            kept.contiguous().numpy(),
            rest,
            first,
        )
        if done is None:
            raise CodecError(
                f"{self.spec}: a block scale is negative, not finite or too large, "
                "or the kept indices are not increasing within the output"
            )
        return done

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return torch.zeros(0)
        table = torch.tensor(self.levels, dtype=torch.float64)
        half_gap = float((table[1:] - table[:-1]).max()) / 2
        scale = self._scales(as_blocks(x, self.block), x.numel()).repeat_interleave(self.block)[: x.numel()]
        bound = scale * half_gap
        if self.scale != "absmax":  # beyond the outer level: off by the excess
            bound = torch.maximum(bound, x.abs() - scale * float(table.abs().max()))
        return bound * (1 + 1e-5) + 1e-30
